"""Realistic wrong answers to lab 2 (importable: the checks run them on spawned ranks)."""

import torch

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


# -- zero1_step ---------------------------------------------------------------------------------
def _mean_shard(grad, master, world_size):
    shard = torch.empty_like(master)
    comm.reduce_scatter(shard, grad)
    return shard / world_size


def step_forgets_the_all_gather(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.step()


def step_copies_only_its_own_shard(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad, master, world_size)
    optimizer.step()
    rank = torch.distributed.get_rank()
    flat[rank * master.numel():(rank + 1) * master.numel()] = master.detach()


def step_not_divided(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad, master, world_size) * world_size
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_divided_twice(flat, grad, master, optimizer, world_size):
    master.grad = _mean_shard(grad / world_size, master, world_size)
    optimizer.step()
    comm.all_gather(flat, master.detach())


def step_with_its_own_gradient(flat, grad, master, optimizer, world_size):
    rank = torch.distributed.get_rank()
    master.grad = grad.chunk(world_size)[rank].clone()
    optimizer.step()
    comm.all_gather(flat, master.detach())
