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
def parity_log(request):
    """Record (configuration, max abs difference) for the summary printed at the end.

    The pair rides on the test's report (``user_properties``), so that under pytest-xdist
    (``make test`` runs the tests on several processes) it reaches the process that prints."""
    return lambda label, diff: request.node.user_properties.append(("parity", (label, float(diff))))


def pytest_runtest_logreport(report):
    if report.when == "call":
        _PARITY.extend(tuple(value) for key, value in report.user_properties if key == "parity")


def pytest_terminal_summary(terminalreporter):
    if _PARITY:
        terminalreporter.section("parity: max |shardlab - reference| over the final state dict")
        for label, diff in _PARITY:
            terminalreporter.write_line(f"{label:60} {diff:.2e}")
