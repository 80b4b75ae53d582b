"""predict.compare: prints the guess beside the measurement, never raises on a wrong guess."""

from shardlab.course import predict


def test_no_guess_prints_the_measurement(capsys):
    assert predict.compare(None, 2.5, what="mean") is None
    assert "measured 2.5" in capsys.readouterr().out


def test_numbers_agree_within_the_tolerance(capsys):
    assert predict.compare(16, 16.004, what="bytes") is True
    assert "✓" in capsys.readouterr().out
    assert predict.compare(4, 16, what="bytes") is False
    assert "✗" in capsys.readouterr().out
    assert predict.compare(24, 25.17, what="MB") is True          # within 5%
    assert predict.compare(24, 25.17, what="MB", rel_tol=0.01) is False


def test_lists_and_text_are_compared_element_by_element():
    assert predict.compare([6, 7, 8], [6.0, 7.0, 8.0], what="shard") is True
    assert predict.compare([6, 7], [6.0, 7.0, 8.0], what="shard") is False
    assert predict.compare(["all_gather", "forward"], ["all_gather", "forward"], what="order") is True
    assert predict.compare(["forward", "all_gather"], ["all_gather", "forward"], what="order") is False
    assert predict.compare("ZeRO2", "zero2", what="stage") is True
    assert predict.compare("none", None, what="stage") is True     # "nothing fits", typed as text
    assert predict.compare("zero1", None, what="stage") is False
    assert predict.compare("seven", 7, what="GB") is False        # a word where a number was asked
