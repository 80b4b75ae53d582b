"""Realistic wrong answers to lab 2, one small slip each (importable: the checks run them on
spawned ranks), and correct alternatives that must pass."""

import torch
import torch.distributed as dist
from torch.distributed import all_reduce

from shardlab import comm


# -- shard_optimizer ----------------------------------------------------------------------------
def optimizer_over_the_full_buffer(flat, rank, world_size, make_optimizer):
    master = torch.nn.Parameter(flat.clone())
    return master, make_optimizer([master])


def shard_master_but_full_optimizer(flat, rank, world_size, make_optimizer):
    s = flat.numel() // world_size
    master = torch.nn.Parameter(flat[rank * s:(rank + 1) * s].clone())
    return master, make_optimizer([torch.nn.Parameter(flat.clone())])


def shard_at_element_offset(flat, rank, world_size, make_optimizer):  # rank, not rank * S
    s = flat.numel() // world_size
    master = torch.nn.Parameter(flat[rank:rank + s].clone())
    return master, make_optimizer([master])


def shards_in_reverse(flat, rank, world_size, make_optimizer):
    master = torch.nn.Parameter(flat.chunk(world_size)[world_size - 1 - rank].clone())
    return master, make_optimizer([master])


def master_sliced_from_a_full_copy(flat, rank, world_size, make_optimizer):  # clone, then slice
    s = flat.numel() // world_size
    master = torch.nn.Parameter(flat.clone()[rank * s:(rank + 1) * s])
    return master, make_optimizer([master])


def master_is_a_view_of_flat(flat, rank, world_size, make_optimizer):  # correct: ShardLab's own fp32 ZeRO1.shard
    s = flat.numel() // world_size
    master = torch.nn.Parameter(flat[rank * s:(rank + 1) * s])
    return master, make_optimizer([master])


def shard_size_for_four(flat, rank, world_size, make_optimizer):
    s = flat.numel() // 4
    master = torch.nn.Parameter(flat[rank * s:(rank + 1) * s].clone())
    return master, make_optimizer([master])


def shard_optimizer_with_chunk(flat, rank, world_size, make_optimizer):  # correct: chunk, then clone
    master = torch.nn.Parameter(flat.chunk(world_size)[rank].clone())
    return master, make_optimizer([master])


# -- zero1_step ---------------------------------------------------------------------------------
def _mean_shard(grad, master, world_size):
    shard = torch.empty_like(master)
    comm.reduce_scatter(shard, grad)
    return shard / world_size


def step_forgets_the_all_gather(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.step()


def step_gathers_into_a_new_tensor(flat, grad, master, optimizer, world_size):  # rebinds the name
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.step()
    gathered = torch.empty_like(flat)
    comm.all_gather(gathered, master.detach())
    flat = gathered  # noqa: F841 (the mistake: the caller's flat never changes)


def step_copies_only_its_own_shard(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.step()
    rank = dist.get_rank()
    flat[rank * master.numel():(rank + 1) * master.numel()] = master.detach()


def step_not_divided(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad, master, world_size) * world_size
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_not_divided_then_zero_grad(flat, grad, master, optimizer, world_size):  # Adam would not notice
    master.grad = _mean_shard(grad, master, world_size) * world_size
    optimizer.step()
    optimizer.zero_grad()
    comm.all_gather(flat, master.detach())


def step_divided_twice(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad / world_size, master, world_size)
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_with_its_own_gradient(flat, grad, master, optimizer, world_size):
    master.grad = grad.chunk(world_size)[dist.get_rank()].clone()
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_zero_grad_before_step(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.zero_grad()
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_gathers_before_the_step(flat, grad, master, optimizer, world_size):  # gather, then step
    master.grad = _mean_shard(grad, master, world_size)
    comm.all_gather(flat, master.detach())
    optimizer.step()


def step_adds_to_master_grad(flat, grad, master, optimizer, world_size):  # += as the engine accumulates, never cleared
    shard = _mean_shard(grad, master, world_size)
    if master.grad is None:
        master.grad = shard
    else:
        master.grad += shard
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_gathers_the_gradient(flat, grad, master, optimizer, world_size):  # master.grad, not master
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.step()
    comm.all_gather(flat, master.grad)


def step_all_reduce_and_slice(flat, grad, master, optimizer, world_size):  # right weights, 2x traffic
    total = grad.clone()
    all_reduce(total)
    master.grad = total.chunk(world_size)[dist.get_rank()] / world_size
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_divided_by_four(flat, grad, master, optimizer, world_size):
    shard = torch.empty_like(master)
    comm.reduce_scatter(shard, grad)
    master.grad = shard / 4
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_forgets_the_step(flat, grad, master, optimizer, world_size):  # no optimizer.step()
    master.grad = _mean_shard(grad, master, world_size)
    comm.all_gather(flat, master.detach())


def step_gathers_flats_own_shard(flat, grad, master, optimizer, world_size):  # "master is a view of flat": not here
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.step()
    rank, s = dist.get_rank(), master.numel()
    comm.all_gather(flat, flat[rank * s:(rank + 1) * s].clone())


def step_with_torch_directly(flat, grad, master, optimizer, world_size):  # correct: torch.distributed
    shard = torch.empty_like(master)
    dist.reduce_scatter_tensor(shard, grad)
    optimizer.zero_grad()
    master.grad = shard / world_size
    optimizer.step()
    dist.all_gather_into_tensor(flat, master.detach())


SHARD, STEP = "lab2.shard_optimizer", "lab2.zero1_step"
def step_reduces_to_rank0_then_broadcasts(flat, grad, master, optimizer, world_size):  # DDP-by-hand, not ZeRO-1
    dist.reduce(grad, dst=0)
    dist.broadcast(grad, src=0)
    rank = dist.get_rank()
    master.grad = grad[rank * master.numel():(rank + 1) * master.numel()] / world_size
    optimizer.step()
    comm.all_gather(flat, master.detach())


WRONG = {  # case: (task, wrong answer, the mistake the check must name, words its hint must contain)
    "optimizer over the full buffer": (SHARD, optimizer_over_the_full_buffer, "full_optimizer", "so ZeRO-1 saves nothing"),
    "shard master, full optimizer": (SHARD, shard_master_but_full_optimizer, "full_optimizer", "so ZeRO-1 saves nothing"),
    "shard at element offset rank": (SHARD, shard_at_element_offset, "wrong_shard", "steps the wrong shard"),
    "shards in reverse": (SHARD, shards_in_reverse, "wrong_shard", "steps the wrong shard"),
    "master sliced from a full copy": (SHARD, master_sliced_from_a_full_copy, "master_keeps_full_copy",
                                       "stays alive as long as the master does"),
    "step forgets the all-gather": (STEP, step_forgets_the_all_gather, "no_all_gather", "did not change"),
    "step gathers into a new tensor": (STEP, step_gathers_into_a_new_tensor, "gathered_not_in_place",
                                       "Gather in place"),
    "step gathers before the step": (STEP, step_gathers_before_the_step, "gathered_before_step",
                                     "you all-gathered before optimizer.step()"),
    "step never calls optimizer.step()": (STEP, step_forgets_the_step, "no_step", "never called optimizer.step()"),
    "step gathers flat's own shard": (STEP, step_gathers_flats_own_shard, "gathered_stale_shard",
                                      "flat's own shard still holds the old weights"),
    "step adds to master.grad": (STEP, step_adds_to_master_grad, "grad_not_cleared", "you added to master.grad"),
    "step copies only its own shard": (STEP, step_copies_only_its_own_shard, "drift", "drift apart"),
    "step not divided": (STEP, step_not_divided, "not_divided", "too large: the collective SUMs over"),
    "step not divided, then zero_grad": (STEP, step_not_divided_then_zero_grad, "not_divided", "too large"),
    "step divided twice": (STEP, step_divided_twice, "divided_twice", "too small: did you divide twice?"),
    "step with its own gradient": (STEP, step_with_its_own_gradient, "no_reduce", "not the mean over ranks"),
    "zero_grad before step": (STEP, step_zero_grad_before_step, "no_grad_at_step", "master.grad was None or zero"),
    "step gathers the gradient": (STEP, step_gathers_the_gradient, "gathered_grad", "flat holds gradients, not weights"),
    "step all-reduces and slices": (STEP, step_all_reduce_and_slice, "all_reduce_instead", "all-reduced"),
    "step reduces to rank 0, then broadcasts": (STEP, step_reduces_to_rank0_then_broadcasts, "other_collective",
                                                "dist.reduce sums onto one rank (dst) only"),
}
ON_THREE = {  # wrong only where the world size is not 4: they pass on 4 ranks, fail on 3
    "shard sized for 4 ranks": (SHARD, shard_size_for_four, "hard_coded_world_size", "not 4"),
    "step divided by 4": (STEP, step_divided_by_four, "hard_coded_world_size", "you divided by 4"),
}
CORRECT = {
    "shard by chunk": (SHARD, shard_optimizer_with_chunk),
    "master is a view of flat (the engine's fp32 ZeRO-1)": (SHARD, master_is_a_view_of_flat),
    "step through torch.distributed directly": (STEP, step_with_torch_directly),
}
