"""Run a lab's checks on fresh ranks, once per test module: the notebook's solution, its stubs,
and the wrong implementations a test file lists (each must get the hint naming its mistake)."""

from __future__ import annotations

from pathlib import Path

from support import SLOWDOWN

from shardlab.course.labs.__main__ import notebook_to_script
from shardlab.course.labs.checking import lab_tasks, run_on_fresh_ranks

ROOT = Path(__file__).resolve().parents[1]


def verdicts(lab: str, notebook: str, wrong: dict, folder: Path) -> dict:
    """{case: Result} for ``wrong`` ({case: (task id, fn)}) plus, per task, "solution <task>"
    (the functions of labs/solutions/<notebook>) and "stub <task>" (those of labs/<notebook>)."""
    solution = notebook_to_script(ROOT / "labs" / "solutions" / notebook, folder / "solution")
    stub = notebook_to_script(ROOT / "labs" / notebook, folder / "stub")
    cases = {}
    for t in lab_tasks(lab):
        cases[f"solution {t.id}"] = (t.id, str(solution))
        cases[f"stub {t.id}"] = (t.id, str(stub))
    cases.update(wrong)
    results = run_on_fresh_ranks(list(cases.values()), scale=SLOWDOWN)
    return dict(zip(cases, results, strict=True))


def script_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lab")
    (folder / "solution").mkdir()
    (folder / "stub").mkdir()
    return folder
