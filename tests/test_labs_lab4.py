"""Lab 4 (one FSDP unit): on 4 and on 3 ranks, the checks pass the solution and the correct
alternatives, say "not implemented" to the stubs, and give each wrong solution the hint that
names its mistake."""

from __future__ import annotations

import lab4_mistakes as lab
import pytest
from labs_support import assert_mistake, verdicts

from shardlab.course.labs.tasks import WORLD_SIZES, lab_tasks

TASKS = [t.id for t in lab_tasks("lab4")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return verdicts("lab4", "lab4_fsdp_unit.ipynb", {**lab.WRONG, **lab.ON_THREE}, lab.CORRECT,
                    tmp_path_factory.mktemp("lab4"))


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("task", TASKS)
def test_solution_passes_and_stub_is_not_implemented(results, task, ws):
    assert results[f"solution {task}", ws].status == "pass", results[f"solution {task}", ws].line()
    assert results[f"stub {task}", ws].status == "not implemented", results[f"stub {task}", ws].line()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("case", lab.CORRECT)
def test_correct_alternative_passes(results, case, ws):
    assert results[case, ws].status == "pass", results[case, ws].line()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("case", lab.WRONG)
def test_mistake_gets_its_hint(results, case, ws):
    assert_mistake(results, lab.WRONG, case, ws)


def test_every_task_has_four_wrong_solutions():
    for task in TASKS:
        assert sum(t == task for t, *_ in {**lab.WRONG, **lab.ON_THREE}.values()) >= 4, task


def test_solution_follows_the_whole_cycle_and_rests_on_shards(results):
    message = results["solution lab4.prepare_backward", 4].message
    assert "gather -> forward -> free -> gather -> backward -> reduce_scatter -> free" in message, message
    assert "match ShardLab stage 3" in message and "full weights freed" in message, message
