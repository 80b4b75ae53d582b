"""Lab 2 (ZeRO-1): on 4 and on 3 ranks, the checks pass the solution and the correct
alternatives, say "not implemented" to the stubs, and give each wrong solution the hint that
names its mistake."""

from __future__ import annotations

import re

import lab2_mistakes as lab
import pytest
from labs_support import assert_mistake, verdicts

from shardlab.course.labs.tasks import WORLD_SIZES, lab_tasks

TASKS = [t.id for t in lab_tasks("lab2")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return verdicts("lab2", "lab2_zero1.ipynb", {**lab.WRONG, **lab.ON_THREE}, lab.CORRECT,
                    tmp_path_factory.mktemp("lab2"))


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


@pytest.mark.parametrize("case", lab.ON_THREE)
def test_hard_coded_four_passes_on_4_ranks_and_gets_its_hint_on_3(results, case):
    assert results[case, 4].status == "pass", results[case, 4].line()
    assert_mistake(results, lab.ON_THREE, case, 3)


def test_every_task_has_four_wrong_solutions():
    for task in TASKS:
        assert sum(t == task for t, *_ in {**lab.WRONG, **lab.ON_THREE}.values()) >= 4, task


def test_the_solution_shards_the_optimizer_state_by_n(results):
    for ws in WORLD_SIZES:
        message = results["solution lab2.shard_optimizer", ws].message
        per_rank, stage0 = map(int, re.search(rf"(\d+) B per rank = 1/{ws} of stage 0's (\d+) B", message).groups())
        assert per_rank * ws == stage0 > 0, message
