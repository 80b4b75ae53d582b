"""Lab 1's checks reject the classic mistakes with the matching hint, and accept the solution.

All cases run in one set of 4 fresh ranks (run_on_fresh_ranks keeps going after a wrong answer).
"""

from __future__ import annotations

import os
from pathlib import Path

import lab1_mistakes as wrong
import pytest

from shardlab.course.labs.__main__ import notebook_to_script
from shardlab.course.labs.checking import lab_tasks, run_on_fresh_ranks

ROOT = Path(__file__).resolve().parents[1]
SLOWDOWN = float(os.environ.get("SHARDLAB_TEST_SLOWDOWN", "1"))

MISTAKES = [  # (task, wrong answer, the words its hint must contain)
    ("pad_and_split", wrong.split_without_padding_chunk, "pad with zeros"),
    ("pad_and_split", wrong.split_without_padding_tensor_split, "pad with zeros"),
    ("pad_and_split", wrong.split_interleaved, "wrong order"),
    ("pad_and_split", wrong.split_reversed, "wrong order"),
    ("gather_full", wrong.gather_keeps_padding, "drop the padding"),
    ("gather_full", wrong.gather_interleaved, "wrong order"),
    ("gather_full", wrong.gather_forgot_the_collective, "you returned one shard"),
    ("mean_grad_shard", wrong.mean_not_divided, "4x too large: did you divide the SUM by the world size?"),
    ("mean_grad_shard", wrong.mean_divided_twice, "4x too small: did you divide twice?"),
    ("mean_grad_shard", wrong.mean_of_the_next_ranks_shard, "got rank 1's shard of the mean"),
    ("all_reduce_mean", wrong.all_reduce_with_all_reduce, "you called all_reduce"),
    ("all_reduce_mean", wrong.all_reduce_not_divided, "4x too large: did you divide the SUM by the world size?"),
    ("all_reduce_mean", wrong.all_reduce_divided_twice, "4x too small: did you divide twice?"),
    ("all_reduce_mean", wrong.all_reduce_keeps_padding, "drop the padding"),
]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Every mistake, then every task of the solution notebook, judged on one set of ranks."""
    solution = notebook_to_script(ROOT / "labs/solutions/lab1_shard_and_gather.ipynb",
                                  tmp_path_factory.mktemp("lab1"))
    jobs = [(f"lab1.{t}", fn) for t, fn, _ in MISTAKES]
    jobs += [(t.id, str(solution)) for t in lab_tasks("lab1")]
    results = run_on_fresh_ranks(jobs, scale=SLOWDOWN)
    assert len(results) == len(jobs)
    return results


@pytest.mark.parametrize("i", range(len(MISTAKES)), ids=[m[1].__name__ for m in MISTAKES])
def test_a_classic_mistake_gets_its_hint(verdicts, i):
    task, _, words = MISTAKES[i]
    result = verdicts[i]
    assert result.task == f"lab1.{task}"
    assert result.status == "fail", result.line()
    assert words in result.message, result.line()
    assert "Traceback" not in result.message


def test_the_solution_passes_every_task(verdicts):
    solved = verdicts[len(MISTAKES):]
    assert [r.task for r in solved] == [t.id for t in lab_tasks("lab1")]
    assert all(r.passed for r in solved), "\n".join(r.line() for r in solved)
