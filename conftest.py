"""Repository-wide pytest hooks: how long each notebook and lab takes under nbval.

At the end of a run that executed notebooks (``make test``: ``pytest tests notebooks
--nbval-lax``), print each ``.ipynb`` file's total time, the sum of its cells' setup, call and
teardown durations, beside its budget: notebooks 90 s, labs 120 s, on 2 cores. The times are
printed, not asserted: timing is a benchmark, not a test (a busy machine would fail it).
With ``SHARDLAB_NB_TIMES=path.json`` the same numbers are also written to that file.

``--site-copies DIR`` runs each notebook under ``notebooks/`` as the website shows it (the
widgets' plain-text fallback, no ``SHARDLAB_LEARNER``, text progress bars: website/execute.py)
and keeps every notebook whose cells all passed in DIR, as ``make site`` would have executed it.
``make test`` passes it, so the notebooks run once and the site is built from that run; the
widgets themselves are run in a real browser by tests/test_browser.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent

BUDGET_S = {"notebook": 90.0, "lab": 120.0}

_seconds: dict[str, float] = defaultdict(float)
_cells: dict[str, int] = defaultdict(int)
_failed: dict[str, bool] = defaultdict(bool)


def budget_kind(path: str) -> str:
    """'lab' for anything under labs/, else 'notebook'."""
    return "lab" if "labs/" in path.replace("\\", "/") or path.startswith("labs") else "notebook"


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if not path.endswith(".ipynb"):
        return
    _seconds[path] += report.duration
    _cells[path] += report.when == "call"
    _failed[path] |= report.failed


def times() -> dict:
    """``{path: {seconds, budget_s, kind, cells, failed, over_budget}}`` for every notebook run."""
    out = {}
    for path, seconds in sorted(_seconds.items()):
        kind = budget_kind(path)
        out[path] = {"seconds": round(seconds, 2), "budget_s": BUDGET_S[kind], "kind": kind,
                     "cells": _cells[path], "failed": _failed[path], "over_budget": seconds > BUDGET_S[kind]}
    return out


def pytest_terminal_summary(terminalreporter):
    measured = times()
    if not measured:
        return
    terminalreporter.section("notebook and lab times under nbval (printed, not asserted)")
    width = max(len(p) for p in measured)
    for path, t in measured.items():
        note = "  OVER BUDGET" if t["over_budget"] else ""
        note += "  (failed)" if t["failed"] else ""
        terminalreporter.write_line(f"{path:<{width}}  {t['seconds']:6.1f} s of {t['budget_s']:.0f} s "
                                    f"({t['cells']} cells){note}")
    terminalreporter.write_line(f"on {os.cpu_count()} CPU core(s); budgets: notebooks 90 s, labs 120 s on 2 cores")
    target = os.environ.get("SHARDLAB_NB_TIMES")
    if target:
        with open(target, "w", encoding="utf-8") as f:
            json.dump({"cpu_count": os.cpu_count(), "ci": bool(os.environ.get("CI")), "notebooks": measured}, f, indent=2)
        terminalreporter.write_line(f"notebook times written to {target}")


# --- --site-copies: the nbval run of notebooks/ is the website's run -------------------------


def pytest_addoption(parser):
    parser.addoption("--site-copies", metavar="DIR", default=None,
                     help="run notebooks/ with the website's settings and keep each executed copy in DIR")


def _site():
    """website/execute.py, which owns the site's settings and the copies' format."""
    if str(ROOT / "website") not in sys.path:
        sys.path.insert(0, str(ROOT / "website"))
    import execute

    return execute


class _Copy:
    """One notebook's run: its key before the first cell, each cell's outputs, pass or fail."""

    def __init__(self, path: Path):
        self.path, self.key, self.outputs, self.failed = path, _site().key_of(path), {}, False
        self.started = time.perf_counter()


_copies: dict[Path, _Copy] = {}


def _site_notebook(item) -> Path | None:
    """The notebook under notebooks/ that this nbval cell belongs to, when --site-copies is on."""
    if not item.config.getoption("site_copies", None) or not hasattr(item, "cell_num"):
        return None
    path = Path(str(item.fspath)).resolve()
    return path if path.parent == ROOT / "notebooks" else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    path = _site_notebook(item)
    if path is None or item.parent.kernel is not None:
        yield
        return
    site = _site()
    _copies[path] = _Copy(path)
    with site.site_environment():  # the kernel starts in this setup, and keeps what it inherits
        yield
    kernel = item.parent.kernel
    if kernel is not None and kernel.is_alive():  # text progress bars, before the first cell
        kernel.await_idle(kernel.execute_cell_input(site.KERNEL_SETUP, allow_stdin=False), timeout=60)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    copy = _copies.get(_site_notebook(item))
    if copy is not None:
        copy.failed |= report.failed
        if call.when == "call":
            copy.outputs[item.cell_num] = list(getattr(item, "test_outputs", None) or [])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    path = _site_notebook(item)
    if path is None or path not in _copies or (nextitem is not None and nextitem.parent is item.parent):
        return
    copy = _copies.pop(path)
    if copy.failed:
        return  # make site runs it again, or fails where it fails
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    if set(copy.outputs) != set(range(len(code))):
        return  # some cell did not run (deselected, skipped): not a whole run
    for n, cell in enumerate(code):
        cell.outputs, cell.execution_count = copy.outputs[n], n + 1
        for out in cell.outputs:
            if out.get("output_type") == "execute_result":
                out["execution_count"] = n + 1
    out_dir = Path(item.config.getoption("site_copies"))
    _site().save_copy(path, nb, out_dir if out_dir.is_absolute() else ROOT / out_dir, copy.key,
                      time.perf_counter() - copy.started, by="nbval")

