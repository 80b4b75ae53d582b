"""The root conftest prints each notebook's nbval time beside its budget, and writes it as JSON."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def fresh_hooks():
    spec = importlib.util.spec_from_file_location("root_conftest_under_test", ROOT_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its own tallies, apart from the live run's
    return module


class Reporter:
    def __init__(self):
        self.lines = []

    def section(self, title):
        self.lines.append(f"== {title}")

    def write_line(self, line):
        self.lines.append(line)


def report(nodeid, when, duration, failed=False):
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration, failed=failed)


def test_times_are_summed_per_file_and_printed_with_budgets(tmp_path, monkeypatch):
    hooks = fresh_hooks()
    for r in [report("notebooks/01_memory_math.ipynb::Cell 0", "setup", 0.5),
              report("notebooks/01_memory_math.ipynb::Cell 0", "call", 10.0),
              report("notebooks/01_memory_math.ipynb::Cell 1", "call", 85.0),
              report("labs/lab1_shard_and_gather.ipynb::Cell 0", "call", 30.0, failed=True),
              report("tests/test_quiz.py::test_ids", "call", 99.0)]:
        hooks.pytest_runtest_logreport(r)
    out = tmp_path / "times.json"
    monkeypatch.setenv("SHARDLAB_NB_TIMES", str(out))
    rep = Reporter()
    hooks.pytest_terminal_summary(rep)
    text = "\n".join(" ".join(line.split()) for line in rep.lines)  # spacing aside
    assert "notebooks/01_memory_math.ipynb 95.5 s of 90 s (2 cells) OVER BUDGET" in text
    assert "labs/lab1_shard_and_gather.ipynb 30.0 s of 120 s (1 cells) (failed)" in text
    assert "test_quiz" not in text
    saved = json.loads(out.read_text())["notebooks"]
    assert saved["notebooks/01_memory_math.ipynb"] == {
        "seconds": 95.5, "budget_s": 90.0, "kind": "notebook", "cells": 2, "failed": False, "over_budget": True}
    assert saved["labs/lab1_shard_and_gather.ipynb"]["kind"] == "lab"


def test_nothing_printed_without_notebooks(monkeypatch):
    monkeypatch.delenv("SHARDLAB_NB_TIMES", raising=False)
    rep = Reporter()
    fresh_hooks().pytest_terminal_summary(rep)
    assert rep.lines == []
