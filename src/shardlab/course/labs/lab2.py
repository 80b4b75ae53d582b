"""Lab 2 checks: the ZeRO-1 step on one flat buffer.

The learner's two functions::

    shard_optimizer(flat, rank, world_size, make_optimizer) -> (master, optimizer)
        master: an nn.Parameter holding this rank's shard of ``flat``; optimizer: make_optimizer([master])
    zero1_step(flat, grad, master, optimizer, world_size)
        reduce-scatter ``grad`` (this rank's full, padded gradient), divide, step the shard,
        all-gather the updated shards back into ``flat`` (in place)

The reference is stage 0 computed on each rank alone: AdamW over the whole flat buffer, with
the mean of every rank's gradient (the checks know every rank's gradient, so the reference
needs no collectives). Optimizer memory is measured: the bytes of the optimizer's state tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.course.labs.checking import Hint, task
from shardlab.engine import comm

NUMEL = 29           # real elements: not a multiple of 4 or 3, so the buffer is padded
STEPS = 3            # stage-0 parity over several steps
LR = 0.05


def _make_optimizer(params):
    # no weight decay: a step with a zero gradient (to measure the state) leaves the weights alone
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _flat(n: int) -> torch.Tensor:
    """The same padded flat buffer on every rank (as after a broadcast from rank 0)."""
    real = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    return torch.nn.functional.pad(real, (0, (-NUMEL) % n))


def _grad(flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of its own loss 0.5 |w - target_r|^2: zero on the padding."""
    target = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 + rank))
    g = torch.zeros_like(flat)
    g[:NUMEL] = flat[:NUMEL] - target
    return g


def _state_bytes(optimizer) -> int:
    """Bytes of the optimizer's per-element state (Adam's two moments), each storage once."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0 and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total


def _measure(master, optimizer) -> int:
    """Adam makes its state at the first step: take one with a zero gradient (no change)."""
    master.grad = torch.zeros_like(master)
    optimizer.step()
    master.grad = None
    return _state_bytes(optimizer)


def _full_state_bytes(flat: torch.Tensor) -> int:
    ref = torch.nn.Parameter(flat.clone())
    return _measure(ref, _make_optimizer([ref]))


FULL = ("your optimizer holds state for the whole buffer: {got} B of Adam moments on this rank, "
        "as much as stage 0 ({full} B), so ZeRO-1 saves nothing. Build it over this rank's shard "
        "only, 1/{n} of the buffer")
FULL_STRONGER = "S = flat.numel() // world_size; master = nn.Parameter(flat[rank*S:(rank+1)*S].clone())"


@task("lab2.shard_optimizer", fn_name="shard_optimizer")
def check_shard_optimizer(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = _flat(n)
    shard_numel = flat.numel() // n
    out = fn(flat.clone(), rank, n, _make_optimizer)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise Hint("shard_optimizer should return two things, (master, optimizer): "
                   f"got {type(out).__name__}. Did you forget the return statement?")
    master, optimizer = out
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise Hint(f"the second thing returned should be make_optimizer([master]), got {type(optimizer).__name__}")
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    full = _full_state_bytes(flat)
    if not (torch.is_tensor(master) and master.requires_grad and master.is_leaf):
        raise Hint("master should be an nn.Parameter (a leaf tensor that requires grad) holding "
                   "this rank's shard", FULL_STRONGER)
    if sum(p.numel() for p in stepped) >= flat.numel():
        got = _measure(stepped[0], optimizer) if len(stepped) == 1 else full
        raise Hint(FULL.format(got=got, full=full, n=n), FULL_STRONGER)
    if not any(p is master for p in stepped):
        raise Hint("the optimizer does not step your master: build it with make_optimizer([master])")
    if master.numel() != shard_numel:
        raise Hint(f"your master has {master.numel()} elements; this rank's shard of the padded "
                   f"{flat.numel()}-element buffer has {shard_numel} (= {flat.numel()} / {n})")
    want = flat[rank * shard_numel:(rank + 1) * shard_numel]
    if not torch.equal(master.detach(), want):
        starts = [s for s in range(flat.numel() - shard_numel + 1)
                  if torch.equal(flat[s:s + shard_numel], master.detach())]
        where = f"elements [{starts[0]}:{starts[0] + shard_numel}]" if starts else "other values"
        raise Hint(f"this rank steps the wrong shard: its master holds {where} of the buffer, not "
                   f"[{rank * shard_numel}:{(rank + 1) * shard_numel}]. Rank r owns the r-th "
                   "contiguous shard", FULL_STRONGER)
    got = _measure(master, optimizer)
    if got * n != full:
        raise Hint(f"your optimizer holds {got} B of state on this rank; 1/{n} of stage 0's {full} B "
                   f"is {full // n} B")
    return (f"each rank steps its own {shard_numel}-element shard; Adam's moments measured: {got} B "
            f"per rank = 1/{n} of stage 0's {full} B")


DRIFT = ("your ranks' weights drift apart: after optimizer.step(), each rank's updated shard must "
         "reach every rank. All-gather the shards back into flat")
DRIFT_STRONGER = "comm.all_gather(flat, master.detach()) after optimizer.step()"
TOO_LARGE = "the gradient your optimizer stepped with is {n}x too large: did you divide the SUM by the world size?"
TOO_SMALL = "the gradient your optimizer stepped with is {n}x too small: did you divide twice?"
SCALE_STRONGER = "master.grad = shard / world_size, once, after comm.reduce_scatter(shard, grad)"


@task("lab2.zero1_step", fn_name="zero1_step")
def check_zero1_step(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = _flat(n)
    s = flat.numel() // n
    master = torch.nn.Parameter(flat[rank * s:(rank + 1) * s].clone())
    optimizer = _make_optimizer([master])
    ref = torch.nn.Parameter(flat.clone())  # stage 0: the whole buffer, the mean gradient
    ref_optimizer = _make_optimizer([ref])
    problem = None
    for step in range(1, STEPS + 1):
        before = flat.clone()
        mean = torch.stack([_grad(ref.detach(), r) for r in range(n)]).mean(0)
        fn(flat, _grad(flat, rank), master, optimizer, n)
        ref.grad = mean
        ref_optimizer.step()
        everyone = torch.empty(n * flat.numel())  # the check's own collective: every rank's flat
        comm.all_gather(everyone, flat.detach().clone())
        if problem is None:
            problem = _diagnose(flat, before, ref.detach(), everyone.view(n, -1), master, mean, rank, n, step)
        if problem is not None:
            break
    if problem is not None:
        raise problem
    return (f"{STEPS} ZeRO-1 steps on {n} ranks match stage 0 (AdamW on the whole buffer); every "
            f"rank holds the same full weights; each stepped only its {s}-element shard")


def _diagnose(flat, before, ref, everyone, master, mean, rank, n, step) -> Hint | None:
    """The first thing wrong after ``step``, as a Hint; None when it matches stage 0."""
    s = flat.numel() // n
    own = slice(rank * s, (rank + 1) * s)
    g = master.grad
    if g is not None and g.shape == master.shape:
        want = mean[own]
        if torch.allclose(g, want * n, atol=1e-6) and not torch.allclose(g, want, atol=1e-6):
            return Hint(TOO_LARGE.format(n=n), SCALE_STRONGER)
        if torch.allclose(g, want / n, atol=1e-6) and not torch.allclose(g, want, atol=1e-6):
            return Hint(TOO_SMALL.format(n=n), SCALE_STRONGER)
        local = _grad(before, rank)[own]
        if torch.allclose(g, local, atol=1e-6) or torch.allclose(g, local / n, atol=1e-6):
            return Hint("your shard's gradient is this rank's own gradient, not the mean over ranks: "
                        "reduce-scatter grad first", "shard = torch.empty(grad.numel() // world_size); "
                        "comm.reduce_scatter(shard, grad)")
    if not all(torch.equal(everyone[0], everyone[r]) for r in range(n)):
        return Hint(DRIFT, DRIFT_STRONGER)
    if torch.allclose(flat, ref, atol=1e-5):
        return None
    if torch.equal(flat, before):
        return Hint("the full weights did not change: after optimizer.step(), all-gather every "
                    "rank's updated shard into flat", DRIFT_STRONGER)
    if torch.allclose(flat[own], ref[own], atol=1e-5):
        return Hint(DRIFT, DRIFT_STRONGER)
    return Hint(f"after step {step}, this rank's shard differs from stage 0 by up to "
                f"{(flat[own] - ref[own]).abs().max().item():.2g}: reduce-scatter grad, divide by "
                "world_size, set master.grad, optimizer.step(), all-gather")
