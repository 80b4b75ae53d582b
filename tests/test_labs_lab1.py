"""Lab 1's checks reject the classic mistakes with the matching hint, and accept the solution.

All cases run in one set of 4 fresh ranks (``labs_support.verdicts``; it keeps going after a
wrong answer).
"""

from __future__ import annotations

import lab1_mistakes as wrong
import pytest
from labs_support import script_folder
from labs_support import verdicts as lab_verdicts

from shardlab.course.labs.checking import lab_tasks

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
    """Every mistake, and each task of the solution and student notebooks, judged on one set of ranks."""
    wrong = {fn.__name__: (f"lab1.{task}", fn) for task, fn, _ in MISTAKES}
    return lab_verdicts("lab1", "lab1_shard_and_gather.ipynb", wrong, script_folder(tmp_path_factory))


@pytest.mark.parametrize("i", range(len(MISTAKES)), ids=[m[1].__name__ for m in MISTAKES])
def test_a_classic_mistake_gets_its_hint(verdicts, i):
    task, fn, words = MISTAKES[i]
    result = verdicts[fn.__name__]
    assert result.task == f"lab1.{task}"
    assert result.status == "fail", result.line()
    assert words in result.message, result.line()
    assert "Traceback" not in result.message


def test_the_solution_passes_every_task(verdicts):
    solved = [verdicts[f"solution {t.id}"] for t in lab_tasks("lab1")]
    assert [r.task for r in solved] == [t.id for t in lab_tasks("lab1")]
    assert all(r.passed for r in solved), "\n".join(r.line() for r in solved)
