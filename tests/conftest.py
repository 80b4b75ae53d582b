"""Shared test helpers: the slow-down factor for every timeout, and the parity summary.

Timeouts and time limits in tests are written for a quiet 2-core machine and multiplied by
one factor, so that a loaded machine (a CI runner, another suite beside this one) gets more
time without weakening what a test asserts::

    SHARDLAB_TEST_SLOWDOWN=3 make test      # default 1; 2 when CI=true

Use :func:`slowdown` (``from conftest import slowdown``) or the ``slowdown`` fixture.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so spawned ranks can import tests/workers.py


def _factor() -> float:
    raw = os.environ.get("SHARDLAB_TEST_SLOWDOWN", "").strip()
    if not raw:
        return 2.0 if os.environ.get("CI", "").lower() == "true" else 1.0
    try:
        factor = float(raw)
    except ValueError:
        raise pytest.UsageError(f"SHARDLAB_TEST_SLOWDOWN must be a number >= 1, got {raw!r}") from None
    if factor < 1:
        raise pytest.UsageError(f"SHARDLAB_TEST_SLOWDOWN must be >= 1 (it only adds time), got {raw!r}")
    return factor


SLOWDOWN = _factor()


def slowdown(seconds: float) -> float:
    """``seconds`` on a quiet machine, scaled by SHARDLAB_TEST_SLOWDOWN for this run."""
    return seconds * SLOWDOWN


@pytest.fixture(name="slowdown")
def slowdown_fixture():
    """The :func:`slowdown` function, for tests that prefer a fixture to an import."""
    return slowdown


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
