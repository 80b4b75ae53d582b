"""The one table of what each stage shards (``instruments/stages.py``) says what the engine does.

The engine keeps its own class attributes; the formulas, the planner and the bench read the
table. If the two ever disagree, this fails and names the attribute."""

import pytest

from shardlab.engine.ddp import DataParallel
from shardlab.engine.zero1 import ZeRO1
from shardlab.engine.zero2 import ZeRO2
from shardlab.engine.zero3 import FSDP
from shardlab.instruments import memory_math, stages

ENGINES = {"ddp": DataParallel, "zero1": ZeRO1, "zero2": ZeRO2, "zero3": FSDP}


@pytest.mark.parametrize("name", stages.NAMES)
def test_each_row_agrees_with_its_engine_class(name):
    row, cls = stages.STAGES[name], ENGINES[name]
    assert row.number == cls.stage
    assert row.shards_optimizer_state == cls.shards_optimizer_state
    assert row.shards_params == cls.shards_params
    assert row.reduce_as_ready == cls.reduce_as_ready
    # The engine shards a gradient when it reduce-scatters it as soon as it is ready.
    assert row.shards_grads == (cls.shards_optimizer_state and cls.reduce_as_ready)


def test_the_formulas_are_read_from_the_table():
    psi, n = 1000, 4
    states = memory_math.model_state_breakdown(psi, n, "mixed-adam")
    for row in stages.STAGES.values():
        parts = states[row.name]
        assert parts["params"] == 2 * psi / (n if row.shards_params else 1)
        assert parts["grads"] == 2 * psi / (n if row.shards_grads else 1)
        assert parts["optimizer"] == 12 * psi / (n if row.shards_optimizer_state else 1)
    assert [memory_math.formula_text(s) for s in stages.NAMES] == ["16Ψ", "4Ψ + 12Ψ/Nd", "2Ψ + 14Ψ/Nd", "16Ψ/Nd"]


def test_names_and_numbers():
    assert [stages.stage(i).name for i in range(4)] == list(stages.NAMES)
    assert stages.stage("ZeRO-2") is stages.stage(2) and stages.stage("fsdp").name == "zero3"
    with pytest.raises(ValueError, match="unknown stage"):
        stages.stage("zero4")
