from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so spawned ranks can import tests/workers.py

_PARITY: list[tuple[str, float]] = []


@pytest.fixture
def parity_log():
    """Record (configuration, max abs difference) for the summary printed at the end."""
    return lambda label, diff: _PARITY.append((label, diff))


def pytest_terminal_summary(terminalreporter):
    if _PARITY:
        terminalreporter.section("parity: max |shardlab - reference| over the final state dict")
        for label, diff in _PARITY:
            terminalreporter.write_line(f"{label:60} {diff:.2e}")
