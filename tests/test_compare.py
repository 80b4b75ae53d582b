"""The formula-beside-measurement table the notebooks print: only measurements in the measured column."""

import pytest

from shardlab.course.compare import side_by_side
from shardlab.instruments.measured import Formula, Measured


def test_prints_each_row_with_its_ratio(capsys):
    ratios = side_by_side([("grads", "4Ψ", 4000, Measured(4000, by="t")),
                           ("optimizer", "8Ψ", 8000, Measured(8024, by="t"))], unit="KB", title="t")
    assert ratios == {"grads": 1.0, "optimizer": pytest.approx(1.003)}
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "t" and "KB (formula)" in out[1] and "KB (measured)" in out[1]
    assert out[3].split()[:4] == ["optimizer", "8Ψ", "8.000", "8.024"] and out[3].endswith("1.003")


def test_bad_rows_and_units_are_refused():
    with pytest.raises(ValueError, match="unknown unit"):
        side_by_side([("a", "x", 1, Measured(1, by="t"))], unit="furlongs")
    with pytest.raises(ValueError, match="rows must be"):
        side_by_side([("a", 1, 1)])


def test_a_formula_in_the_measured_column_is_refused():
    with pytest.raises(TypeError, match="'sent', measured column: this value is a formula"):
        side_by_side([("sent", "2(N-1)/N·Ψ·4", 100, Formula(100, formula="ring"))])
    with pytest.raises(TypeError, match="plain number, not a measurement"):
        side_by_side([("grads", "4Ψ", 4000, 4000)])
