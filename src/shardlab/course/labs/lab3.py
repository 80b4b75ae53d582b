"""Lab 3 checks: ZeRO-2, reduce-scatter each unit's gradients the moment they are ready.

Two tasks, one idea: a unit's full gradient only needs to exist between its last gradient being
accumulated and its reduce-scatter. ``reduce_unit(unit)`` turns the full gradients into this
rank's shard of the mean and frees them; ``when_ready(params, on_ready)`` calls ``on_ready()``
once per backward, the moment the last of the unit's gradients is in. The checks run on every
rank of the lab's cluster (or on fresh ranks from the CLI and the tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.course.labs import pieces
from shardlab.course.labs.checking import Hint, task
from shardlab.engine import comm, events

BACKWARDS = 2  # two micro-batches: the second backward is where re-arming (and double reduction) shows


def _fake_grads(unit, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients for ``unit``: known on every rank, different on each."""
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(shape, generator=g) for shape in unit.shapes]


@task("lab3.reduce_unit", fn_name="reduce_unit")
def check_reduce_unit(fn) -> str:
    """Hand ``fn`` a unit whose parameters hold this rank's gradients; expect the mean shard back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    unit = pieces.flat_units(pieces.make_model(), sharded=False)[0]
    for p, g in zip(unit.params, _fake_grads(unit, rank)):
        p.grad = g.clone()
    everyone = [pieces.padded_flat(_fake_grads(unit, r), unit.padded_numel) for r in range(n)]
    mean = torch.stack(everyone).mean(0)
    shard_of = lambda flat, r: flat[r * unit.shard_numel : (r + 1) * unit.shard_numel]  # noqa: E731
    want = shard_of(mean, rank)

    kinds = []  # collectives issued through shardlab.comm, or dist.all_reduce called directly
    all_reduce = dist.all_reduce

    def counted_all_reduce(*args, **kwargs):
        kinds.append("all_reduce")
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce
    try:
        with events.listen(lambda name, f: kinds.append(f["kind"]) if name == "comm" else None):
            got = fn(unit)
    finally:
        dist.all_reduce = all_reduce

    # what every rank returned, seen by every rank (bookkeeping, before any verdict)
    returned = comm.gather_lists([got.detach().reshape(-1).float().clone() if torch.is_tensor(got) else None])
    if not torch.is_tensor(got):
        raise Hint(f"reduce_unit returned {type(got).__name__}; return this rank's gradient shard (a tensor)")
    got = got.detach().reshape(-1)
    if got.numel() == unit.padded_numel:
        raise Hint(f"you returned the whole gradient ({got.numel()} elements): each rank keeps only its "
                   f"shard of unit.shard_numel = {unit.shard_numel} elements. Reduce-scatter instead.",
                   stronger="shard = torch.empty(unit.shard_numel); comm.reduce_scatter(shard, full)")
    if got.numel() != unit.shard_numel:
        raise Hint(f"your shard has {got.numel()} elements, expected unit.shard_numel = {unit.shard_numel}: "
                   f"pack the gradients into a flat buffer padded to unit.padded_numel = {unit.padded_numel} "
                   "first (unit.pack_grads(torch.float32) does it)")
    got = got.float()
    if pieces.close(got, want * n):
        raise Hint(f"your gradient shard is {n}x too large: reduce_scatter SUMs over the {n} ranks; "
                   "divide by the world size to get the mean", stronger="shard /= unit.world_size")
    if pieces.close(got, want / n):
        raise Hint(f"your gradient shard is {n}x too small: you divided by the world size twice")
    if pieces.close(got, shard_of(everyone[rank], rank)):
        raise Hint("your shard holds only this rank's own gradient: reduce (SUM) across ranks first")
    shards_everywhere = [t is not None and t.shape == got.shape and pieces.close(t, shard_of(mean, 0))
                         for t in returned]
    if n > 1 and all(shards_everywhere):
        raise Hint("every rank holds rank 0's shard: rank r keeps elements "
                   "[r * shard_numel, (r + 1) * shard_numel) of the flat gradient")
    for r in range(n):
        if r != rank and pieces.close(got, shard_of(mean, r)):
            raise Hint(f"rank {rank} holds rank {r}'s shard: rank r keeps elements "
                       "[r * shard_numel, (r + 1) * shard_numel) of the flat gradient")
    if not pieces.close(got, want):
        raise Hint(f"your shard differs from the mean gradient's shard (max difference "
                   f"{(got - want).abs().max():.3g}); pack the grads in unit.params order, then reduce-scatter")
    alive = [i for i, p in enumerate(unit.params) if p.grad is not None]
    if alive:
        raise Hint(f"the full gradient is still alive: p.grad of {len(alive)} of the unit's "
                   f"{len(unit.params)} parameters still holds it. Set it to None once packed: otherwise "
                   "no memory is saved, and the next backward adds to it and reduces it again "
                   "(double reduction)", stronger="unit.set_param_grads(None)  # or p.grad = None for each p")
    held = got.untyped_storage().nbytes()
    if held > unit.shard_numel * got.element_size():
        raise Hint(f"your shard is a view into a {held // got.element_size()}-element buffer, which stays "
                   "alive as long as the shard does: reduce-scatter into a fresh tensor of "
                   "unit.shard_numel elements")
    if "all_reduce" in kinds and "reduce_scatter" not in kinds:
        raise Hint("you all-reduced the whole gradient, then kept a slice: a reduce-scatter sends each "
                   "rank only its shard of the sum, half the traffic of an all-reduce")
    return (f"{unit.name}: this rank's {unit.shard_numel:,} of {unit.padded_numel:,} gradient elements are the "
            f"mean over {n} ranks, in memory of their own; the full gradient is freed")


def zero2_backward(when_ready, reduce, backwards: int = BACKWARDS) -> dict:
    """Run ``backwards`` backward passes with ``when_ready`` calling ``reduce`` on each unit.

    Records, per backward and unit, how many of the unit's gradients were in at each call, the
    sum of the returned shards, and the peak bytes of full gradients alive (measured at every
    gradient accumulation, each storage once).
    """
    rank = dist.get_rank()
    model = pieces.make_model()
    units = pieces.flat_units(model, sharded=False)
    params = [p for u in units for p in u.params]
    state = {"backward": 0, "peak": 0}
    got = {u.name: 0 for u in units}
    calls = [{u.name: [] for u in units} for _ in range(backwards)]
    shards = {u.name: torch.zeros(u.shard_numel) for u in units}

    def full_grad_bytes() -> int:
        seen = {}
        for p in params:
            if p.grad is not None:
                seen[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
        return sum(seen.values())

    def count(p, name):  # registered first: runs before the learner's hook on the same parameter
        got[name] += 1
        state["peak"] = max(state["peak"], full_grad_bytes())

    for u in units:
        for p in u.params:
            p.register_post_accumulate_grad_hook(lambda p, name=u.name: count(p, name))

    def on_ready_for(unit):
        def on_ready(*_):
            if state["backward"] < backwards:
                calls[state["backward"]][unit.name].append(got[unit.name])
            shards[unit.name] += reduce(unit).detach().reshape(-1).float()
        return on_ready

    for u in units:
        when_ready(u.params, on_ready_for(u))
    for b in range(backwards):
        state["backward"] = b
        for name in got:
            got[name] = 0
        x, y = pieces.batch(rank, b)
        pieces.loss_fn(model(x), y).backward()
    return {"units": units, "calls": calls, "shards": shards, "peak": state["peak"],
            "all_grads": sum(p.numel() * p.element_size() for p in params)}


@task("lab3.when_ready", fn_name="when_ready")
def check_when_ready(fn) -> str:
    """Plug ``fn`` into a ZeRO-2 backward (with the reference reduce) and watch when it fires."""
    run = zero2_backward(fn, pieces.reduce_grads)
    want = pieces.reference_grad_shards(steps=BACKWARDS)  # every collective before any verdict
    for b, per_unit in enumerate(run["calls"]):
        which = "the first backward" if b == 0 else "the second backward"
        for u in run["units"]:
            counts, n = per_unit[u.name], len(u.params)
            early = [c for c in counts if c < n]
            if early and (b == 0 or len(counts) == 1):
                raise Hint(f"on_ready ran for {u.name} in {which} when only {early[0]} of its {n} gradients "
                           "were in: reducing then sends a partial gradient. Count the hook calls down and "
                           "call on_ready only at zero",
                           stronger="left = [len(params)]; in the hook: left[0] -= 1; if left[0] == 0: on_ready()")
            if len(counts) > 1:
                raise Hint(f"on_ready ran {len(counts)} times for {u.name} in {which}: each call reduces "
                           "again (double reduction). Call it once per backward: reset your count to "
                           "len(params) when it fires",
                           stronger="if left[0] == 0: left[0] = len(params); on_ready()")
            if not counts:
                if b == 0:
                    raise Hint(f"on_ready never ran for {u.name}: call it when the last of its "
                               f"{n} gradients has been accumulated")
                raise Hint(f"on_ready never ran for {u.name} in the second backward: your countdown "
                           "stayed at zero. Re-arm it (reset to len(params)) when it fires",
                           stronger="if left[0] == 0: left[0] = len(params); on_ready()")
    for u, w in zip(run["units"], want):
        if not pieces.close(run["shards"][u.name], w):
            raise Hint(f"{u.name}: the gradient shards summed over {BACKWARDS} backwards differ from the "
                       "reference; call on_ready exactly once per backward, after the unit's last gradient")
    peak, every = run["peak"], run["all_grads"]
    if peak >= every:
        raise Hint(f"full gradients peaked at {peak:,} bytes, as much as keeping all of them ({every:,}): "
                   "call on_ready as soon as each unit is done, not at the end")
    return (f"on_ready ran once per unit per backward, after its last gradient ({BACKWARDS} backwards); "
            f"gradient shards match the all-reduce reference; full gradients peaked at {peak:,} bytes "
            f"vs {every:,} with all alive ({peak / every:.2f}x)")


def gradient_peak(when_ready, reduce_unit) -> dict | None:
    """Your two functions together, measured: peak full-gradient bytes vs keeping them all (ZeRO-1).

    Run it on every rank (``cluster.run(lab3.gradient_peak, when_ready, reduce_unit)``);
    None while a task is still a stub.
    """
    try:
        run = zero2_backward(when_ready, reduce_unit, backwards=1)
    except NotImplementedError:
        return None
    return {"peak": run["peak"], "all_grads": run["all_grads"],
            "largest_unit": max(u.numel for u in run["units"]) * 4}
