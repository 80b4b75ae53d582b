"""Predict, then run: set the number you expect beside the one the ranks measured.

A notebook asks for a prediction first, in a variable that starts as ``None``::

    predicted = None        # your guess: how many numbers will rank 2 hold?

and the next cell measures and compares::

    predict.compare(predicted, measured, what="numbers on rank 2")

It prints and returns the verdict, and never asserts on the guess: the course runs unattended
(CI, nbval) with no guess typed, and a wrong guess is the lesson, not an error. The cell's own
asserts check the measurement against the formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _close(guess, measured, rel_tol: float) -> bool:
    if isinstance(measured, str) or isinstance(guess, str):
        return str(guess).strip().lower() == str(measured).strip().lower()
    if isinstance(measured, Sequence):
        return (isinstance(guess, Sequence) and not isinstance(guess, str) and len(guess) == len(measured)
                and all(_close(g, m, rel_tol) for g, m in zip(guess, measured)))
    try:
        return math.isclose(float(guess), float(measured), rel_tol=rel_tol, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def _show(value, unit: str) -> str:
    if isinstance(value, float):
        value = f"{value:,.4g}"
    elif isinstance(value, int):
        value = f"{value:,}"
    return f"{value}{' ' + unit if unit else ''}"


def compare(guess, measured, *, what: str, unit: str = "", rel_tol: float = 0.05,
            source: str = "measured") -> bool | None:
    """Print the learner's guess beside the measurement; True/False, or None when no guess was typed.

    Numbers agree within ``rel_tol`` (5% by default), sequences element by element, text
    ignoring case. ``source`` names what the number is: "measured" here, or "published" for a
    figure a paper printed (never call a published figure measured).
    """
    if guess is None:
        print(f"{what}: {source} {_show(measured, unit)}. (No prediction typed: set it in the cell "
              f"above and run both cells again, to see how close you were.)")
        return None
    ok = _close(guess, measured, rel_tol)
    verdict = "✓ right" if ok else "✗ not quite: read on to see why"
    print(f"{what}: you predicted {_show(guess, unit)}, {source} {_show(measured, unit)}. {verdict}")
    return ok
