"""Predict, then run: set the number you expect beside the one the ranks measured.

A notebook asks for a prediction first, in a variable that starts as ``None``::

    predicted = None        # your guess: how many numbers will rank 2 hold?

and the next cell measures and compares::

    predict.compare(predicted, measured, what="numbers on rank 2")

``measured`` must be a :class:`~shardlab.instruments.measured.Measured` value, what an
instrument returns (``memory_report``, ``count_comm``, ``trace``, ``time_steps``...). Where no
instrument measures the quantity, say what it is instead, and it is printed so::

    predict.compare(predicted, formula=bubble, what="pipeline bubble")           # "the formula gives"
    predict.compare(predicted, published=tflops, source="Narayanan et al. 2021",
                    what="Megatron's TFLOPS")                                      # "published (source)"

A plain number or a formula in the measured place raises a TypeError naming the fix, so a
notebook that calls a formula "measured" fails under nbval.

It prints and returns the verdict, and never asserts on the guess: the course runs unattended
(CI, nbval) with no guess typed, and a wrong guess is the lesson, not an error. The cell's own
asserts check the measurement against the formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardlab.instruments.measured import Published, describe, kind_of, require_measured

__all__ = ["compare", "require_measured"]


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
    if isinstance(value, bool):   # a bool is an int: without this, True would print as 1
        return str(value)
    if isinstance(value, float):
        value = f"{value:,.4g}"
    elif isinstance(value, int):
        value = f"{value:,}"
    return f"{value}{' ' + unit if unit else ''}"


def compare(guess, measured=None, *, what: str, unit: str = "", rel_tol: float = 0.05,
            formula=None, published=None, source: str | None = None, also=()) -> bool | None:
    """Print the learner's guess beside the value; True/False, or None when no guess was typed.

    Give exactly one of ``measured`` (a ``Measured`` value: printed "measured"), ``formula=``
    (printed "the formula gives") or ``published=`` with ``source=`` (or a ``Published`` value:
    printed "published (source)"). Numbers agree within ``rel_tol`` (5% by default),
    sequences element by element, text ignoring case. ``also``: other answers that count as
    right, each within ``rel_tol`` too (another system's count, which the cell must explain),
    so that a tolerance need not be widened to take them in, and with them the wrong ones beside.
    """
    given = [name for name, v in (("measured", measured), ("formula", formula), ("published", published))
             if v is not None]
    if len(given) != 1:
        raise TypeError(f"compare({what!r}) needs exactly one of measured, formula=, published=; "
                        f"got {given or 'none'}")
    if measured is not None:
        require_measured(measured, f"predict.compare({what!r})")
        value, label = measured, "measured"
    elif formula is not None:
        if kind_of(formula) == "measured":
            raise TypeError(f"predict.compare({what!r}): formula= got a measured value "
                            f"({describe(formula)}): pass it as the measurement")
        value, label = formula, "the formula gives"
    else:
        src = source or (published.source if isinstance(published, Published) else None)
        if not src:
            raise TypeError(f"predict.compare({what!r}): a published figure needs source=... (its citation)")
        value, label = published, f"published ({src})"
    if guess is None:
        print(f"{what}: {label} {_show(value, unit)}. (No prediction typed: set it in the cell "
              f"above and run both cells again, to see how close you were.)")
        return None
    other = not _close(guess, value, rel_tol) and any(_close(guess, a, rel_tol) for a in also)
    ok = _close(guess, value, rel_tol) or other
    verdict = ("✓ right, by the other count this cell accepts" if other else "✓ right") if ok else "✗ not quite: read on to see why"
    print(f"{what}: you predicted {_show(guess, unit)}, {label} {_show(value, unit)}. {verdict}")
    return ok
