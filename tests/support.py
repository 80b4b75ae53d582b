"""What the tests share, as a plain module: ``from support import slowdown``.

Timeouts and time limits in tests are written for a quiet 2-core machine and multiplied by
one factor, so that a loaded machine (a CI runner, another suite beside this one) gets more
time without weakening what a test asserts::

    SHARDLAB_TEST_SLOWDOWN=3 make test      # default 1; 2 when CI=true

Scale every timeout one way: ``slowdown(seconds)``. ``conftest.py`` applies the same factor
to pytest-timeout's and nbval's limits. (A plain module, not ``conftest``: pytest imports
each conftest.py under the name ``conftest``, so importing from it finds whichever came last.)
"""

from __future__ import annotations

import os

import pytest


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
