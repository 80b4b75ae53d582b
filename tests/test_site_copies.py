"""website/nbval_copies.py, the plugin that keeps ``make test``'s nbval run of notebooks/ as the
website's copies: run here on small notebooks of its own, in pytester.

A whole run is kept, its cells numbered as the page labels them and its tracebacks naming the
same numbers (``Cell In[2]`` for the second code cell, as under nbclient); a run with a failing
cell, a skipped cell, or a kernel set-up that failed is not kept.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from support import slowdown

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _notebook(folder: Path, *cells: tuple[str, list[str]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src, metadata={"tags": tags}) for src, tags in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "book.ipynb"
    nbformat.write(nb, path)
    return path


def _run(pytester, monkeypatch, notebook: Path):
    """nbval on ``notebook`` with the plugin, in a process of its own (kernels and their zmq
    sockets do not outlive it)."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = pytester.path / "copies"
    result = pytester.runpytest_subprocess(
        "-p", "website.nbval_copies", "--nbval-lax", "--nbval-cell-timeout=120", "-p", "no:cacheprovider",
        f"--site-copies={out}", f"--site-notebooks={notebook.parent}", str(notebook), timeout=slowdown(240))
    return result, out / notebook.name


def test_a_whole_run_is_kept_numbered_as_its_page_and_its_tracebacks(pytester, monkeypatch):
    notebook = _notebook(pytester.path / "notebooks", ("x = 1", []),
                         ('raise ValueError("on purpose")', ["raises-exception"]), ("print(x)", []))
    result, copy = _run(pytester, monkeypatch, notebook)
    result.assert_outcomes(passed=3)
    cells = nbformat.read(copy, as_version=4).cells
    assert [c.execution_count for c in cells] == [1, 2, 3]
    (error,) = cells[1].outputs
    assert error.output_type == "error" and error.ename == "ValueError"
    assert "Cell In[2]" in ANSI.sub("", "\n".join(error.traceback))  # nbval alone: Cell In[1]
    assert cells[2].outputs[0].text == "1\n"
    assert nbformat.read(copy, as_version=4).metadata["shardlab_site"]["by"] == "nbval"


@pytest.mark.parametrize("case", ["failing", "skipped"])
def test_a_failed_or_partly_run_notebook_is_not_kept(pytester, monkeypatch, case):
    second = ('raise ValueError("a bug")', []) if case == "failing" else ("y = 2", ["nbval-skip"])
    notebook = _notebook(pytester.path / "notebooks", ("x = 1", []), second)
    result, copy = _run(pytester, monkeypatch, notebook)
    result.assert_outcomes(**({"passed": 1, "failed": 1} if case == "failing" else {"passed": 1, "skipped": 1}))
    assert not copy.exists()


def test_a_kernel_set_up_that_fails_fails_the_first_cell_and_keeps_nothing(pytester, monkeypatch):
    pytester.makeconftest(f"""
import sys
sys.path.insert(0, {str(ROOT / "website")!r})
import execute
execute.KERNEL_SETUP = "import no_such_module_here\\n"
""")
    notebook = _notebook(pytester.path / "notebooks", ("x = 1", []), ("print(x)", []))
    result, copy = _run(pytester, monkeypatch, notebook)
    result.assert_outcomes(failed=1, errors=1)  # the first cell errs in its setup; x is then never set
    result.stdout.fnmatch_lines(["*the site's kernel set-up failed: ModuleNotFoundError*"])
    assert not copy.exists()
