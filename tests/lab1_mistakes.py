"""Realistic wrong answers to lab 1, one small slip each (importable: the checks run them on
spawned ranks), and correct alternatives that must pass."""

import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # a name bound early: the checks must still see it

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


def split_zeros_in_front(flat, world_size):
    return list(torch.nn.functional.pad(flat, ((-flat.numel()) % world_size, 0)).chunk(world_size))


def split_padding_from_empty(flat, world_size):
    pad = torch.empty((-flat.numel()) % world_size).fill_(7.0)  # what torch.empty may hold
    return list(torch.cat([flat, pad]).chunk(world_size))


def split_always_pads_a_row(flat, world_size):  # world_size - numel % world_size: N zeros when it divides
    return list(torch.nn.functional.pad(flat, (0, world_size - flat.numel() % world_size)).chunk(world_size))


def split_by_size_not_count(flat, world_size):  # split(k) takes a chunk size, not a count
    return list(_pad(flat, world_size).split(world_size))


def split_padded_never_split(flat, world_size):  # returns the padded 1-D tensor itself
    return _pad(flat, world_size)


def split_padded_to_four(flat, world_size):
    return list(_pad(flat, 4).chunk(world_size))


def split_pads_the_last_piece(flat, world_size):  # pieces of ceil(numel/N), the last one topped up with zeros
    size = -(-flat.numel() // world_size)
    shards = list(flat.split(size))  # 7 on 5: 4 pieces of 2, not 5
    shards[-1] = torch.nn.functional.pad(shards[-1], (0, size - shards[-1].numel()))
    return shards


def split_pads_by_the_remainder(flat, world_size):  # numel % N zeros, not (-numel) % N: right for 10 on 4 only
    return list(torch.nn.functional.pad(flat, (0, flat.numel() % world_size)).chunk(world_size))


def split_pads_an_extra_row(flat, world_size):  # a row more "to be safe", cut by the unpadded shard size
    shard = -(-flat.numel() // world_size)
    return list(torch.nn.functional.pad(flat, (0, (-flat.numel()) % world_size + world_size)).split(shard))


# -- gather_full --------------------------------------------------------------------------------
def gather_keeps_padding(shard, numel, world_size):
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(full, shard)
    return full


def gather_interleaved(shard, numel, world_size):
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(full, shard)
    return full.view(world_size, -1).t().reshape(-1)[:numel]


def gather_arguments_swapped(shard, numel, world_size):  # (input, output): the order reduce_scatter's full takes
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(shard, full)
    return full[:numel]


def gather_forgot_the_collective(shard, numel, world_size):
    return shard


def gather_by_all_reduce(shard, numel, world_size):  # right values, twice the traffic
    full = torch.zeros(world_size * shard.numel())
    rank = dist.get_rank()
    full[rank * shard.numel():(rank + 1) * shard.numel()] = shard
    all_reduce(full)
    return full[:numel]


def gather_drops_the_front(shard, numel, world_size):  # the padding is at the tail, not the front
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(full, shard)
    return full[-numel:]


def gather_buffer_for_four(shard, numel, world_size):
    full = torch.empty(4 * shard.numel())
    comm.all_gather(full, shard)
    return full[:numel]


def gather_buffer_rounded_up(shard, numel, world_size):  # sized from numel, not from the shards
    full = torch.empty(numel + 1)
    comm.all_gather(full, shard)
    return full[:numel]


def gather_drops_a_fixed_pad(shard, numel, world_size):  # N - numel % N: drops N real elements when it divides
    full = torch.empty(world_size * shard.numel())
    comm.all_gather(full, shard)
    return full[:full.numel() - (world_size - numel % world_size)]


def gather_own_shard_in_zeros(shard, numel, world_size):  # its own piece in place, the collective forgotten
    full = torch.zeros(world_size * shard.numel())
    rank = dist.get_rank()
    full[rank * shard.numel():(rank + 1) * shard.numel()] = shard
    return full[:numel]


def gather_repeats_its_own_shard(shard, numel, world_size):  # N copies of this rank's shard, no collective
    return torch.cat([shard] * world_size)[:numel]


def gather_with_torch_list(shard, numel, world_size):  # correct: torch.distributed's list form
    parts = [torch.empty_like(shard) for _ in range(world_size)]
    dist.all_gather(parts, shard)
    return torch.cat(parts)[:numel]


# -- mean_grad_shard ----------------------------------------------------------------------------
def mean_not_divided(grad, world_size):
    shard = torch.empty(grad.numel() // world_size)
    comm.reduce_scatter(shard, grad)
    return shard


def mean_arguments_swapped(grad, world_size):  # full first, as in all_gather(full, shard)
    shard = torch.empty(grad.numel() // world_size)
    comm.reduce_scatter(grad, shard)
    return shard / world_size


def mean_divided_twice(grad, world_size):
    shard = torch.empty(grad.numel() // world_size)
    comm.reduce_scatter(shard, grad / world_size)
    return shard / world_size


def mean_of_the_next_ranks_shard(grad, world_size):
    shard = torch.empty(grad.numel() // world_size)
    comm.reduce_scatter(shard, grad.roll(-shard.numel()))  # rolled: rank r gets shard r + 1
    return shard / world_size


def mean_by_all_reduce_and_slice(grad, world_size):  # right values, twice the traffic
    total = grad.clone()
    all_reduce(total)
    return total.chunk(world_size)[dist.get_rank()] / world_size


def mean_own_gradient_only(grad, world_size):
    return grad.chunk(world_size)[dist.get_rank()] / world_size


def mean_by_reduce_to_rank0(grad, world_size):  # dist.reduce: the sum lands on rank 0 only
    dist.reduce(grad, dst=0)
    size = grad.numel() // world_size
    return grad[dist.get_rank() * size:(dist.get_rank() + 1) * size] / world_size


def mean_reduce_scatters_its_own_slice(grad, world_size):  # slices first, then reduce-scatters the slice
    size = grad.numel() // world_size
    mine = grad[dist.get_rank() * size:(dist.get_rank() + 1) * size]
    shard = torch.empty(max(size // world_size, 1))
    comm.reduce_scatter(shard, mine)
    return shard / world_size


def mean_with_reduce_op_avg(grad, world_size):  # correct: ReduceOp.AVG works on gloo in torch >= 2.9
    shard = torch.empty(grad.numel() // world_size)
    dist.reduce_scatter_tensor(shard, grad, op=dist.ReduceOp.AVG)
    return shard


def mean_divided_by_four(grad, world_size):
    shard = torch.empty(grad.numel() // world_size)
    comm.reduce_scatter(shard, grad)
    return shard / 4


def mean_shard_one_too_long(grad, world_size):  # rounded up "to be safe"
    shard = torch.empty(grad.numel() // world_size + 1)
    comm.reduce_scatter(shard, grad)
    return shard[:-1] / world_size


def mean_returns_the_full_buffer(grad, world_size):
    total = grad.clone()
    comm.all_reduce(total)
    return total / world_size


def mean_all_reduces_its_own_chunk(grad, world_size):  # each rank passes a different slice
    mine = grad.chunk(world_size)[dist.get_rank()].clone()
    all_reduce(mine)
    return mine / world_size


# -- all_reduce_mean ----------------------------------------------------------------------------
def all_reduce_with_comm_all_reduce(grad, world_size):
    total = grad.clone()
    comm.all_reduce(total)
    return total / world_size


def all_reduce_with_an_aliased_import(grad, world_size):
    total = grad.clone()
    all_reduce(total)
    return total / world_size


def _rs_ag(grad, world_size, before, after, front=False):
    pad = (-grad.numel()) % world_size
    padded = torch.nn.functional.pad(grad, (pad, 0) if front else (0, pad)) / before
    shard = torch.empty(padded.numel() // world_size)
    comm.reduce_scatter(shard, padded)
    full = torch.empty_like(padded)
    comm.all_gather(full, shard / after)
    return full


def all_reduce_reduces_its_own_shard(grad, world_size):  # pad_and_split's shard to mean_grad_shard
    shard = _pad(grad, world_size).chunk(world_size)[dist.get_rank()]
    mean = torch.empty(shard.numel() // world_size)   # mean_grad_shard, as written for task 3
    comm.reduce_scatter(mean, shard)
    full = torch.empty(world_size * mean.numel())      # gather_full, as written for task 2
    comm.all_gather(full, mean / world_size)
    return full[:grad.numel()]


def all_reduce_not_divided(grad, world_size):
    return _rs_ag(grad, world_size, 1, 1)[:grad.numel()]


def all_reduce_divided_twice(grad, world_size):
    return _rs_ag(grad, world_size, world_size, world_size)[:grad.numel()]


def all_reduce_keeps_padding(grad, world_size):
    return _rs_ag(grad, world_size, 1, world_size)


def all_reduce_zeros_in_front(grad, world_size):
    return _rs_ag(grad, world_size, 1, world_size, front=True)[:grad.numel()]


def all_reduce_divided_by_four(grad, world_size):
    return _rs_ag(grad, world_size, 1, 4)[:grad.numel()]


def all_reduce_drops_minus_pad(grad, world_size):  # full[:-pad]: empty when the length divides (pad == 0)
    pad = (-grad.numel()) % world_size
    return _rs_ag(grad, world_size, 1, world_size)[:-pad]


def all_reduce_drops_one_element(grad, world_size):  # "the padding is one element": right only when it is
    full = _rs_ag(grad, world_size, 1, world_size)
    return full[:full.numel() - 1]


def all_reduce_with_torch_directly(grad, world_size):  # correct: torch.distributed, no comm
    padded = _pad(grad, world_size)
    shard = torch.empty(padded.numel() // world_size)
    dist.reduce_scatter_tensor(shard, padded)
    full = torch.empty_like(padded)
    dist.all_gather_into_tensor(full, shard / world_size)
    return full[:grad.numel()]


PAD, GATHER, MEAN, ALL = "lab1.pad_and_split", "lab1.gather_full", "lab1.mean_grad_shard", "lab1.all_reduce_mean"
WRONG = {  # case: (task, wrong answer, the mistake the check must name, words its hint must contain)
    "chunk without padding": (PAD, split_without_padding_chunk, "not_padded", "pad with zeros"),
    "tensor_split without padding": (PAD, split_without_padding_tensor_split, "not_padded", "pad with zeros"),
    "interleaved shards": (PAD, split_interleaved, "wrong_order", "right numbers in the wrong order"),
    "shards in reverse": (PAD, split_reversed, "wrong_order", "right numbers in the wrong order"),
    "zeros in front": (PAD, split_zeros_in_front, "padded_at_front", "zeros went in front"),
    "padding from torch.empty": (PAD, split_padding_from_empty, "padding_not_zeros", "must be zeros"),
    "a row of padding when it divides": (PAD, split_always_pads_a_row, "too_much_padding", "not when it already divides"),
    "padded to a multiple of 4": (PAD, split_padded_to_four, "hard_coded_world_size", "multiple of 4, not of world_size"),
    "padded, never split": (PAD, split_padded_never_split, "not_a_list", "split it into"),
    "split by size, not count": (PAD, split_by_size_not_count, "size_not_count", "take a chunk size k, not a shard count"),
    "padded by the remainder": (PAD, split_pads_by_the_remainder, "wrong_pad_count", "you padded 10 elements to 11"),
    "pieces of ceil(numel/N), the last one padded": (PAD, split_pads_the_last_piece, "too_few_pieces",
                                                     "7 elements on 5 ranks gave 4 shards of 2, not 5"),
    "an extra row, cut by the unpadded size": (PAD, split_pads_an_extra_row, "too_much_padding",
                                               "you padded 10 elements to 16: a multiple of 4, but not the next one"),
    "gather keeps the padding": (GATHER, gather_keeps_padding, "kept_padding", "drop the padding"),
    "gather drops the front": (GATHER, gather_drops_the_front, "dropped_front", "the padding is the last"),
    "gather interleaves": (GATHER, gather_interleaved, "wrong_order", "pieces are in the wrong order"),
    "gather arguments swapped": (GATHER, gather_arguments_swapped, "swapped_arguments", "arguments look swapped"),
    "gather forgets the collective": (GATHER, gather_forgot_the_collective, "no_all_gather", "you returned one shard"),
    "gather buffer sized from numel": (GATHER, gather_buffer_rounded_up, "collective_sizes",
                                       "size full as world_size x shard.numel()"),
    "gather by all-reduce": (GATHER, gather_by_all_reduce, "all_reduce_instead", "you all-reduced"),
    "gather places its own shard, no collective": (GATHER, gather_own_shard_in_zeros, "no_all_gather",
                                                   "no collective ran"),
    "gather repeats its own shard": (GATHER, gather_repeats_its_own_shard, "no_all_gather", "no collective ran"),
    "gather drops N when it divides": (GATHER, gather_drops_a_fixed_pad, "dropped_real_elements",
                                       "there is no padding"),
    "mean not divided": (MEAN, mean_not_divided, "not_divided", "too large: the collective SUMs over"),
    "mean arguments swapped": (MEAN, mean_arguments_swapped, "swapped_arguments", "arguments look swapped"),
    "mean divided twice": (MEAN, mean_divided_twice, "divided_twice", "too small: did you divide twice?"),
    "mean of the next rank's shard": (MEAN, mean_of_the_next_ranks_shard, "wrong_shard", "another rank's shard"),
    "mean by all-reduce and slice": (MEAN, mean_by_all_reduce_and_slice, "all_reduce_instead", "you all-reduced"),
    "mean of its own gradient": (MEAN, mean_own_gradient_only, "no_reduce", "only this rank's own gradient"),
    "mean shard buffer one too long": (MEAN, mean_shard_one_too_long, "collective_sizes", "do not fit"),
    "mean returns the full buffer": (MEAN, mean_returns_the_full_buffer, "full_size", "full-size gradient"),
    "mean all-reduces its own chunk": (MEAN, mean_all_reduces_its_own_chunk, "all_reduced_a_slice",
                                       "a different slice on each rank"),
    "mean by dist.reduce to rank 0": (MEAN, mean_by_reduce_to_rank0, "other_collective",
                                      "dist.reduce sums onto one rank (dst) only"),
    "mean reduce-scatters its own slice": (MEAN, mean_reduce_scatters_its_own_slice, "reduced_a_shard",
                                           "one rank's shard of the padded"),
    "all-reduce via comm.all_reduce": (ALL, all_reduce_with_comm_all_reduce, "all_reduce_instead", "you called all-reduce"),
    "all-reduce via an aliased import": (ALL, all_reduce_with_an_aliased_import, "all_reduce_instead", "you called all-reduce"),
    "all-reduce reduces its own shard": (ALL, all_reduce_reduces_its_own_shard, "reduced_a_shard",
                                         "one rank's shard of the padded"),
    "all-reduce not divided": (ALL, all_reduce_not_divided, "not_divided", "too large: the collective SUMs over"),
    "all-reduce divided twice": (ALL, all_reduce_divided_twice, "divided_twice", "too small: did you divide twice?"),
    "all-reduce keeps the padding": (ALL, all_reduce_keeps_padding, "kept_padding", "drop the padding"),
    "all-reduce pads in front": (ALL, all_reduce_zeros_in_front, "padded_at_front", "zeros went in front"),
    "all-reduce drops full[:-pad]": (ALL, all_reduce_drops_minus_pad, "dropped_real_elements", "x[:-0] is empty"),
    "all-reduce drops one element of padding": (ALL, all_reduce_drops_one_element, "kept_padding",
                                                "drop the padding, all of it"),
}
ON_THREE = {  # wrong only where the world size is not 4: they pass on 4 ranks, fail on 3
    "gather buffer sized for 4": (GATHER, gather_buffer_for_four, "hard_coded_world_size", "not a fixed 4"),
    "mean divided by 4": (MEAN, mean_divided_by_four, "hard_coded_world_size", "you divided by 4, not by world_size"),
    "all-reduce divided by 4": (ALL, all_reduce_divided_by_four, "hard_coded_world_size", "you divided by 4"),
}
CORRECT = {
    "gather with torch.distributed's list all_gather": (GATHER, gather_with_torch_list),
    "all-reduce from torch.distributed directly": (ALL, all_reduce_with_torch_directly),
    "mean with ReduceOp.AVG": (MEAN, mean_with_reduce_op_avg),
}
