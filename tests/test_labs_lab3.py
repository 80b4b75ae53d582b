"""Lab 3 (ZeRO-2): the checks pass the solution, say "not implemented" to the stubs, and reject
the classic mistakes with the hint that names them."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from labs_support import script_folder, verdicts

from shardlab.engine import comm


def reduce_unit_with_torch_distributed(unit):
    """Right, calling torch.distributed directly (the labs allow it)."""
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    shard = torch.empty(unit.shard_numel)
    dist.reduce_scatter_tensor(shard, full)
    return shard / unit.world_size


# -- reduce_unit, wrong ------------------------------------------------------------------------


def reduce_unit_sum_not_divided(unit):
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    shard = torch.empty(unit.shard_numel)
    comm.reduce_scatter(shard, full)
    return shard


def reduce_unit_keeps_full_grads(unit):
    full = unit.pack_grads(torch.float32)  # p.grad is never dropped
    shard = torch.empty(unit.shard_numel)
    comm.reduce_scatter(shard, full)
    return shard / unit.world_size


def reduce_unit_slice_of_all_reduce(unit):
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    comm.all_reduce(full)
    full /= unit.world_size
    return unit.my_shard(full)  # right values, but a view: the whole buffer stays alive


def reduce_unit_rank0_shard(unit):
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    comm.all_reduce(full)
    return full[: unit.shard_numel] / unit.world_size  # every rank takes the first shard


# -- when_ready, wrong -------------------------------------------------------------------------


def when_ready_hooks_last_param(params, on_ready):
    # "the last parameter is done last": backward fills the last layer first
    params[-1].register_post_accumulate_grad_hook(lambda p: on_ready())


def when_ready_set_never_cleared(params, on_ready):
    seen = set()

    def hook(p):
        seen.add(p)
        if len(seen) == len(params):  # true again at every hook of the next backward
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def when_ready_not_rearmed(params, on_ready):
    left = [len(params)]

    def hook(p):
        left[0] -= 1
        if left[0] == 0:
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


WRONG = {
    "SUM not divided": ("lab3.reduce_unit", reduce_unit_sum_not_divided, "4x too large"),
    "full gradient kept alive": ("lab3.reduce_unit", reduce_unit_keeps_full_grads, "full gradient is still alive"),
    "shard is a view of the all-reduced buffer": ("lab3.reduce_unit", reduce_unit_slice_of_all_reduce,
                                                  "view into a 20352-element buffer"),
    "every rank keeps rank 0's shard": ("lab3.reduce_unit", reduce_unit_rank0_shard, "holds rank 0's shard"),
    "reduced before all gradients are in": ("lab3.when_ready", when_ready_hooks_last_param,
                                            "when only 1 of its 6 gradients were in"),
    "double reduction on a second backward": ("lab3.when_ready", when_ready_set_never_cleared,
                                              "in the second backward: each call reduces again (double reduction)"),
    "countdown not re-armed": ("lab3.when_ready", when_ready_not_rearmed,
                               "never ran for blocks.0 in the second backward"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    wrong = {case: (task, fn) for case, (task, fn, _) in WRONG.items()}
    wrong["torch.distributed directly"] = ("lab3.reduce_unit", reduce_unit_with_torch_distributed)
    return verdicts("lab3", "lab3_zero2.ipynb", wrong, script_folder(tmp_path_factory))


def test_torch_distributed_directly_passes(results):
    assert results["torch.distributed directly"].status == "pass", results["torch.distributed directly"].line()


@pytest.mark.parametrize("task", ["lab3.reduce_unit", "lab3.when_ready"])
def test_solution_passes_and_stub_is_not_implemented(results, task):
    assert results[f"solution {task}"].status == "pass", results[f"solution {task}"].line()
    assert results[f"stub {task}"].status == "not implemented", results[f"stub {task}"].line()


def test_solution_measures_a_lower_gradient_peak(results):
    message = results["solution lab3.when_ready"].message
    peak, every = re.search(r"peaked at ([\d,]+) bytes vs ([\d,]+)", message).groups()
    assert int(peak.replace(",", "")) < int(every.replace(",", "")), message


@pytest.mark.parametrize("case", WRONG)
def test_mistake_rejected_with_its_hint(results, case):
    result, hint = results[case], WRONG[case][2]
    assert result.status == "fail", result.line()
    assert hint in result.message, result.line()
