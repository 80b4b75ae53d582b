"""Lab 1 checks: shard and gather (pad, split, all-gather, reduce-scatter, all-reduce from the two).

The learner's four functions, each given what it needs as arguments::

    pad_and_split(flat, world_size)          -> list of world_size equal shards, zero padded
    gather_full(shard, numel, world_size)    -> the full tensor (numel elements) on every rank
    mean_grad_shard(grad, world_size)        -> this rank's shard of the mean gradient
    all_reduce_mean(grad, world_size)        -> the full mean gradient, from reduce-scatter + all-gather

Each check runs on every rank; collectives first, then the verdict (see checking.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlab.course.labs.checking import Hint, task
from shardlab.engine import events


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: ``flat`` with zeros appended up to a multiple of ``n``."""
    return torch.nn.functional.pad(flat, (0, (-flat.numel()) % n))


def _same(a, b) -> bool:
    return torch.is_tensor(a) and a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-5)


def _show(t: torch.Tensor, most: int = 8) -> str:
    """A tensor's values for a hint: rounded, and cut after ``most`` of them."""
    values = [round(v, 3) for v in t.detach().reshape(-1).float().tolist()]
    return str(values[:most])[:-1] + (", ...]" if len(values) > most else "]")


def _expect_tensor(value, what: str) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise Hint(f"{what} should be a tensor, but your function returned {type(value).__name__}: "
                   "did you forget the return statement?")
    return value


def _permuted_blocks(got: torch.Tensor, want: torch.Tensor, n: int) -> bool:
    """``got`` holds ``want``'s n blocks, but in another order (or interleaved)."""
    if got.numel() != want.numel() or _same(got, want):
        return False
    blocks = {tuple(b.tolist()) for b in want.reshape(n, -1)}
    in_blocks = {tuple(b.tolist()) for b in got.reshape(n, -1)}
    same_values = torch.equal(got.reshape(-1).sort().values, want.reshape(-1).sort().values)
    return in_blocks == blocks or same_values


ORDER = ("rank r's shard must be the contiguous slice [r*S, (r+1)*S) of the padded tensor, "
         "in rank order: shards[r] for rank r")
TOO_LARGE = "{what} is {n}x too large: did you divide the SUM by the world size?"
TOO_SMALL = "{what} is {n}x too small: did you divide twice?"
SCALE_STRONGER = ("comm.reduce_scatter sums over ranks and does not divide: divide its result "
                  "once, by world_size (and nothing before it)")


def _judge_scale(got: torch.Tensor, want: torch.Tensor, n: int, what: str) -> None:
    if _same(got, want * n):
        raise Hint(TOO_LARGE.format(what=what, n=n), SCALE_STRONGER)
    if _same(got, want / n):
        raise Hint(TOO_SMALL.format(what=what, n=n), SCALE_STRONGER)


@task("lab1.pad_and_split", fn_name="pad_and_split")
def check_pad_and_split(fn) -> str:
    """Local: any N, 3 included, on sizes that do and do not divide evenly."""
    cases = [(10, 4), (10, 3), (12, 4), (7, 5), (10, 1), (1, 3)]
    for numel, n in cases:
        flat = torch.arange(1.0, numel + 1)  # no zeros inside, so padding stands out
        want = _padded(flat, n).reshape(n, -1)
        try:
            shards = fn(flat.clone(), n)
        except RuntimeError as exc:
            if numel % n and any(s in str(exc) for s in ("invalid for input of size", "divisible")):
                raise Hint(f"{numel} elements do not split into {n} equal shards: pad with zeros "
                           f"first, up to a multiple of {n}",
                           "pad = (-flat.numel()) % world_size; then torch.nn.functional.pad(flat, "
                           "(0, pad)).chunk(world_size)") from None
            raise
        if torch.is_tensor(shards) and shards.dim() == 2:
            shards = list(shards)
        if not isinstance(shards, (list, tuple)) or not all(torch.is_tensor(s) for s in shards):
            raise Hint(f"pad_and_split should return a list of {n} tensors, got "
                       f"{type(shards).__name__}: did you forget the return statement?")
        sizes = [s.numel() for s in shards]
        if len(shards) != n or len(set(sizes)) > 1:
            if numel % n:
                raise Hint(f"{numel} elements on {n} ranks gave shards of sizes {sizes}, not {n} "
                           f"equal shards: pad with zeros up to a multiple of {n} first",
                           "pad = (-flat.numel()) % world_size zeros at the end, then .chunk(world_size)")
            raise Hint(f"expected {n} shards of {numel // n} elements, got sizes {sizes}")
        got = torch.stack([s.reshape(-1) for s in shards])
        if got.shape != want.shape:
            raise Hint(f"expected {n} shards of {want.shape[1]} elements, got {got.shape[1]} each: "
                       f"pad to the next multiple of {n}, not more")
        if torch.equal(got.reshape(-1)[:numel], flat) and not torch.equal(got, want):
            raise Hint("the padding must be zeros (torch.empty leaves whatever was in memory)",
                       "torch.nn.functional.pad(flat, (0, pad)) appends zeros")
        if _permuted_blocks(got, want, n):
            raise Hint(f"your shards hold the right numbers in the wrong order: {ORDER}",
                       "pad, then .chunk(world_size): chunk r is rank r's shard")
        if not torch.equal(got, want):
            raise Hint(f"for {numel} elements on {n} ranks, shard 0 is {_show(got[0])}, "
                       f"expected {_show(want[0])}")
    return "equal, zero-padded shards in rank order: 10, 12, 7 and 1 elements split over N = 1, 3, 4 and 5"


@task("lab1.gather_full", fn_name="gather_full")
def check_gather_full(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = 4 * n - 2 if n > 1 else 3  # never a multiple of n: padding to drop
    full = torch.arange(1.0, numel + 1)
    shard = _padded(full, n).reshape(n, -1)[rank].clone()
    got = _expect_tensor(fn(shard.clone(), numel, n), "gather_full's result")
    padded = _padded(full, n)
    if _same(got, full):
        return f"the full {numel}-element tensor rebuilt from {n} shards, on every rank"
    if got.numel() == padded.numel() and _same(got.reshape(-1), padded):
        raise Hint(f"your tensor has {got.numel()} elements, not {numel}: drop the padding at the end",
                   "return full[:numel]")
    if got.numel() == shard.numel():
        raise Hint("you returned one shard: all-gather every rank's shard into a buffer of "
                   "world_size x shard elements", "full = torch.empty(world_size * shard.numel()); "
                   "comm.all_gather(full, shard)")
    if got.numel() in (numel, padded.numel()) and set(got.reshape(-1).tolist()) <= set(padded.tolist()):
        # the right values (they are distinct), in the wrong places
        raise Hint("the pieces are in the wrong order: all-gather already puts rank r's shard at "
                   "[r*S, (r+1)*S) of the buffer; keep that order, only drop the padding",
                   "return full[:numel], with full filled by comm.all_gather(full, shard)")
    raise Hint(f"expected {_show(full)}, got {_show(got)}")


def _grads(rank: int, n: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's gradient, the mean over ranks): different on every rank, like real ones."""
    every = [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) for r in range(n)]
    return every[rank], torch.stack(every).mean(0)


@task("lab1.mean_grad_shard", fn_name="mean_grad_shard")
def check_mean_grad_shard(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    grad, mean = _grads(rank, n, 3 * n)
    shard_len = 3
    got = _expect_tensor(fn(grad.clone(), n), "mean_grad_shard's result")
    want = mean[rank * shard_len:(rank + 1) * shard_len]
    if _same(got, want):
        return f"each of {n} ranks holds its {shard_len}-element shard of the mean gradient"
    if got.numel() == grad.numel():
        raise Hint("you returned a full-size gradient: reduce-scatter leaves each rank only its "
                   "shard (1/N of the elements)",
                   "shard = torch.empty(grad.numel() // world_size); comm.reduce_scatter(shard, grad)")
    if got.shape == want.shape:
        _judge_scale(got, want, n, "your gradient shard")
        own = grad[rank * shard_len:(rank + 1) * shard_len]
        if _same(got, own) or _same(got, own / n):
            raise Hint("your shard holds only this rank's own gradient: reduce-scatter sums the "
                       "shard over all ranks")
        for r in range(n):
            if r != rank and (_same(got, mean[r * shard_len:(r + 1) * shard_len])):
                raise Hint(f"this rank got rank {r}'s shard of the mean: reduce-scatter hands rank r "
                           "the r-th shard of the sum; return that one")
    raise Hint(f"expected this rank's mean gradient shard {_show(want)}, got {_show(got)}")


@task("lab1.all_reduce_mean", fn_name="all_reduce_mean")
def check_all_reduce_mean(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = 4 * n - 1  # not a multiple of n: pad, then drop the padding
    grad, mean = _grads(rank, n, numel)
    kinds: list[str] = []
    with events.listen(lambda name, f: kinds.append(f["kind"]) if name == "comm" else None):
        got = _expect_tensor(fn(grad.clone(), n), "all_reduce_mean's result")
    if "all_reduce" in kinds:
        raise Hint("you called all_reduce: build it from comm.reduce_scatter, then comm.all_gather")
    if got.shape == mean.shape:
        _judge_scale(got, mean, n, "your mean gradient")
    if got.numel() == math.ceil(numel / n) * n and _same(got[:numel], mean):
        raise Hint(f"your gradient has {got.numel()} elements, not {numel}: drop the padding",
                   "return full[:grad.numel()]")
    if not _same(got, mean):
        raise Hint(f"expected the mean gradient {_show(mean)}, got {_show(got)}")
    if sorted(kinds) != ["all_gather", "reduce_scatter"]:
        raise Hint(f"the mean is right, but your collectives were {kinds or 'none that comm saw'}: "
                   "use comm.reduce_scatter once, then comm.all_gather once")
    return (f"the mean of {n} ranks' gradients ({numel} elements, padded to {math.ceil(numel / n) * n}) "
            "from one reduce-scatter and one all-gather, on every rank")
