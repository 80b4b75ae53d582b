"""predict.compare: prints the guess beside the measurement, never raises on a wrong guess,
and refuses a formula or a plain number in the measured place."""

import pytest

from shardlab.course import predict
from shardlab.instruments.measured import Formula, Measured, Published


def m(value):
    return Measured(value, by="test")


def test_no_guess_prints_the_measurement(capsys):
    assert predict.compare(None, m(2.5), what="mean") is None
    assert "measured 2.5" in capsys.readouterr().out


def test_numbers_agree_within_the_tolerance(capsys):
    assert predict.compare(16, m(16.004), what="bytes") is True
    assert "✓" in capsys.readouterr().out
    assert predict.compare(4, m(16), what="bytes") is False
    assert "✗" in capsys.readouterr().out
    assert predict.compare(24, m(25.17), what="MB") is True          # within 5%
    assert predict.compare(24, m(25.17), what="MB", rel_tol=0.01) is False


def test_also_accepts_named_other_answers_and_nothing_between(capsys):
    """54 measured, 53 another system's count: both right, 55 not (rel_tol 2% would take all three)."""
    assert predict.compare(54, m(54), what="calls", rel_tol=0.005, also=(53,)) is True
    assert predict.compare(53, m(54), what="calls", rel_tol=0.005, also=(53,)) is True
    assert "other count" in capsys.readouterr().out
    assert predict.compare(55, m(54), what="calls", rel_tol=0.005, also=(53,)) is False
    assert predict.compare(55, m(54), what="calls", rel_tol=0.02) is True   # why also= exists


def test_lists_and_text_are_compared_element_by_element():
    assert predict.compare([6, 7, 8], m([6.0, 7.0, 8.0]), what="shard") is True
    assert predict.compare([6, 7], m([6.0, 7.0, 8.0]), what="shard") is False
    assert predict.compare(["all_gather", "forward"], m(["all_gather", "forward"]), what="order") is True
    assert predict.compare(["forward", "all_gather"], m(["all_gather", "forward"]), what="order") is False
    assert predict.compare("ZeRO2", formula="zero2", what="stage") is True
    assert predict.compare("seven", m(7), what="GB") is False        # a word where a number was asked


def test_a_formula_or_a_plain_number_is_refused_as_a_measurement():
    with pytest.raises(TypeError, match="formula, not a measurement: pass it as formula="):
        predict.compare(3, Formula(3.0, formula="3Ψ"), what="volume")
    with pytest.raises(TypeError, match="plain number, not a measurement"):
        predict.compare(3, 3.0, what="volume")
    with pytest.raises(TypeError, match="plain number"):
        predict.compare(None, [1.0, 2.0], what="shard")             # untagged list, no guess typed either
    with pytest.raises(TypeError, match="published figure"):
        predict.compare(3, Published(3.0, source="paper"), what="TFLOPS")
    with pytest.raises(TypeError, match="exactly one"):
        predict.compare(3, m(3), formula=3, what="volume")


def test_formula_and_published_are_printed_as_what_they_are(capsys):
    assert predict.compare(None, formula=Formula(0.4667, formula="(p-1)/(m+p-1)"), what="bubble") is None
    out = capsys.readouterr().out
    assert "the formula gives 0.4667" in out and "measured" not in out
    assert predict.compare(140, published=144, source="Narayanan et al. 2021", what="TFLOPS") is True
    out = capsys.readouterr().out
    assert "published (Narayanan et al. 2021) 144" in out and "measured" not in out
    assert predict.compare(None, published=Published(44, source="Table 2"), what="TFLOPS") is None
    assert "published (Table 2)" in capsys.readouterr().out
    with pytest.raises(TypeError, match="source="):
        predict.compare(1, published=44, what="TFLOPS")
    with pytest.raises(TypeError, match="formula= got a measured value"):
        predict.compare(1, formula=m(2), what="x")


def test_a_true_or_false_prediction_is_echoed_as_true_or_false(capsys):
    """A bool is an int in Python: the echo must not turn the learner's True into 1."""
    assert predict.compare(True, formula=True, what="closer") is True
    out = capsys.readouterr().out
    assert "you predicted True, the formula gives True" in out and " 1" not in out
    assert predict.compare(False, formula=True, what="closer") is False
    assert "you predicted False, the formula gives True" in capsys.readouterr().out
