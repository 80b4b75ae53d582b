"""The labs' task registry: which checks a lab has, in the notebook's order, and the Hint a check raises.

A task's check is a function that runs on every rank, inside an initialised process group. It
calls the learner's function, compares with a reference, and either returns what it verified
or raises :class:`Hint` naming the mistake::

    @task("lab1.gather_full", fn_name="gather_full")
    def check_gather_full(fn) -> str:
        ...                       # every collective first (the learner's and the reference's)
        if wrong_in_a_known_way:  # then judge: a Hint raised on some ranks only must not leave
            raise Hint("...", mistake="kept_padding")   # the other ranks waiting in a collective
        return "the full tensor is back on all 4 ranks"

Each check judges its own task alone: it calls only the learner's function for that task, so a
task that is still a stub, or wrong, never fails another one.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

#: Seconds a task may take on a 2-core laptop before it counts as timed out (a deadlock).
DEFAULT_TIMEOUT = 30.0

#: The labs, by id: ``lab1`` -> its topic (the notebook is ``labs/lab1_shard_and_gather.ipynb``).
LABS = {"lab1": "shard_and_gather", "lab2": "zero1", "lab3": "zero2", "lab4": "fsdp_unit",
        "lab5": "prefetch", "lab6": "diagnose"}

#: The world sizes the command line, the grader and the tests check every task at: 3 makes
#: padding necessary, and code that hard-codes 4 ranks fails there.
WORLD_SIZES = (4, 3)


class Hint(Exception):  # noqa: N818 - a learner reads "Hint", not "HintError"
    """A recognised mistake. ``message`` names what the learner did; ``stronger`` (optional) points
    at the line to change and the idea, never the whole answer; ``mistake`` is a short id that
    stays the same on every rank (one verdict per mistake) and that the tests assert on."""

    def __init__(self, message: str, stronger: str | None = None, *, mistake: str | None = None,
                 broken: bool = False):
        super().__init__(message)
        self.message, self.stronger, self.mistake = message, stronger, mistake
        self.broken = broken  # raised inside a collective's call: the process group cannot be trusted


@dataclasses.dataclass(frozen=True)
class Task:
    id: str                      # "lab1.pad_and_split"
    fn_name: str                 # the learner's function: "pad_and_split"
    check: Callable[..., str]    # runs on every rank: check(fn) -> what was verified
    timeout: float               # seconds, before the task counts as timed out


_TASKS: dict[str, Task] = {}


def task(task_id: str, fn_name: str, *, timeout: float = DEFAULT_TIMEOUT):
    """Register the decorated function as the check of ``task_id`` (in the lab's order)."""
    def register(check):
        _TASKS[task_id] = Task(task_id, fn_name, check, timeout)
        return check
    return register


def lab_tasks(lab: str) -> list[Task]:
    """The tasks of ``lab`` ("lab1" or "lab1_shard_and_gather"), in the order of the notebook."""
    lab = lab.split("_")[0]
    if lab not in LABS:
        raise ValueError(f"unknown lab {lab!r}: the labs are {', '.join(LABS)}")
    importlib.import_module(f"shardlab.course.labs.{lab}")  # registers its tasks
    return [t for t in _TASKS.values() if t.id.split(".")[0] == lab]


def get_task(task_id: str) -> Task:
    names = [t.id for t in lab_tasks(task_id.split(".")[0])]
    if task_id not in _TASKS:
        raise ValueError(f"unknown task {task_id!r}: this lab's tasks are {', '.join(names)}")
    return _TASKS[task_id]
