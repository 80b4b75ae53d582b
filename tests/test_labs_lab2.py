"""Lab 2's checks reject the classic ZeRO-1 mistakes with the matching hint, and accept the solution.

All cases run in one set of 4 fresh ranks (run_on_fresh_ranks keeps going after a wrong answer).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import lab2_mistakes as wrong
import pytest

from shardlab.course.labs.__main__ import notebook_to_script
from shardlab.course.labs.checking import lab_tasks, run_on_fresh_ranks

ROOT = Path(__file__).resolve().parents[1]
SLOWDOWN = float(os.environ.get("SHARDLAB_TEST_SLOWDOWN", "1"))

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
    """Every mistake, then every task of the solution notebook, judged on one set of ranks."""
    solution = notebook_to_script(ROOT / "labs/solutions/lab2_zero1.ipynb", tmp_path_factory.mktemp("lab2"))
    jobs = [(f"lab2.{t}", fn) for t, fn, _ in MISTAKES]
    jobs += [(t.id, str(solution)) for t in lab_tasks("lab2")]
    results = run_on_fresh_ranks(jobs, scale=SLOWDOWN)
    assert len(results) == len(jobs)
    return results


@pytest.mark.parametrize("i", range(len(MISTAKES)), ids=[m[1].__name__ for m in MISTAKES])
def test_a_classic_mistake_gets_its_hint(verdicts, i):
    task, _, words = MISTAKES[i]
    result = verdicts[i]
    assert result.task == f"lab2.{task}"
    assert result.status == "fail", result.line()
    assert words in result.message, result.line()


def test_the_full_buffer_optimizer_is_caught_by_measured_bytes(verdicts):
    got, full = map(int, re.search(r"(\d+) B of Adam moments.*\((\d+) B\)", verdicts[0].message).groups())
    assert got == full > 0  # measured on the rank: the whole buffer's moments, no saving


def test_the_solution_passes_with_one_nth_of_the_optimizer_state(verdicts):
    solved = verdicts[len(MISTAKES):]
    assert [r.task for r in solved] == [t.id for t in lab_tasks("lab2")]
    assert all(r.passed for r in solved), "\n".join(r.line() for r in solved)
    per_rank, stage0 = map(int, re.search(r"(\d+) B per rank = 1/4 of stage 0's (\d+) B", solved[0].message).groups())
    assert per_rank * 4 == stage0
