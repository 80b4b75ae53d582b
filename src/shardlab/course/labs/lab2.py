"""Lab 2 checks: the ZeRO-1 step on one flat buffer.

The learner's two functions::

    shard_optimizer(flat, rank, world_size, make_optimizer) -> (master, optimizer)
        master: an nn.Parameter holding this rank's shard of ``flat``; optimizer: make_optimizer([master])
    zero1_step(flat, grad, master, optimizer, world_size)
        reduce-scatter ``grad`` (this rank's full, padded gradient), divide, step the shard,
        all-gather the updated shards back into ``flat`` (in place)

Memory is measured, not inferred: the bytes of the optimizer's state tensors, and the storage
behind ``master`` (a slice of a full-size copy keeps the whole copy alive). The step's reference
is stage 0 computed on each rank alone: the whole buffer, the mean of every rank's gradient
(known to the check, so the reference needs no collectives), over several steps. It steps with
SGD with momentum, which, unlike Adam, is not scale-invariant: a gradient N times too large moves
the weights N times too far, and state carries over from step to step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.course.labs.scale import judge_scale
from shardlab.course.labs.tasks import Hint, task
from shardlab.course.labs.watch import Collectives, refuse_others, traffic
from shardlab.engine import comm
from shardlab.engine.flat import padded_numel

NUMEL = 29           # real elements: not a multiple of 4 or 3, so the buffer is padded
STEPS = 3            # stage-0 parity over several steps: state carries over
LR, MOMENTUM = 0.1, 0.9


def _adamw(params):
    # no weight decay: a step with a zero gradient (to measure the state) leaves the weights alone
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.0)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _flat(n: int) -> torch.Tensor:
    """The same padded flat buffer on every rank (as after a broadcast from rank 0)."""
    flat = torch.zeros(padded_numel(NUMEL, n))
    flat[:NUMEL] = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    return flat


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
    return _measure(ref, _adamw([ref]))


FULL = ("your optimizer holds state for the whole buffer: {got} B of Adam moments on this rank, "
        "as much as stage 0 ({full} B), so ZeRO-1 saves nothing. Build it over this rank's shard "
        "only, 1/{n} of the buffer")
SHARD = "which elements does rank r own? S = flat.numel() // world_size of them, starting at r * S"


@task("lab2.shard_optimizer", fn_name="shard_optimizer")
def check_shard_optimizer(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = _flat(n)
    shard_numel = flat.numel() // n
    given = flat.clone()
    out = fn(given, rank, n, _adamw)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise Hint("shard_optimizer should return two things, (master, optimizer): "
                   f"got {type(out).__name__}. Did you forget the return statement?", mistake="not_a_pair")
    master, optimizer = out
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise Hint(f"the second thing returned should be make_optimizer([master]), got {type(optimizer).__name__}",
                   mistake="not_an_optimizer")
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    full = _full_state_bytes(flat)
    if not (torch.is_tensor(master) and master.requires_grad and master.is_leaf):
        raise Hint("master should be an nn.Parameter (a leaf tensor that requires grad) holding "
                   "this rank's shard", "wrap the shard in torch.nn.Parameter(...)", mistake="not_a_parameter")
    if sum(p.numel() for p in stepped) >= flat.numel():
        got = _measure(stepped[0], optimizer) if len(stepped) == 1 else full
        raise Hint(FULL.format(got=got, full=full, n=n), "make_optimizer gets a list: what is in it?",
                   mistake="full_optimizer")
    if not any(p is master for p in stepped):
        raise Hint("the optimizer does not step your master: build it with make_optimizer([master])",
                   mistake="optimizer_not_on_master")
    if master.numel() != shard_numel:
        if n != 4 and master.numel() == flat.numel() // 4:
            raise Hint(f"your master has {master.numel()} elements, 1/4 of the buffer, on {n} ranks: use "
                       "world_size, not 4", "S = flat.numel() // world_size", mistake="hard_coded_world_size")
        raise Hint(f"your master has {master.numel()} elements; this rank's shard of the padded "
                   f"{flat.numel()}-element buffer has {shard_numel} (= {flat.numel()} / {n})", SHARD,
                   mistake="shard_size")
    want = flat[rank * shard_numel:(rank + 1) * shard_numel]
    if not torch.equal(master.detach(), want):
        starts = [s for s in range(flat.numel() - shard_numel + 1)
                  if torch.equal(flat[s:s + shard_numel], master.detach())]
        where = f"elements [{starts[0]}:{starts[0] + shard_numel}]" if starts else "other values"
        raise Hint(f"this rank steps the wrong shard: its master holds {where} of the buffer, not "
                   f"[{rank * shard_numel}:{(rank + 1) * shard_numel}]. Rank r owns the r-th "
                   "contiguous shard", SHARD, mistake="wrong_shard")
    held = master.untyped_storage().nbytes()
    # A view of flat's own shard is correct: it is ShardLab's fp32 ZeRO1 (engine/zero1.py, ZeRO1.shard).
    # The optimizer updates those elements of flat in place, and the all-gather writes the same values back.
    view = master.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
    if not view and held > shard_numel * master.element_size():
        raise Hint(f"your master is a slice of a {held // master.element_size()}-element copy, which stays "
                   f"alive as long as the master does ({held} B, not {shard_numel * master.element_size()} B): "
                   "slice first, then copy", "order matters: slice, then .clone()", mistake="master_keeps_full_copy")
    own_bytes = 0 if view else held
    got = _measure(master, optimizer)
    if got * n != full:
        raise Hint(f"your optimizer holds {got} B of state on this rank; 1/{n} of stage 0's {full} B "
                   f"is {full // n} B", mistake="state_bytes")
    where = ("a view of flat's shard, 0 B of its own (ShardLab's fp32 ZeRO-1 does the same)" if view
             else f"in {own_bytes} B of its own")
    return (f"each rank steps its own {shard_numel}-element shard, {where}; Adam's moments "
            f"measured: {got} B per rank = 1/{n} of stage 0's {full} B")


DRIFT = ("your ranks' weights drift apart: after optimizer.step(), each rank's updated shard must "
         "reach every rank. All-gather the shards back into flat")
GATHER = "after the step, only this rank's shard of flat is new: which collective brings the others?"


class _Gathers(Collectives):
    """Also notes the storage each all-gather fills, to tell a gather into ``flat`` from one into a tensor
    of its own; and, in ``stream``, where ``optimizer.step()`` ran among the collectives (a "step" mark,
    from the optimizer's step pre-hook), to tell a gather before the step from one of a stale shard after it."""

    def __init__(self):
        super().__init__()
        self.filled: set[int] = set()

    def check(self, kind: str, full, part) -> None:
        super().check(kind, full, part)
        if kind == "all_gather" and torch.is_tensor(full):
            self.filled.add(full.untyped_storage().data_ptr())


@task("lab2.zero1_step", fn_name="zero1_step")
def check_zero1_step(fn) -> str:
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = _flat(n)
    s = flat.numel() // n
    own = slice(rank * s, (rank + 1) * s)
    master = torch.nn.Parameter(flat[own].clone())
    optimizer = _sgd([master])
    watching: list[_Gathers] = []  # the current step's recorder: the hook marks where step() ran
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: watching[-1].mark("step", None))
    ref = torch.nn.Parameter(flat.clone())  # stage 0: the whole buffer, the mean gradient
    ref_optimizer = _sgd([ref])
    per_step = []
    problem = None
    for step in range(1, STEPS + 1):
        before, master_before = flat.clone(), master.detach().clone()
        grad_before = None if master.grad is None else master.grad.detach().clone()
        mean = torch.stack([_grad(ref.detach(), r) for r in range(n)]).mean(0)
        with _Gathers() as seen:
            watching.append(seen)
            fn(flat, _grad(flat, rank), master, optimizer, n)
        per_step.append(seen)
        ref.grad = mean
        ref_optimizer.step()
        everyone = torch.empty(n * flat.numel())  # the check's own collective: every rank's flat
        comm.all_gather(everyone, flat.detach().clone())
        if problem is None:
            problem = _diagnose(flat, before, master, master_before, grad_before, ref.detach(),
                                everyone.view(n, -1), mean, rank, n, step, seen)
    for seen in per_step:  # the same calls on every rank: named before any rank's values are judged
        refuse_others(seen, "A ZeRO-1 step is one reduce-scatter (every rank gets its shard of the sum) and one "
                            "all-gather (every rank gets every shard)")
    if problem is not None:
        raise problem
    want = ["reduce_scatter", "all_gather"]
    for step, seen in enumerate(per_step, 1):
        if "all_reduce" in seen.kinds():
            raise Hint(f"the weights are right, but step {step} all-reduced: ZeRO-1 reduce-scatters, so each "
                       f"rank receives only its shard ({seen.ring_bytes():,} B per rank by the ring formula, the lab's step "
                       f"{traffic(flat.numel(), 4, n, want):,} B)", "the gradient a rank steps with is only "
                       "its shard: which collective delivers just that?", mistake="all_reduce_instead")
        if sorted(seen.kinds()) != sorted(want):
            got = ", ".join(seen.kinds()) or "none"
            raise Hint(f"the weights are right, but step {step} ran these collectives: {got}; a ZeRO-1 step "
                       "is one reduce-scatter and one all-gather", mistake="collectives")
    return (f"{STEPS} ZeRO-1 steps on {n} ranks match stage 0 (SGD with momentum on the whole buffer); "
            f"every rank holds the same full weights; each stepped only its {s}-element shard, with one "
            f"reduce-scatter and one all-gather a step ({per_step[0].ring_bytes():,} B per rank by the ring formula)")


def _diagnose(flat, before, master, master_before, grad_before, ref, everyone, mean, rank, n, step,
              seen: _Gathers) -> Hint | None:
    """The first thing wrong after ``step``, as a Hint; None when it matches stage 0."""
    s = flat.numel() // n
    own = slice(rank * s, (rank + 1) * s)
    moved = master.detach() - master_before
    stepped = [i for i, (what, _) in enumerate(seen.stream) if what == "step"]
    if step == 1:  # SGD's first step moves by -LR x the gradient it was given: read it back
        stepped_with = -moved / LR
        if not stepped:
            return Hint("your zero1_step never called optimizer.step(): master did not move, so neither did the "
                        "weights. After master.grad is set, the optimizer steps the shard",
                        "which line updates master?", mistake="no_step")
        if not moved.any():
            return Hint("optimizer.step() did not move your master: master.grad was None or zero when it "
                        "ran. Set master.grad first; zero_grad() belongs after the step, or before you set it",
                        "look at the order of optimizer.step() and optimizer.zero_grad()", mistake="no_grad_at_step")
        try:
            judge_scale(stepped_with, mean[own], n, "the gradient your optimizer stepped with")
        except Hint as hint:
            return hint
        local = _grad(before, rank)[own]
        if torch.allclose(stepped_with, local, atol=1e-5) or torch.allclose(stepped_with, local / n, atol=1e-5):
            return Hint("your shard's gradient is this rank's own gradient, not the mean over ranks: "
                        "reduce-scatter grad first", "the collective goes before the slice", mistake="no_reduce")
    if not all(torch.equal(everyone[0], everyone[r]) for r in range(n)):
        return Hint(DRIFT, GATHER, mistake="drift")
    if torch.allclose(flat, ref, atol=1e-5):
        return None
    kinds = seen.kinds()
    into_flat = flat.untyped_storage().data_ptr() in seen.filled
    gathered_at = [i for i, (what, _) in enumerate(seen.stream) if what == "all_gather"]
    if torch.equal(flat, before) and into_flat and moved.any() and stepped and gathered_at \
            and gathered_at[0] > stepped[0]:
        return Hint("you all-gathered after optimizer.step(), but flat's own shard still holds the old weights: "
                    "the step updated master, and here master is a tensor of its own, not a view of flat (a "
                    "master from your task 1 may be a view; the one this check passes is a copy). All-gather "
                    "master itself", "which tensor did optimizer.step() change?", mistake="gathered_stale_shard")
    if torch.equal(flat, before) and "all_gather" in kinds and into_flat and moved.any():
        return Hint("you all-gathered before optimizer.step(): your master moved, but flat got the shards as "
                    "they were before the step, so the full weights did not change. The all-gather goes last",
                    "the all-gather copies what master holds at the moment it runs: step first",
                    mistake="gathered_before_step")
    if torch.equal(flat, before) and "all_gather" in kinds:
        return Hint("you all-gathered, but not into the flat you were given: the full weights did not change. "
                    "A new tensor (flat = ..., or torch.empty for the output) rebinds a local name only; the "
                    "caller's flat is untouched. Gather in place: comm.all_gather(flat, master.detach())",
                    "all_gather's first argument is the buffer it fills: pass flat itself",
                    mistake="gathered_not_in_place")
    if torch.equal(flat, before):
        return Hint("the full weights did not change: after optimizer.step(), all-gather every "
                    "rank's updated shard into flat", GATHER, mistake="no_all_gather")
    if master.grad is not None and torch.allclose(flat[own], master.grad.detach().to(flat.dtype), atol=1e-6):
        return Hint(f"after step {step}, flat holds gradients, not weights: its shard {rank} is master.grad. You "
                    "all-gathered the gradient shards; all-gather master itself (the updated weights)",
                    "which tensor did optimizer.step() change?", mistake="gathered_grad")
    if (grad_before is not None and master.grad is not None
            and torch.allclose(master.grad.detach(), grad_before + mean[own], atol=1e-5)):
        return Hint(f"after step {step}, master.grad is the last step's gradient plus this one's: you added to "
                    "master.grad, and nothing cleared it after the step, so each step steps with the sum so far",
                    "set master.grad = shard (not +=), or call optimizer.zero_grad() after optimizer.step()",
                    mistake="grad_not_cleared")
    return Hint(f"after step {step}, this rank's shard differs from stage 0 by up to "
                f"{(flat[own] - ref[own]).abs().max().item():.2g}: reduce-scatter grad, divide by "
                "world_size, set master.grad, optimizer.step(), all-gather", mistake="wrong_values")

