"""pytest's hooks and fixtures for tests/: the slow-down factor applied to pytest's own limits,
and the parity summary.

The shared helpers live in the plain module ``support.py`` (``from support import slowdown``);
this file only reads ``SLOWDOWN`` from it, to scale pytest's and nbval's limits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so spawned ranks can import tests/workers.py

from support import SLOWDOWN  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads its setting
def pytest_configure(config):
    # pytest-timeout's per-test limit and nbval's per-cell limit scale with the same factor.
    limit = getattr(config.option, "timeout", None) or config.getini("timeout")
    if limit:
        config.option.timeout = float(limit) * SLOWDOWN
    cell = getattr(config.option, "nbval_cell_timeout", None)
    if cell:
        config.option.nbval_cell_timeout = int(float(cell) * SLOWDOWN)


def pytest_report_header(config):
    return f"shardlab: timeouts x{SLOWDOWN:g} (SHARDLAB_TEST_SLOWDOWN; CI=true defaults to 2)"


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
