"""Lab 1 checks: shard and gather (pad, split, all-gather, reduce-scatter, all-reduce from the two).

The learner's four functions, each given what it needs as arguments::

    pad_and_split(flat, world_size)          -> list of world_size equal shards, zero padded
    gather_full(shard, numel, world_size)    -> the full tensor (numel elements) on every rank
    mean_grad_shard(grad, world_size)        -> this rank's shard of the mean gradient
    all_reduce_mean(grad, world_size)        -> the full mean gradient, from reduce-scatter + all-gather

Each check runs on every rank and calls only its own task's function; the collectives the
learner's code runs are watched (``watch.Collectives``) wherever the task names them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from shardlab.course.labs.scale import judge_scale
from shardlab.course.labs.tasks import Hint, task
from shardlab.course.labs.watch import Collectives, refuse_others, traffic
from shardlab.engine.flat import padded_numel


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: ``flat`` with zeros appended up to a multiple of ``n``. Written out here on
    purpose, with torch's own pad, so that the check does not share the code it verifies."""
    return torch.nn.functional.pad(flat, (0, (-flat.numel()) % n))


def _same(a, b) -> bool:
    return torch.is_tensor(a) and a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-5)


def _show(t: torch.Tensor, most: int = 8) -> str:
    """A tensor's values for a hint: rounded, and cut after ``most`` of them."""
    values = [round(v, 3) for v in t.detach().reshape(-1).float().tolist()]
    return str(values[:most])[:-1] + (", ...]" if len(values) > most else "]")


def _expect_tensor(value, what: str) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise Hint(f"{what} should be a tensor, but your function returned {type(value).__name__}"
                   + (": did you forget the return statement?" if value is None else ""), mistake="not_a_tensor")
    return value


def _permuted_blocks(got: torch.Tensor, want: torch.Tensor, n: int) -> bool:
    """``got`` holds ``want``'s n blocks, but in another order (or interleaved)."""
    if got.numel() != want.numel() or _same(got, want):
        return False
    return torch.equal(got.reshape(-1).sort().values, want.reshape(-1).sort().values)


def _front_padded(got: torch.Tensor, flat: torch.Tensor) -> bool:
    """The zeros went first: ``got`` is ``flat`` with its padding in front."""
    pad = got.numel() - flat.numel()
    return pad > 0 and torch.equal(got[pad:], flat) and not got[:pad].any()


ORDER = ("rank r's shard must be the contiguous slice [r*S, (r+1)*S) of the padded tensor, "
         "in rank order: shards[r] for rank r")
FRONT = "your zeros went in front of the numbers: pad at the end, so that element i stays at index i"
ONE_SHARD_EACH = "rank r keeps the r-th contiguous shard: look at how you index or order the pieces"


def _collectives(seen: Collectives, want: list[str], numel: int, n: int, task_words: str) -> None:
    """The task's text names its collectives: insist on them (an all-reduce sends twice the bytes)."""
    kinds = seen.kinds()
    if "all_reduce" in kinds:
        raise Hint(f"the values are right, but you all-reduced: {task_words}. By the ring formula "
                   f"an all-reduce sends {seen.ring_bytes():,} B per rank here, the lab's collectives "
                   f"{traffic(numel, 4, n, want):,} B",
                   "replace the all-reduce (and the slice after it) by the collective the task names",
                   mistake="all_reduce_instead")
    if sorted(kinds) != sorted(want) or any(c.numel != numel for c in seen.log):
        raise Hint(f"the values are right, but your collectives were: {seen.described()}; {task_words} "
                   f"({', '.join(f'{k} of {numel}' for k in want)} elements)", mistake="collectives")


@task("lab1.pad_and_split", fn_name="pad_and_split")
def check_pad_and_split(fn) -> str:
    """Local: any N, 3 included, on sizes that do and do not divide evenly."""
    # 9 on 3 comes before 7 on 5: padding to a multiple of 4 shows at 9 on 3 (12 = 3 x 4), where cutting
    # into pieces of ceil(numel/N) is still right; at 7 on 5 the two give the same 4 pieces of 2
    cases = [(10, 4), (10, 3), (12, 4), (12, 3), (9, 3), (7, 5), (10, 1), (1, 3)]
    for numel, n in cases:
        flat = torch.arange(1.0, numel + 1)  # no zeros inside, so padding stands out
        want = _padded(flat, n).reshape(n, -1)
        try:
            shards = fn(flat.clone(), n)
        except RuntimeError as exc:
            if numel % n and any(s in str(exc) for s in ("invalid for input of size", "divisible")):
                raise Hint(f"{numel} elements do not split into {n} equal shards: pad with zeros "
                           f"first, up to a multiple of {n}", "how many zeros make the length a multiple "
                           "of world_size? Append them before you split", mistake="not_padded") from None
            raise
        if torch.is_tensor(shards) and shards.dim() == 2:
            shards = list(shards)
        if not isinstance(shards, (list, tuple)) or not all(torch.is_tensor(s) for s in shards):
            why = ""
            if shards is None:
                why = ": did you forget the return statement?"
            elif torch.is_tensor(shards):  # padded, never split
                why = f" of {shards.numel()} elements: split it into {n} shards (.chunk({n})) and return them"
            raise Hint(f"pad_and_split should return a list of {n} tensors, got {type(shards).__name__}{why}",
                       mistake="not_a_list")
        sizes = [s.numel() for s in shards]
        piece = -(-numel // n)  # ceil(numel / n)
        if len(shards) < n and sizes and set(sizes) == {piece}:
            raise Hint(f"{numel} elements on {n} ranks gave {len(shards)} shards of {piece}, not {n}: pieces of "
                       f"ceil(numel / world_size) = {piece} elements can be fewer than world_size (here "
                       f"{len(shards)} pieces cover all {numel}), and padding only the last piece cannot add the "
                       "missing ones", "pad the whole tensor to a multiple of world_size first, then cut it into "
                       "world_size pieces (chunk takes the count)", mistake="too_few_pieces")
        if n != 4 and sizes == [c.numel() for c in _padded(flat, 4).chunk(n)] != [c.numel() for c in want]:
            raise Hint(f"{numel} elements on {n} ranks gave shards of sizes {sizes}: you padded to a multiple "
                       f"of 4, not of world_size = {n}", "the padding depends on the world_size argument, "
                       "never a fixed 4", mistake="hard_coded_world_size")
        if len(shards) != n and sum(sizes) == want.numel():  # padded right, cut into the wrong count
            by_size = max(sizes) == n
            raise Hint(f"{numel} elements on {n} ranks: you padded to {sum(sizes)}, a multiple of {n}, but got "
                       f"{len(shards)} shards of sizes {sizes}, not {n} shards of {want.shape[1]}"
                       + (": split(k) and view(-1, k) take a chunk size k, not a shard count" if by_size else ""),
                       "chunk(world_size) takes the count of shards; split takes the size of each, "
                       "padded length // world_size", mistake="size_not_count" if by_size else "shard_count")
        if len(shards) != n or len(set(sizes)) > 1:
            if numel % n and sum(sizes) > numel and sum(sizes) % n:  # padded, but not to a multiple
                raise Hint(f"you padded {numel} elements to {sum(sizes)}, which is not a multiple of {n}, so "
                           f"the shards came out {sizes}: the count of zeros is the one that reaches the next "
                           f"multiple of {n}", "(-numel) % world_size zeros (numel % world_size is what is over, "
                           "not what is missing)", mistake="wrong_pad_count")
            if numel % n and sum(sizes) > want.numel():  # a multiple of n, past the next one
                raise Hint(f"you padded {numel} elements to {sum(sizes)}: a multiple of {n}, but not the next one "
                           f"({want.numel()}), and the shards came out {sizes}, not {n} shards of {want.shape[1]}",
                           "(-numel) % world_size zeros reach the next multiple; then chunk(world_size) cuts "
                           "that many equal shards", mistake="too_much_padding")
            if numel % n:
                raise Hint(f"{numel} elements on {n} ranks gave shards of sizes {sizes}, not {n} "
                           f"equal shards: pad with zeros up to a multiple of {n} first",
                           "(-numel) % world_size zeros, appended at the end, before you split",
                           mistake="not_padded")
            raise Hint(f"expected {n} shards of {numel // n} elements, got sizes {sizes}", mistake="shard_sizes")
        got = torch.stack([s.reshape(-1) for s in shards])
        if got.shape != want.shape:
            raise Hint(f"{numel} elements on {n} ranks: expected {n} shards of {want.shape[1]} elements, "
                       f"got {got.shape[1]} each: pad to the next multiple of {n}, and not when it "
                       "already divides", "(-numel) % world_size is 0 when it divides", mistake="too_much_padding")
        if _front_padded(got.reshape(-1), flat):
            raise Hint(FRONT, "torch.nn.functional.pad(flat, (left, right)): which side did you pad?",
                       mistake="padded_at_front")
        if torch.equal(got.reshape(-1)[:numel], flat) and not torch.equal(got, want):
            raise Hint("the padding must be zeros (torch.empty leaves whatever was in memory)",
                       "allocate the padding with torch.zeros, or use torch.nn.functional.pad",
                       mistake="padding_not_zeros")
        if _permuted_blocks(got, want, n):
            raise Hint(f"your shards hold the right numbers in the wrong order: {ORDER}", ONE_SHARD_EACH,
                       mistake="wrong_order")
        if not torch.equal(got, want):
            raise Hint(f"for {numel} elements on {n} ranks, shard 0 is {_show(got[0])}, "
                       f"expected {_show(want[0])}", mistake="wrong_values")
    return "equal, zero-padded shards in rank order: 10, 12, 9, 7 and 1 elements split over N = 1, 3, 4 and 5"


@task("lab1.gather_full", fn_name="gather_full")
def check_gather_full(fn) -> str:
    """Two lengths: one padded (never a multiple of n) and one that divides, with no padding to drop."""
    rank, n = dist.get_rank(), dist.get_world_size()
    runs = []
    for numel in (4 * n - 2 if n > 1 else 3, 4 * n):
        full = torch.arange(1.0, numel + 1)
        padded = _padded(full, n)
        shard = padded.reshape(n, -1)[rank].clone()
        with Collectives() as seen:  # every collective first (both lengths), then judge
            got = fn(shard.clone(), numel, n)
        runs.append(GatherRun(numel, full, padded, shard, got, seen))
    for run in runs:
        refuse_others(run.seen, "The task rebuilds the tensor with one all-gather: every rank gives its shard, "
                                "every rank gets all of them")
    for run in runs:
        _judge_gather(*run, n)
    padded_run, divides = runs
    return (f"the full tensor rebuilt from {n} shards with one all-gather, on every rank: {padded_run.numel} "
            f"elements (padded to {padded_run.padded.numel()}) and {divides.numel} (no padding)")


class GatherRun(NamedTuple):
    """One length gather_full was checked on: the tensor, its padded form, this rank's shard, what
    the learner returned, and the collectives it ran."""
    numel: int
    full: torch.Tensor
    padded: torch.Tensor
    shard: torch.Tensor
    got: object
    seen: Collectives


def _judge_gather(numel, full, padded, shard, got, seen, n) -> None:
    got = _expect_tensor(got, "gather_full's result").reshape(-1)
    if got.numel() == padded.numel() and _same(got, padded) and padded.numel() != numel:
        raise Hint(f"your tensor has {got.numel()} elements, not {numel}: drop the padding at the end",
                   "the gathered buffer ends with the padding: return only its first numel elements",
                   mistake="kept_padding")
    if got.numel() == shard.numel() and not seen.log:
        raise Hint("you returned one shard, and no collective ran: all-gather every rank's shard into a "
                   "buffer of world_size x shard elements", "comm.all_gather(full, shard) fills a buffer "
                   "you allocate", mistake="no_all_gather")
    if not seen.log and n > 1 and not _same(got, full):
        raise Hint(f"no collective ran, so this rank had only its own shard to build from: the other "
                   f"{n - 1} ranks' shards reach it only through an all-gather. Your tensor: {_show(got)}",
                   "comm.all_gather(full, shard) fills a buffer of world_size x shard elements with every "
                   "rank's shard, in rank order", mistake="no_all_gather")
    if not _same(got, full):
        if got.numel() == numel and _same(got, padded[-numel:]):
            raise Hint(f"you dropped the padding from the front: the padding is the last "
                       f"{padded.numel() - numel} elements of the buffer, so your tensor lost its first ones",
                       "the gathered buffer ends with the padding: return only its first numel elements",
                       mistake="dropped_front")
        if 0 < got.numel() < numel and _same(got, full[:got.numel()]):
            pad = padded.numel() - numel
            there = (f"{numel} divides by {n}, so there is no padding to drop" if not pad else
                     f"the padding is only the last {pad}")
            raise Hint(f"for {numel} elements on {n} ranks your tensor has {got.numel()}: you dropped "
                       f"{numel - got.numel()} real elements, and {there}",
                       "keep the first numel elements of the buffer: numel is given, the padding need not be "
                       "computed", mistake="dropped_real_elements")
        if got.numel() in (numel, padded.numel()) and set(got.tolist()) <= set(padded.tolist()):  # distinct values
            raise Hint("the pieces are in the wrong order: all-gather already puts rank r's shard at "
                       "[r*S, (r+1)*S) of the buffer; keep that order, only drop the padding",
                       "no reshaping or transposing after the all-gather", mistake="wrong_order")
        raise Hint(f"expected {_show(full)}, got {_show(got)}", mistake="wrong_values")
    _collectives(seen, ["all_gather"], padded.numel(), n, "the task rebuilds the tensor with one all-gather")


def _grads(rank: int, n: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's gradient, the mean over ranks): different on every rank, like real ones."""
    every = [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) for r in range(n)]
    return every[rank], torch.stack(every).mean(0)


@task("lab1.mean_grad_shard", fn_name="mean_grad_shard")
def check_mean_grad_shard(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    shard_len = 3
    grad, mean = _grads(rank, n, shard_len * n)
    with Collectives(reduce_full=grad.numel()) as seen:  # a reduce-scatter of one slice of it is named so
        got = fn(grad.clone(), n)
    refuse_others(seen, "The task reduce-scatters: every rank passes its whole gradient and gets back its "
                        "shard of the sum")
    got = _expect_tensor(got, "mean_grad_shard's result").reshape(-1)
    want = mean[rank * shard_len:(rank + 1) * shard_len]
    if got.numel() == grad.numel():
        raise Hint("you returned a full-size gradient: reduce-scatter leaves each rank only its "
                   "shard (1/N of the elements)", "the buffer reduce-scatter writes into is "
                   "grad.numel() // world_size long", mistake="full_size")
    if got.shape == want.shape and not _same(got, want):
        judge_scale(got, want, n, "your gradient shard")
        own = grad[rank * shard_len:(rank + 1) * shard_len]
        if _same(got, own) or _same(got, own / n):
            raise Hint("your shard holds only this rank's own gradient: reduce-scatter sums the "
                       "shard over all ranks", "call the collective before you slice or divide",
                       mistake="no_reduce")
        for r in range(n):
            if r != rank and (_same(got, mean[r * shard_len:(r + 1) * shard_len])):
                raise Hint("this rank got another rank's shard of the mean: reduce-scatter hands rank r "
                           "the r-th shard of the sum; return that one", ONE_SHARD_EACH, mistake="wrong_shard")
    if not _same(got, want):
        if "all_reduce" in seen.kinds():
            raise Hint(f"you all-reduced, and this rank's values are wrong: an all-reduce adds up, element by "
                       f"element, whatever each rank passes, so when you pass a different slice on each rank "
                       f"(its own chunk) the slices of different ranks are summed together. Expected "
                       f"{_show(want)}, got {_show(got)}",
                       "the task reduce-scatters: every rank passes its whole gradient and gets back its shard "
                       "of the sum", mistake="all_reduced_a_slice")
        raise Hint(f"expected this rank's mean gradient shard {_show(want)}, got {_show(got)}", mistake="wrong_values")
    _collectives(seen, ["reduce_scatter"], grad.numel(), n, "the task reduce-scatters")
    return f"each of {n} ranks holds its {shard_len}-element shard of the mean gradient, from one reduce-scatter"


@task("lab1.all_reduce_mean", fn_name="all_reduce_mean")
def check_all_reduce_mean(fn) -> str:
    """Three lengths: padded by 1, padded by more than 1 (N - 1), and one that divides (no padding)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    runs = []
    for numel in (4 * n - 1, 4 * n + 1, 4 * n):
        padded = padded_numel(numel, n)
        grad, mean = _grads(rank, n, numel)
        with Collectives(reduce_full=padded) as seen:  # every collective first (all lengths), then judge
            got = fn(grad.clone(), n)
        runs.append((numel, padded, mean, got, seen))
    for *_, seen in runs:
        refuse_others(seen, "Build the all-reduce from one reduce-scatter and one all-gather")
    for numel, padded, mean, got, seen in runs:
        _judge_all_reduce(numel, padded, mean, got, seen, n)
    (numel, padded, *_, seen), (more, more_padded, *_), (divides, *_) = runs
    return (f"the mean of {n} ranks' gradients ({numel} elements, padded to {padded}) from one reduce-scatter and "
            f"one all-gather, {seen.ring_bytes():,} B per rank by the ring formula, on every rank; also for {more} "
            f"elements (padded to {more_padded}) and {divides} (no padding to drop)")


def _judge_all_reduce(numel, padded, mean, got, seen, n) -> None:
    got = _expect_tensor(got, "all_reduce_mean's result").reshape(-1)
    if "all_reduce" in seen.kinds():
        raise Hint("you called all-reduce: build it from one reduce-scatter, then one all-gather "
                   "(that is the point of the task)", "pad, reduce-scatter and divide, all-gather, drop the padding",
                   mistake="all_reduce_instead")
    if got.shape == mean.shape:
        judge_scale(got, mean, n, "your mean gradient")
    pad = padded - numel
    if numel < got.numel() <= padded and _same(got[:numel], mean):
        raise Hint(f"for {numel} elements on {n} ranks your gradient has {got.numel()}, not {numel}: drop the "
                   f"padding, all of it ({pad} element{'s' if pad > 1 else ''} here: {numel} padded to {padded})",
                   "return only the first grad.numel() elements: the length is given, the padding need not be "
                   "computed", mistake="kept_padding")
    if pad and got.shape == mean.shape and not got[:pad].any() and _same(got[pad:], mean[:numel - pad]):
        raise Hint(FRONT, "torch.nn.functional.pad(flat, (left, right)): which side did you pad?",
                   mistake="padded_at_front")
    if got.numel() < numel and _same(got, mean[:got.numel()]):
        there = (f"{numel} divides by {n}, so there is no padding to drop"
                 + (" (and x[:-0] is empty: -0 is 0)" if got.numel() == 0 else "") if not pad else
                 f"the padding is only the last {pad}")
        raise Hint(f"for {numel} elements on {n} ranks your gradient has {got.numel()}: you dropped "
                   f"{numel - got.numel()} real elements, and {there}",
                   "return the first grad.numel() elements of the gathered buffer: the length is given, the "
                   "padding need not be computed", mistake="dropped_real_elements")
    if not _same(got, mean):
        raise Hint(f"for {numel} elements, expected the mean gradient {_show(mean)}, got {_show(got)}",
                   mistake="wrong_values")
    _collectives(seen, ["reduce_scatter", "all_gather"], padded, n,
                 "the task builds it from one reduce-scatter and one all-gather")
