"""Lab 4 (one FSDP unit): the checks pass the solution, say "not implemented" to the stubs, and
reject the classic mistakes with the hint that names them."""

from __future__ import annotations

import pytest
from labs_support import script_folder, verdicts

from shardlab.course.labs import lab4

# -- forward, wrong ----------------------------------------------------------------------------


def forward_never_frees(unit, x):
    unit.gather()
    return unit.module(x)


def forward_frees_before_running(unit, x):
    unit.gather()
    unit.free()
    return unit.module(x)


def forward_never_gathers(unit, x):
    out = unit.module(x)
    unit.free()
    return out


# -- prepare_backward, wrong -------------------------------------------------------------------


def prepare_backward_no_regather(unit, out):
    lab4.on_grads_ready(unit, lambda: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_frees_at_first_gradient(unit, out):
    out.register_hook(lambda grad: unit.gather())
    # the last parameter's gradient comes first: the rest of the unit's backward still needs the weights
    unit.params[-1].register_post_accumulate_grad_hook(lambda p: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_never_frees(unit, out):
    out.register_hook(lambda grad: unit.gather())
    lab4.on_grads_ready(unit, lambda: lab4.reduce_grads(unit))


def prepare_backward_no_reduce(unit, out):
    out.register_hook(lambda grad: unit.gather())
    lab4.on_grads_ready(unit, unit.free)


WRONG = {
    "never frees after forward": ("lab4.forward", forward_never_frees, "still holds its full weights"),
    "frees before the forward ran": ("lab4.forward", forward_frees_before_running,
                                     "blocks.0's forward ran on freed weights"),
    "never gathers": ("lab4.forward", forward_never_gathers, "blocks.0's forward ran on freed weights"),
    "not re-gathered for backward": ("lab4.prepare_backward", prepare_backward_no_regather,
                                     "blocks.3's backward ran on freed weights"),
    "freed before its backward finished": ("lab4.prepare_backward", prepare_backward_frees_at_first_gradient,
                                           "was freed while 5 of its 6 gradients were still to come"),
    "never freed after backward": ("lab4.prepare_backward", prepare_backward_never_frees,
                                   "after backward, blocks.0 still holds its full weights"),
    "gradients never reduced": ("lab4.prepare_backward", prepare_backward_no_reduce, "has no gradient shard"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    wrong = {case: (task, fn) for case, (task, fn, _) in WRONG.items()}
    return verdicts("lab4", "lab4_fsdp_unit.ipynb", wrong, script_folder(tmp_path_factory))


@pytest.mark.parametrize("task", ["lab4.forward", "lab4.prepare_backward"])
def test_solution_passes_and_stub_is_not_implemented(results, task):
    assert results[f"solution {task}"].status == "pass", results[f"solution {task}"].line()
    assert results[f"stub {task}"].status == "not implemented", results[f"stub {task}"].line()


def test_solution_follows_the_whole_cycle_and_rests_on_shards(results):
    message = results["solution lab4.prepare_backward"].message
    assert "gather -> forward -> free -> gather -> backward -> reduce_scatter -> free" in message, message
    assert "match ShardLab stage 3" in message and "full weights freed" in message, message


@pytest.mark.parametrize("case", WRONG)
def test_mistake_rejected_with_its_hint(results, case):
    result, hint = results[case], WRONG[case][2]
    assert result.status == "fail", result.line()
    assert hint in result.message, result.line()
