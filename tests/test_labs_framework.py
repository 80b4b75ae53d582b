"""The labs' machinery: one source per lab, the command line, time limits, the notebook's check().

The per-lab checkers are tested with wrong solutions in test_labs_checks.py.
"""

from __future__ import annotations

import csv
import inspect
import json
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path

import lab5_mistakes
import pytest
import torch
from support import SLOWDOWN, slowdown

from shardlab.course.labs import tasks
from shardlab.course.labs.__main__ import notebook_to_script
from shardlab.course.labs.generate import BEGIN, STUB, dumps, strip_solution, student_notebook

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "labs" / "solutions").glob("lab*.ipynb"))


# ---- one source: the student notebooks are generated from the solutions ----------------------

@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_committed_student_notebook_is_the_generated_one(solution):
    student = ROOT / "labs" / solution.name
    assert student.exists(), f"run: python -m shardlab.course.labs generate (missing {student})"
    expected = dumps(student_notebook(json.loads(solution.read_text())))
    assert student.read_text() == expected, (
        f"{student.name} is stale: run python -m shardlab.course.labs generate")
    code = "".join("".join(c["source"]) for c in json.loads(expected)["cells"])
    assert BEGIN not in code and STUB in code


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_notebooks_are_committed_without_outputs(solution):
    nb = json.loads(solution.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert any(BEGIN in "".join(c["source"]) for c in code), "a lab without a task"


def test_every_lab_with_a_solution_has_its_checks_and_a_check_cell_per_task():
    for solution in SOLUTIONS:
        lab = solution.stem.split("_")[0]
        text = solution.read_text()
        for t in tasks.lab_tasks(lab):
            assert f'check(\\"{t.id}\\", {t.fn_name})' in text, f"{solution.name}: no check cell for {t.id}"


def test_strip_solution_keeps_the_indentation_and_drops_the_answer():
    source = "def f(x):\n    \"\"\"Doc.\"\"\"\n    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\n"
    assert strip_solution(source) == f"def f(x):\n    \"\"\"Doc.\"\"\"\n    {STUB}\n"
    with pytest.raises(ValueError, match="without"):
        strip_solution("### BEGIN SOLUTION\nx = 1\n")
    with pytest.raises(ValueError, match="without"):
        strip_solution("x = 1\n### END SOLUTION\n")


def test_a_notebook_submission_keeps_its_definitions_not_its_cluster(tmp_path):
    nb = {"cells": [
        {"cell_type": "code", "source": ["import torch\n", "cluster = start_cluster(4)\n"]},
        {"cell_type": "markdown", "source": ["def not_code(): pass"]},
        {"cell_type": "code", "source": ["%%ranks\n", "x = 1\n"]},
        {"cell_type": "code", "source": ["%matplotlib inline\n", "def f(x):\n", "    return x\n", "check('a', f)\n"]},
    ]}
    path = tmp_path / "sub.ipynb"
    path.write_text(json.dumps(nb))
    script = notebook_to_script(path, tmp_path).read_text()
    assert "import torch" in script and "def f(x):" in script
    assert "start_cluster" not in script and "check(" not in script and "not_code" not in script


def test_a_notebook_submission_keeps_the_assignments_its_functions_use_and_names_its_lines(tmp_path):
    """A correct notebook whose function uses a top-level name must not fail under check/grade with
    a NameError; an error's line is the notebook's cell and line, not the generated script's."""
    from shardlab.course.labs.judge import _where

    nb = {"cells": [
        {"cell_type": "code", "source": ["import torch\n", "cluster = start_cluster(4)\n", "pad = torch.nn.functional.pad\n"]},
        {"cell_type": "markdown", "source": ["text"]},
        {"cell_type": "code", "source": ["runs = cluster.run(len)\n", "left = [0]\n", "late = undefined_name + 1\n"]},
        {"cell_type": "code", "source": ["x = 1\n", "def f(t):\n", "    left[0] += 1\n", "    return pad(t, (0, 1)).view(7)\n"]},
        # one line, two statements: the import is kept, the cluster is not (no whole-line copies);
        # a self-test that calls the learner's own function, and `count += 1` with count never
        # defined, would run (or fail) at import on every rank: both are left out
        {"cell_type": "code", "source": ["import os; cluster2 = start_cluster(4)\n",
                                         "y = 1; runs2 = cluster.run(f)\n",
                                         "shards = f(torch.zeros(6))\n", "count += 1\n",
                                         "total = 0\n", "total += x\n", "key = lambda t: f(t)\n"]},
    ]}
    path = tmp_path / "learner.ipynb"
    path.write_text(json.dumps(nb))
    script = notebook_to_script(path, tmp_path)
    text = script.read_text()
    assert "pad = torch.nn.functional.pad" in text and "left = [0]" in text and "x = 1" in text
    assert "start_cluster" not in text and "cluster.run" not in text and "undefined_name" not in text
    assert "import os" in text and "y = 1" in text and "total += x" in text and "key = lambda" in text
    assert "shards" not in text and "count" not in text
    namespace = {}
    exec(compile(text, str(script), "exec"), namespace)
    assert namespace["left"] == [0] and namespace["total"] == 1 and namespace["y"] == 1
    assert namespace["f"](torch.zeros(6)).shape == (7,) and namespace["left"] == [1]
    with pytest.raises(RuntimeError) as info:  # view(7) of 3 elements
        namespace["f"](torch.zeros(2))
    assert _where(info.value, {str(script)}) == " (line 4 of code cell 3 in learner.ipynb)"


def _last_has_no_next(units, x):
    return units[len(units)]


def _a_tensor_index(units, x):
    return torch.zeros(2)[5]


def _a_list_of_its_own(units, x):
    sizes = []
    return sizes[0]


@pytest.mark.parametrize("fn, named", [(_last_has_no_next, True), (_a_tensor_index, False), (_a_list_of_its_own, False)])
def test_lab5_says_past_the_end_only_for_an_index_into_the_units(fn, named):
    """lab 5 tells an IndexError as "the last unit has no next one" only when the learner's line
    indexes the unit list; any other is told as it is, with its line."""
    from shardlab.course.labs.lab5 import _past_the_end

    with pytest.raises(IndexError) as info:
        fn([1, 2], None)
    assert _past_the_end(info.value, fn) is named


# ---- the command line: check and grade on fresh local ranks ----------------------------------

def _cli(*args, timeout):
    return subprocess.run([sys.executable, "-m", "shardlab.course.labs", *args], capture_output=True,
                          text=True, timeout=slowdown(timeout), cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def _lab1_solution_script(tmp_path) -> Path:
    return notebook_to_script(ROOT / "labs" / "solutions" / "lab1_shard_and_gather.ipynb", tmp_path)


@pytest.mark.slow
def test_cli_check_passes_the_solution_and_fails_a_wrong_file(tmp_path):
    good = _lab1_solution_script(tmp_path)
    done = _cli("check", "lab1", str(good), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("✓ lab1.") for line in lines), done.stdout

    wrong = tmp_path / "wrong.py"
    wrong.write_text(good.read_text().replace("return shard / world_size", "return shard")
                     .replace("def all_reduce_mean", "def renamed"))
    done = _cli("check", "lab1", str(wrong), timeout=240)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    assert "4x too large" in lines[2]
    assert "not implemented yet: no function all_reduce_mean in wrong.py" in lines[3]


@pytest.mark.slow
def test_grade_survives_hanging_and_deadlocking_submissions(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "a_solution.ipynb").write_text((ROOT / "labs/solutions/lab1_shard_and_gather.ipynb").read_text())
    (subs / "b_student.ipynb").write_text((ROOT / "labs/lab1_shard_and_gather.ipynb").read_text())
    good = _lab1_solution_script(tmp_path).read_text()
    # hangs in task 2 (a rank skips the all-gather: a deadlock), then an endless loop in task 3
    (subs / "c_hang.py").write_text(good.replace(
        "    comm.all_gather(full, shard)", "    if dist.get_rank() != 1:\n        comm.all_gather(full, shard)")
        .replace("import torch\n", "import torch\nimport torch.distributed as dist\n", 1)
        .replace("    shard = torch.empty(grad.numel() // world_size", "    while True:\n        pass\n    shard = torch.empty(grad.numel() // world_size"))
    (subs / "e_forever.py").write_text("while True:\n    pass\n")
    done = _cli("grade", "lab1", str(subs), "--timeout", "6", "--scale", str(SLOWDOWN), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = list(csv.DictReader(open(subs / "grades_lab1.csv")))
    table = {(r["file"], r["task"].split(".")[1]): (r["result"], r["hint"]) for r in rows}
    assert len(rows) == 4 * 4
    assert all(table["a_solution.ipynb", t][0] == "pass" for t in
               ("pad_and_split", "gather_full", "mean_grad_shard", "all_reduce_mean"))
    assert all(table["b_student.ipynb", t][0] == "not implemented" for t in
               ("pad_and_split", "gather_full", "mean_grad_shard", "all_reduce_mean"))
    assert table["c_hang.py", "pad_and_split"][0] == "pass"
    assert table["c_hang.py", "gather_full"][0] != "pass"  # rank 1 skipped the all-gather
    assert table["c_hang.py", "mean_grad_shard"] == (
        "timed out", f"your function was still running after {6 * SLOWDOWN:.0f} s: an endless loop?")
    assert table["c_hang.py", "all_reduce_mean"][0] != "pass"
    assert all(table["e_forever.py", t][0] == "timed out" for t in ("pad_and_split", "all_reduce_mean"))
    assert "importing your file did not finish" in table["e_forever.py", "gather_full"][1]
    assert "a_solution.ipynb: 4/4 tasks pass" in done.stdout


# ---- in a notebook: check() on the running cluster ------------------------------------------

_NOTEBOOK_CODE = '''
import torch
from shardlab import comm

def gather_full(shard, numel, world_size):
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(full, shard)
    return full[:numel]

def deadlocks(shard, numel, world_size):
    if torch.distributed.get_rank() == 3:  # rank 3 never joins the all-gather
        return torch.arange(1.0, numel + 1)
    return gather_full(shard, numel, world_size)

def stub(shard, numel, world_size):
    raise NotImplementedError("your code here")

def raises(shard, numel, world_size):
    return shard.view(3, 7)
''' + "\n" + inspect.getsource(lab5_mistakes.forward_prefetch_past_the_end)  # lab 5: no bound check


@pytest.mark.slow
def test_check_in_a_notebook_survives_a_deadlock_and_keeps_the_cluster(capsys, monkeypatch):
    from shardlab.cluster import start_cluster
    from shardlab.course.labs import check

    ns = {"__name__": "__main__"}  # like cells: these functions travel to the ranks by value
    # the kernel's linecache holds the cell, as IPython's does; the ranks' does not
    monkeypatch.setitem(linecache.cache, "<cell>",
                        (len(_NOTEBOOK_CODE), None, _NOTEBOOK_CODE.splitlines(True), "<cell>"))
    exec(compile(_NOTEBOOK_CODE, "<cell>", "exec"), ns)
    cluster = start_cluster(4, quiet=True)
    try:
        assert check("lab1.gather_full", ns["stub"]) is False
        assert "not implemented yet: write gather_full above" in capsys.readouterr().out
        assert check("lab1.gather_full", ns["deadlocks"], timeout=slowdown(5)) is False
        out = capsys.readouterr().out
        assert "✗ lab1.gather_full: timed out after" in out, out
        assert "did every rank call the same collectives in the same order?" in out, out
        # rank 3 is named among those that never joined (on a loaded machine a slow rank may be
        # named beside it: it had not reached the collective when the others gave up)
        assert re.search(r"waited in a collective that ranks? [0-9, and]*3 never joined", out), out
        assert check("lab1.gather_full", ns["raises"]) is False
        out = capsys.readouterr().out
        assert "your function raised RuntimeError" in out and "line 19 of your cell" in out, out
        assert "Traceback" not in out
        assert check("lab5.forward_prefetch", ns["forward_prefetch_past_the_end"]) is False  # read off the cell's line
        out = capsys.readouterr().out
        assert "the last unit has no next one" in out, out
        assert check("lab1.gather_full", ns["gather_full"]) is True  # the cluster is usable again
        assert "✓ lab1.gather_full" in capsys.readouterr().out
    finally:
        cluster.stop()


def test_generate_check_finds_no_stale_student_notebook():
    from shardlab.course.labs.__main__ import main

    assert main(["generate", "--check", "--root", str(ROOT / "labs")]) == 0
