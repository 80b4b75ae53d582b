"""Tagged values (instruments/measured.py): numbers that keep saying what produced them."""

import copy
import json
import pickle
import statistics

import numpy as np
import pytest

from shardlab.instruments.measured import (
    Formula,
    Measured,
    Published,
    describe,
    kind_of,
    require_measured,
    tag_like,
)


def test_they_are_numbers_and_print_as_numbers():
    m = Measured(16640, by="memory_report")
    assert isinstance(m, int) and m == 16640 and f"{m:,}" == "16,640" and repr(m) == "16640"
    assert json.dumps({"m": m, "f": Measured(0.5, by="t")}) == '{"m": 16640, "f": 0.5}'
    assert list(range(Measured(3, by="t"))) == [0, 1, 2]


def test_arithmetic_keeps_a_tag_only_among_one_kind():
    m, f = Measured(4000, by="memory_report"), Formula(4000, formula="4Ψ")
    assert kind_of(m / 1e3) == "measured" and (m / 1e3).by == "memory_report"
    assert kind_of(3 * m - m) == "measured" and kind_of(sum([m, m])) == "measured"
    assert kind_of(m + Measured(1, by="trace")) == "measured" and (m + Measured(1, by="trace")).by == "memory_report; trace"
    assert kind_of(f / 4) == "formula" and kind_of(m / f) == "plain" and kind_of(m - f) == "plain"
    assert kind_of(Published(144, source="p") / f) == "plain"
    assert kind_of(round(Measured(2.567, by="t"), 2)) == "measured" and kind_of(abs(-m)) == "measured"
    assert kind_of(statistics.median([Measured(1.0, by="t"), Measured(2.0, by="t")])) == "measured"
    assert kind_of(m > f) == "plain"                       # a comparison is a bool, never tagged


def test_a_plain_number_added_to_a_measurement_is_not_measured():
    """``mem["total"] + 2 * psi`` mixes a measurement with a hand-written number: no longer measured."""
    m = Measured(4000, by="memory_report")
    assert kind_of(m + 5) == "plain" and kind_of(5 + m) == "plain" and kind_of(m - 5) == "plain"
    assert kind_of(5 - m) == "plain" and kind_of(Published(144, source="p") + 1) == "plain"
    assert kind_of(m + 0) == "measured" and kind_of(sum([m, m])) == "measured"   # sum() starts at 0
    assert kind_of(m * 5) == "measured" and kind_of(m - m) == "measured"
    with pytest.raises(TypeError, match="plain number"):
        require_measured(m + 1234, "side_by_side")


def test_tag_like_tags_inside_lists_tuples_and_numpy_numbers():
    got = tag_like({"a": [1, 2.5], "b": (3, "x"), "c": np.int64(4), "d": np.float32(0.5)}, "formula", "f")
    assert [kind_of(v) for v in got["a"]] == ["formula", "formula"] and type(got["b"]) is tuple
    assert kind_of(got["b"][0]) == "formula" and got["b"][1] == "x"
    assert kind_of(got["c"]) == "formula" and got["c"] == 4 and kind_of(got["d"]) == "formula"
    assert kind_of(tag_like([1, 2], "measured", "x")) == "measured"
    assert kind_of(tag_like(True, "formula", "f")) == "plain"          # a bool is not a number here


def test_copying_a_tagged_list_copies_it():
    order = Measured(["gather", "free"], by="trace")
    for c in (copy.copy(order), copy.deepcopy(order)):
        c.append("forward")
        assert order == ["gather", "free"] and kind_of(c) == "measured" and c.by == "trace"


def test_tags_survive_pickling_as_ranks_send_them():
    for v in (Measured(3, by="count_comm"), Formula(0.5, formula="1/N"), Measured(["a", "b"], by="trace")):
        back = pickle.loads(pickle.dumps(v))
        assert back == v and type(back) is type(v) and describe(back) == describe(v)


def test_a_tag_must_name_its_source():
    with pytest.raises(TypeError, match="needs by="):
        Measured(3)
    with pytest.raises(TypeError, match="needs source="):
        Published(3)
    with pytest.raises(TypeError, match="True/False"):
        Measured(True, by="t")
    assert describe(Published(44, source="Table 2")) == "published (Table 2)"
    assert kind_of([Measured(1, by="t"), 2]) == "plain"


def test_a_notebook_that_calls_a_formula_measured_fails_under_nbval(tmp_path):
    """The guarantee end to end: the cell raises, so nbval (and CI) fails the notebook."""
    import os
    import subprocess
    import sys

    from support import slowdown

    cells = ["from shardlab.course import predict\nfrom shardlab.instruments import memory_math\n"
             "from shardlab.instruments.measured import Formula, Measured",
             "predict.compare(None, Measured(2.0, by='count_comm'), what='volume in Ψ')",   # fine
             "predict.compare(None, Formula(memory_math.comm_elements('zero3', 10) / 10, formula='3Ψ'), "
             "what='volume in Ψ')"]
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {},
                     "outputs": [], "source": [c]} for i, c in enumerate(cells)],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "formula_as_measured.ipynb"
    path.write_text(json.dumps(nb))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider", str(path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=slowdown(120))
    assert run.returncode != 0, run.stdout
    assert "1 failed, 2 passed" in run.stdout, run.stdout[-2000:]   # the cells before it ran
    assert "this value is a formula, not a measurement" in run.stdout
