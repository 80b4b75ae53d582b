"""Realistic wrong answers to lab 3, one small slip each (importable: the checks run them on
spawned ranks), and correct alternatives that must pass."""

import torch
import torch.distributed as dist
from torch.distributed import all_reduce

from shardlab import comm


# -- reduce_unit --------------------------------------------------------------------------------
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


def reduce_unit_zeroes_full_grads(unit):  # "freed" with zero_(): the memory stays allocated
    full = unit.pack_grads(torch.float32)
    for p in unit.params:
        p.grad.zero_()
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


def reduce_unit_frees_before_packing(unit):
    unit.set_param_grads(None)
    full = unit.pack_grads(torch.float32)
    shard = torch.empty(unit.shard_numel)
    comm.reduce_scatter(shard, full)
    return shard / unit.world_size


def reduce_unit_all_reduce_then_copy(unit):  # right values in memory of their own, 2x traffic
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    all_reduce(full)
    return unit.my_shard(full).clone() / unit.world_size


def reduce_unit_own_gradient(unit):
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    return unit.my_shard(full).clone() / unit.world_size


def reduce_unit_divided_by_four(unit):
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    shard = torch.empty(unit.shard_numel)
    comm.reduce_scatter(shard, full)
    return shard / 4


def reduce_unit_with_torch_distributed(unit):  # correct: torch.distributed directly
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    shard = torch.empty(unit.shard_numel)
    dist.reduce_scatter_tensor(shard, full)
    return shard / unit.world_size


# -- when_ready ---------------------------------------------------------------------------------
def when_ready_hooks_last_param(params, on_ready):
    # "the last parameter is done last": backward fills the last layer first
    params[-1].register_post_accumulate_grad_hook(lambda p: on_ready())


def when_ready_hooks_first_param(params, on_ready):
    # "the first parameter is used first, so its gradient comes last": the right hook, the wrong idea
    params[0].register_post_accumulate_grad_hook(lambda p: on_ready())


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


def when_ready_counts_down_one_short(params, on_ready):
    left = [len(params) - 1]  # "the countdown ends at 0", so it starts one below the count

    def hook(p):
        left[0] -= 1
        if left[0] == 0:
            left[0] = len(params) - 1
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def when_ready_counts_up_never_reset(params, on_ready):
    done = [0]

    def hook(p):
        done[0] += 1
        if done[0] == len(params):  # 7, 8, ... in the next backward: never again
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def when_ready_tensor_hook(params, on_ready):
    left = [len(params)]

    def hook(grad):  # runs when the gradient is computed, before p.grad holds it
        left[0] -= 1
        if left[0] == 0:
            left[0] = len(params)
            on_ready()

    for p in params:
        p.register_hook(hook)


def when_ready_multi_grad_hook(params, on_ready):  # torch's "all of these have gradients": tensor hooks inside
    torch.autograd.graph.register_multi_grad_hook(params, lambda grads: on_ready())


def when_ready_every_hook(params, on_ready):
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: on_ready())


_left = [0]  # one count for every unit: set by each when_ready call, shared by all their hooks


def when_ready_one_count_for_every_unit(params, on_ready):
    _left[0] = len(params)

    def hook(p):
        _left[0] -= 1
        if _left[0] == 0:
            _left[0] = len(params)
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def when_ready_counts_six(params, on_ready):  # "a block has 6": a fixed count, not len(params)
    left = [6]

    def hook(p):
        left[0] -= 1
        if left[0] == 0:
            left[0] = 6
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def when_ready_hook_takes_no_argument(params, on_ready):  # autograd calls hook(p)
    left = [len(params)]

    def hook():
        left[0] -= 1
        if left[0] == 0:
            left[0] = len(params)
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def when_ready_counts_down_from_a_set(params, on_ready):  # correct: a set of those still to come
    waiting = set()

    def hook(p):
        if not waiting:
            waiting.update(id(q) for q in params)
        waiting.discard(id(p))
        if not waiting:
            on_ready()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


REDUCE, READY = "lab3.reduce_unit", "lab3.when_ready"
def reduce_unit_by_reduce_to_rank0(unit):  # dist.reduce: the sum lands on rank 0 only
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    dist.reduce(full, dst=0)
    rank = dist.get_rank()
    return full[rank * unit.shard_numel:(rank + 1) * unit.shard_numel].clone() / unit.world_size


WRONG = {  # case: (task, wrong answer, the mistake the check must name, words its hint must contain)
    "SUM not divided": (REDUCE, reduce_unit_sum_not_divided, "not_divided", "too large"),
    "full gradient kept alive": (REDUCE, reduce_unit_keeps_full_grads, "full_grads_alive", "double reduction"),
    "full gradient zeroed, not freed": (REDUCE, reduce_unit_zeroes_full_grads, "full_grads_alive", "you zeroed it"),
    "shard is a view of the all-reduced buffer": (REDUCE, reduce_unit_slice_of_all_reduce, "shard_is_a_view", "view into a"),
    "every rank keeps rank 0's shard": (REDUCE, reduce_unit_rank0_shard, "rank0_shard", "holds rank 0's shard"),
    "freed before packing": (REDUCE, reduce_unit_frees_before_packing, "freed_before_packing", "were gone when you packed"),
    "all-reduce, then a copy of its shard": (REDUCE, reduce_unit_all_reduce_then_copy, "all_reduce_instead", "you all-reduced"),
    "only its own gradient": (REDUCE, reduce_unit_own_gradient, "no_reduce", "only this rank's own gradient"),
    "dist.reduce to rank 0": (REDUCE, reduce_unit_by_reduce_to_rank0, "other_collective",
                              "dist.reduce sums onto one rank (dst) only"),
    "reduced before all gradients are in": (READY, when_ready_hooks_last_param, "fires_early", "when only 1 of its 6 gradients"),
    "hooks only the first parameter": (READY, when_ready_hooks_first_param, "hooked_one_param",
                                       "is not the last to arrive"),
    "double reduction on a second backward": (READY, when_ready_set_never_cleared, "fires_again",
                                              "in the second backward: each call reduces again (double reduction)"),
    "countdown one short": (READY, when_ready_counts_down_one_short, "count_off_by_one",
                            "though you hooked all 6 parameters: your count is off by one"),
    "countdown not re-armed": (READY, when_ready_not_rearmed, "not_rearmed", "never ran for blocks.0 in the second backward"),
    "counts up, never reset": (READY, when_ready_counts_up_never_reset, "not_rearmed", "did not start again"),
    "one count shared by every unit": (READY, when_ready_one_count_for_every_unit, "count_not_per_unit",
                                       "each unit needs its own count"),
    "a fixed count of 6": (READY, when_ready_counts_six, "count_not_per_unit", "each unit needs its own count"),
    "a hook that takes no argument": (READY, when_ready_hook_takes_no_argument, "hook_arguments",
                                      "raised while backward ran a hook you registered"),
    "tensor hook instead of post-accumulate": (READY, when_ready_tensor_hook, "tensor_hook", "register_post_accumulate_grad_hook"),
    "torch's multi-grad hook": (READY, when_ready_multi_grad_hook, "tensor_hook", "register_multi_grad_hook, which is built"),
    "on_ready at every hook": (READY, when_ready_every_hook, "fires_every_hook", "after every gradient"),
}
ON_THREE = {  # wrong only where the world size is not 4: they pass on 4 ranks, fail on 3
    "divided by 4": (REDUCE, reduce_unit_divided_by_four, "hard_coded_world_size", "you divided by 4"),
}
CORRECT = {
    "reduce-scatter through torch.distributed directly": (REDUCE, reduce_unit_with_torch_distributed),
    "a set of the gradients still to come": (READY, when_ready_counts_down_from_a_set),
}
