"""Formula beside measurement, with the ratio: the table every notebook prints.

::

    ratios = side_by_side([("grads", "4Ψ", 4 * psi, report["grads"]), ...], unit="KB")
    assert abs(ratios["grads"] - 1) < 0.01

The ratio is measured / formula, so 1.000 means the formula predicted the live ranks exactly.
The measured column takes only :class:`~shardlab.instruments.measured.Measured` values (what
the instruments return): a plain number or a formula there raises a TypeError, so a table
cannot print a formula under "measured". The formula column takes any number.
"""

from __future__ import annotations

from shardlab.course.predict import require_measured

SCALES = {"bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "elements": 1, "ms": 1e-3, "s": 1}


def side_by_side(rows, unit: str = "bytes", title: str | None = None, measured_by: str = "measured") -> dict:
    """Print ``(label, formula text, formula value, measured value)`` rows; return label -> ratio."""
    if unit not in SCALES:
        raise ValueError(f"unknown unit {unit!r}; choose one of {list(SCALES)}")
    rows = [tuple(r) for r in rows]
    if not rows or any(len(r) != 4 for r in rows):
        raise ValueError("rows must be (label, formula text, formula value, measured value) tuples")
    for label, _text, _formula, measured in rows:
        require_measured(measured, f"side_by_side row {label!r}, measured column")
    scale = SCALES[unit]
    fmt = (lambda v: f"{v / scale:,.0f}") if scale == 1 else (lambda v: f"{v / scale:,.3f}")
    width = max(len(str(r[0])) for r in rows) + 2
    ftext = max(len(str(r[1])) for r in rows) + 2
    if title:
        print(title)
    heads = (f"{unit} (formula)", f"{unit} ({measured_by})")
    w1, w2 = max(16, len(heads[0]) + 2), max(18, len(heads[1]) + 2)
    print(f"{'':<{width}}{'formula':<{ftext}}{heads[0]:>{w1}}{heads[1]:>{w2}}{'ratio':>8}")
    ratios = {}
    for label, text, expected, measured in rows:
        ratio = measured / expected if expected else float("nan")
        ratios[label] = ratio
        print(f"{label:<{width}}{text:<{ftext}}{fmt(expected):>{w1}}{fmt(measured):>{w2}}{ratio:>8.3f}")
    return ratios
