"""The labs' checkers: ``check("lab1.pad_and_split", pad_and_split)`` in a lab notebook.

Each lab (``labs/labN_<topic>.ipynb``) asks for a few functions; after each one, a check cell
runs the learner's function on the notebook's live ranks against a reference and prints one
line: ✓ and what was verified, ✗ and a hint naming the likely mistake, or "not implemented yet".
The checks of lab N live in ``labN.py``, on the lab's model (``model.py``) and what a check
watches (``watch.py``: every collective, and what happened to each unit). The machinery: the
task registry (``tasks.py``), judging one task on one rank within a time limit (``judge.py``),
many ranks' outcomes -> one line (``verdicts.py``), and where the ranks run (``runners.py``).
For instructors: ``python -m shardlab.course.labs check|grade|generate`` (see ``__main__.py``).
"""

from __future__ import annotations

from shardlab.course.labs.runners import run_on_cluster
from shardlab.course.labs.tasks import LABS, Hint, lab_tasks, task
from shardlab.course.labs.verdicts import Result

__all__ = ["LABS", "Hint", "Result", "check", "lab_tasks", "task"]


def check(task_id: str, fn, *, timeout: float | None = None) -> bool:
    """Run ``task_id``'s check of ``fn`` on every rank of the running cluster; print one line.

    Prints ✓ and what was verified, or ✗ and a hint (then a stronger hint, when the check has
    one), or "not implemented yet" for a stub. Never raises for a wrong ``fn``, and never waits
    more than the task's time limit (``timeout`` seconds, if given) for a deadlocked collective.
    Returns True when the check passed.
    """
    result = run_on_cluster(task_id, fn, timeout=timeout)
    print(result.line())
    if result.stronger and result.status == "fail":
        print(f"  stronger hint: {result.stronger}")
    return result.passed
