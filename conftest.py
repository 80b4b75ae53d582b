"""Repository-wide pytest hooks: how long each notebook and lab takes under nbval.

At the end of a run that executed notebooks (``make test``: ``pytest tests notebooks
--nbval-lax``), print each ``.ipynb`` file's total time, the sum of its cells' setup, call and
teardown durations, beside its budget: notebooks 90 s, labs 120 s, on 2 cores. The times are
printed, not asserted: timing is a benchmark, not a test (a busy machine would fail it).
With ``SHARDLAB_NB_TIMES=path.json`` the same numbers are also written to that file.

``make test``'s nbval run of notebooks/ is also the website's run: website/nbval_copies.py, a
plugin it loads with ``-p website.nbval_copies --site-copies DIR``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

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
