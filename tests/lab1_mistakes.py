"""Realistic wrong answers to lab 1 (importable: the checks run them on spawned ranks)."""

import torch
import torch.distributed as dist

from shardlab import comm


def _pad(flat, world_size):
    return torch.nn.functional.pad(flat, (0, (-flat.numel()) % world_size))


# -- pad_and_split ------------------------------------------------------------------------------
def split_without_padding_chunk(flat, world_size):
    return list(flat.chunk(world_size))


def split_without_padding_tensor_split(flat, world_size):
    return list(flat.tensor_split(world_size))


def split_interleaved(flat, world_size):  # rank r takes every N-th element
    return list(_pad(flat, world_size).view(-1, world_size).t())


def split_reversed(flat, world_size):
    return list(_pad(flat, world_size).chunk(world_size))[::-1]


# -- gather_full --------------------------------------------------------------------------------
def gather_keeps_padding(shard, numel, world_size):
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(full, shard)
    return full


def gather_interleaved(shard, numel, world_size):
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(full, shard)
    return full.view(world_size, -1).t().reshape(-1)[:numel]


def gather_forgot_the_collective(shard, numel, world_size):
    return shard


# -- mean_grad_shard ----------------------------------------------------------------------------
def mean_not_divided(grad, world_size):
    shard = torch.empty(grad.numel() // world_size)
    comm.reduce_scatter(shard, grad)
    return shard


def mean_divided_twice(grad, world_size):
    shard = torch.empty(grad.numel() // world_size)
    comm.reduce_scatter(shard, grad / world_size)
    return shard / world_size


def mean_of_the_next_ranks_shard(grad, world_size):
    total = grad.clone()
    comm.all_reduce(total)
    return total.chunk(world_size)[(dist.get_rank() + 1) % world_size] / world_size


# -- all_reduce_mean ----------------------------------------------------------------------------
def all_reduce_with_all_reduce(grad, world_size):
    total = grad.clone()
    comm.all_reduce(total)
    return total / world_size


def _rs_ag(grad, world_size, before, after):
    padded = _pad(grad, world_size) / before
    shard = torch.empty(padded.numel() // world_size)
    comm.reduce_scatter(shard, padded)
    full = torch.empty_like(padded)
    comm.all_gather(full, shard / after)
    return full


def all_reduce_not_divided(grad, world_size):
    return _rs_ag(grad, world_size, 1, 1)[:grad.numel()]


def all_reduce_divided_twice(grad, world_size):
    return _rs_ag(grad, world_size, world_size, world_size)[:grad.numel()]


def all_reduce_keeps_padding(grad, world_size):
    return _rs_ag(grad, world_size, 1, world_size)
