"""Lab 2's checks reject the classic ZeRO-1 mistakes with the matching hint, and accept the solution.

All cases run in one set of 4 fresh ranks (``labs_support.verdicts``; it keeps going after a
wrong answer).
"""

from __future__ import annotations

import re

import lab2_mistakes as wrong
import pytest
from labs_support import script_folder
from labs_support import verdicts as lab_verdicts

from shardlab.course.labs.checking import lab_tasks

MISTAKES = [  # (task, wrong answer, the words its hint must contain)
    ("shard_optimizer", wrong.optimizer_over_the_full_buffer, "so ZeRO-1 saves nothing"),
    ("shard_optimizer", wrong.shard_master_but_full_optimizer, "so ZeRO-1 saves nothing"),
    ("shard_optimizer", wrong.shard_at_element_offset, "steps the wrong shard"),
    ("shard_optimizer", wrong.shards_in_reverse, "steps the wrong shard"),
    ("zero1_step", wrong.step_forgets_the_all_gather, "all-gather every rank's updated shard"),
    ("zero1_step", wrong.step_copies_only_its_own_shard, "your ranks' weights drift apart"),
    ("zero1_step", wrong.step_not_divided, "4x too large: did you divide the SUM by the world size?"),
    ("zero1_step", wrong.step_divided_twice, "4x too small: did you divide twice?"),
    ("zero1_step", wrong.step_with_its_own_gradient, "not the mean over ranks"),
]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Every mistake, and each task of the solution and student notebooks, judged on one set of ranks."""
    wrong = {fn.__name__: (f"lab2.{task}", fn) for task, fn, _ in MISTAKES}
    return lab_verdicts("lab2", "lab2_zero1.ipynb", wrong, script_folder(tmp_path_factory))


@pytest.mark.parametrize("i", range(len(MISTAKES)), ids=[m[1].__name__ for m in MISTAKES])
def test_a_classic_mistake_gets_its_hint(verdicts, i):
    task, fn, words = MISTAKES[i]
    result = verdicts[fn.__name__]
    assert result.task == f"lab2.{task}"
    assert result.status == "fail", result.line()
    assert words in result.message, result.line()


def test_the_full_buffer_optimizer_is_caught_by_measured_bytes(verdicts):
    got, full = map(int, re.search(r"(\d+) B of Adam moments.*\((\d+) B\)", verdicts[MISTAKES[0][1].__name__].message).groups())
    assert got == full > 0  # measured on the rank: the whole buffer's moments, no saving


def test_the_solution_passes_with_one_nth_of_the_optimizer_state(verdicts):
    solved = [verdicts[f"solution {t.id}"] for t in lab_tasks("lab2")]
    assert [r.task for r in solved] == [t.id for t in lab_tasks("lab2")]
    assert all(r.passed for r in solved), "\n".join(r.line() for r in solved)
    per_rank, stage0 = map(int, re.search(r"(\d+) B per rank = 1/4 of stage 0's (\d+) B", solved[0].message).groups())
    assert per_rank * 4 == stage0
