"""Run a lab's checks on fresh ranks, once per lab, at each world size the command line
uses (4 and 3): the notebook's solution, its stubs, the correct alternatives and the wrong
solutions a lab's ``labN_mistakes.py`` lists (each must get the hint naming its mistake)."""

from __future__ import annotations

from pathlib import Path

from support import SLOWDOWN

from shardlab.course.labs.__main__ import notebook_to_script
from shardlab.course.labs.runners import run_on_fresh_ranks
from shardlab.course.labs.tasks import WORLD_SIZES, lab_tasks

ROOT = Path(__file__).resolve().parents[1]


def verdicts(lab: str, notebook: str, wrong: dict, correct: dict, folder: Path) -> dict:
    """{(case, world size): Result} for ``wrong`` ({case: (task id, fn, mistake, words)}),
    ``correct`` ({case: (task id, fn)}) and, per task, "solution <task>" (the functions of
    labs/solutions/<notebook>) and "stub <task>" (those of labs/<notebook>)."""
    (folder / "solution").mkdir(exist_ok=True)
    (folder / "stub").mkdir(exist_ok=True)
    solution = notebook_to_script(ROOT / "labs" / "solutions" / notebook, folder / "solution")
    stub = notebook_to_script(ROOT / "labs" / notebook, folder / "stub")
    cases = {}
    for t in lab_tasks(lab):
        cases[f"solution {t.id}"] = (t.id, str(solution))
        cases[f"stub {t.id}"] = (t.id, str(stub))
    cases.update({case: (task, fn) for case, (task, fn) in correct.items()})
    cases.update({case: (task, fn) for case, (task, fn, *_) in wrong.items()})
    out = {}
    for ws in WORLD_SIZES:
        results = run_on_fresh_ranks(list(cases.values()), scale=SLOWDOWN, world_size=ws)
        out.update({(case, ws): r for case, r in zip(cases, results, strict=True)})
    return out


def assert_mistake(results: dict, wrong: dict, case: str, ws: int) -> None:
    """The wrong solution fails its own task, with the hint that names its mistake."""
    task, _, mistake, words = wrong[case]
    result = results[case, ws]
    assert result.task == task
    assert result.status == "fail", result.line()
    assert result.mistake == mistake, result.line()
    assert words in result.message, result.line()
    assert "Traceback" not in result.message, result.line()
    assert "another problem" not in result.message, f"one mistake, one verdict: {result.line()}"
