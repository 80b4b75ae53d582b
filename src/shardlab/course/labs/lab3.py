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

from shardlab.course.labs import lab_model
from shardlab.course.labs.scale import judge_scale
from shardlab.course.labs.tasks import Hint, task
from shardlab.course.labs.watch import Collectives, refuse_others, traffic
from shardlab.engine import comm
from shardlab.engine.flat import FlatUnit

BACKWARDS = 3  # micro-batches: from the second backward on, re-arming (and double reduction) shows


def _fake_grads(unit, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients for ``unit``: known on every rank, different on each."""
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(shape, generator=g) for shape in unit.shapes]


@task("lab3.reduce_unit", fn_name="reduce_unit")
def check_reduce_unit(fn) -> str:
    """Hand ``fn`` a unit whose parameters hold this rank's gradients; expect the mean shard back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    unit = lab_model.flat_units(lab_model.make_model(), sharded=False)[0]
    for p, g in zip(unit.params, _fake_grads(unit, rank)):
        p.grad = g.clone()
    everyone = [lab_model.padded_flat(_fake_grads(unit, r), n) for r in range(n)]
    mean = torch.stack(everyone).mean(0)
    shard_of = lambda flat, r: flat[r * unit.shard_numel : (r + 1) * unit.shard_numel]  # noqa: E731
    want = shard_of(mean, rank)
    with Collectives() as seen:
        got = fn(unit)
    # what every rank returned, seen by every rank (bookkeeping, before any verdict)
    returned = comm.gather_lists([got.detach().reshape(-1).float().clone() if torch.is_tensor(got) else None])
    refuse_others(seen, "The task is one reduce-scatter: every rank passes its whole packed gradient and gets its "
                        "shard of the sum")
    if not torch.is_tensor(got):
        raise Hint(f"reduce_unit returned {type(got).__name__}; return this rank's gradient shard (a tensor)",
                   mistake="not_a_tensor")
    flat_got = got.detach().reshape(-1)
    if flat_got.numel() == unit.padded_numel:
        raise Hint(f"you returned the whole gradient ({flat_got.numel()} elements): each rank keeps only its "
                   f"shard of unit.shard_numel = {unit.shard_numel} elements. Reduce-scatter instead.",
                   "the buffer the collective writes into is unit.shard_numel long", mistake="full_size")
    if flat_got.numel() != unit.shard_numel:
        raise Hint(f"your shard has {flat_got.numel()} elements, expected unit.shard_numel = {unit.shard_numel}: "
                   f"pack the gradients into a flat buffer padded to unit.padded_numel = {unit.padded_numel} "
                   "first (unit.pack_grads(torch.float32) does it)", mistake="shard_size")
    flat_got = flat_got.float()
    if n > 1 and all(t is not None and t.shape == flat_got.shape and lab_model.close(t, shard_of(mean, 0))
                     for t in returned):  # one mistake, seen from every rank (rank 0's values are right)
        raise Hint("every rank holds rank 0's shard: rank r keeps elements "
                   "[r * shard_numel, (r + 1) * shard_numel) of the flat gradient", mistake="rank0_shard")
    if not lab_model.close(flat_got, want):
        if not flat_got.any():
            raise Hint("your shard is all zeros: the gradients were gone when you packed them. Pack "
                       "(unit.pack_grads) first, then free them (unit.set_param_grads(None))",
                       "look at the order of your first two lines", mistake="freed_before_packing")
        judge_scale(flat_got, want, n, "your gradient shard")
        own = shard_of(everyone[rank], rank)
        if lab_model.close(flat_got, own) or lab_model.close(flat_got, own / n):
            raise Hint("your shard holds only this rank's own gradient: reduce (SUM) across ranks first",
                       mistake="no_reduce")
        if any(lab_model.close(flat_got, shard_of(mean, r)) for r in range(n)):
            raise Hint("this rank holds another rank's shard: rank r keeps elements "
                       "[r * shard_numel, (r + 1) * shard_numel) of the flat gradient", mistake="wrong_shard")
        raise Hint(f"your shard differs from the mean gradient's shard (max difference "
                   f"{(flat_got - want).abs().max():.3g}); pack the grads in unit.params order, then reduce-scatter",
                   mistake="wrong_values")
    alive = [i for i, p in enumerate(unit.params) if p.grad is not None]
    if alive:
        if not any(unit.params[i].grad.any() for i in alive):  # zero_() keeps the memory, values gone
            why = ("you zeroed it (zero_()), which keeps every byte of it allocated. Set it to None once "
                   "packed: only then is its memory freed")
        else:
            why = ("Set it to None once packed: otherwise no memory is saved, and the next backward adds "
                   "to it and reduces it again (double reduction)")
        raise Hint(f"the full gradient is still alive: p.grad of {len(alive)} of the unit's "
                   f"{len(unit.params)} parameters still holds it; {why}",
                   "what still points at the full gradients after you packed them?",
                   mistake="full_grads_alive")
    held = got.untyped_storage().nbytes()
    if held > unit.shard_numel * got.element_size():
        raise Hint(f"your shard is a view into a {held // got.element_size()}-element buffer, which stays "
                   "alive as long as the shard does: reduce-scatter into a fresh tensor of "
                   "unit.shard_numel elements", mistake="shard_is_a_view")
    if "all_reduce" in seen.kinds():
        raise Hint("the values are right, but you all-reduced the whole gradient and kept a piece: a "
                   f"reduce-scatter sends each rank only its shard of the sum ({seen.ring_bytes():,} B per rank by the ring formula "
                   f"vs {traffic(unit.padded_numel, 4, n, ['reduce_scatter']):,} B)", mistake="all_reduce_instead")
    if seen.kinds() != ["reduce_scatter"]:
        raise Hint(f"the values are right, but your collectives were: {', '.join(seen.kinds()) or 'none'}; "
                   "the task is one reduce-scatter", mistake="collectives")
    return (f"{unit.name}: this rank's {unit.shard_numel:,} of {unit.padded_numel:,} gradient elements are the "
            f"mean over {n} ranks, from one reduce-scatter, in memory of their own; the full gradient is freed")


def _uneven_units(model) -> list:
    """blocks.0, blocks.1, and blocks.2 with blocks.3 as one unit of 12 parameters: units of different
    sizes, where a count shared by every unit, or a fixed 6, no longer fires at the right moment."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    blocks = model.blocks
    groups = {"blocks.0": [blocks[0]], "blocks.1": [blocks[1]], "blocks.2+3": [blocks[2], blocks[3]]}
    return [FlatUnit(name, [p for b in group for p in b.parameters()], rank=rank, world_size=world_size)
            for name, group in groups.items()]


def _free_only(unit) -> torch.Tensor:
    """A reduce with no collective, for the run on uneven units: it frees the full gradients, as
    reduce_unit does, and returns a zero shard (that run only watches when on_ready fires)."""
    unit.set_param_grads(None)
    return torch.zeros(unit.shard_numel)


def zero2_backward(when_ready, reduce, backwards: int = BACKWARDS, *, uneven: bool = False) -> dict:
    """Run ``backwards`` backward passes with ``when_ready`` calling ``reduce`` on each unit.

    Records, per backward and unit, how many of the unit's gradients were in at each call, the
    sum of the returned shards, and the peak bytes of full gradients alive (measured at every
    gradient accumulation, each storage once). ``uneven``: the units are :func:`_uneven_units`.
    """
    rank = dist.get_rank()
    model = lab_model.make_model()
    units = _uneven_units(model) if uneven else lab_model.flat_units(model, sharded=False)
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
    # A tensor hook (p.register_hook) fires before p.grad is updated; the only way to tell it from a
    # post-accumulate hook on the wrong parameter, which fires at the same count, is to look.
    tensor_hooks = {u.name: any(p._backward_hooks for p in u.params) for u in units}
    # How many of a unit's parameters carry a post-accumulate hook besides ``count``: one hooked
    # parameter and a countdown one short over all of them fire at the same count.
    hooked = {u.name: sum(len(p._post_accumulate_grad_hooks or ()) > 1 for p in u.params) for u in units}
    for b in range(backwards):
        state["backward"] = b
        for name in got:
            got[name] = 0
        x, y = lab_model.batch(rank, b)
        lab_model.loss_fn(model(x), y).backward()
    return {"units": units, "calls": calls, "shards": shards, "peak": state["peak"], "tensor_hooks": tensor_hooks,
            "hooked": hooked, "all_grads": sum(p.numel() * p.element_size() for p in params)}


COUNT = "you cannot know which gradient comes last: count how many of len(params) have arrived"
REARM = "when the count reaches zero, the next backward needs a full count again"


@task("lab3.when_ready", fn_name="when_ready")
def check_when_ready(fn) -> str:
    """Plug ``fn`` into a ZeRO-2 backward (with the reference reduce) and watch when it fires."""
    run = zero2_backward(fn, lab_model.reduce_grads)
    want = lab_model.reference_grad_shards(steps=BACKWARDS)  # every collective before any verdict
    uneven = zero2_backward(fn, _free_only, backwards=2, uneven=True)  # no collective: units of 6, 6 and 12
    for b, per_unit in enumerate(run["calls"]):
        which = ("the first", "the second", "the third", "a later")[min(b, 3)] + " backward"
        for u in run["units"]:
            counts, n = per_unit[u.name], len(u.params)
            early = [c for c in counts if c < n]
            if b == 0 and len(counts) == n and n > 1 and counts[0] < n:
                raise Hint(f"on_ready ran after every gradient of {u.name} ({n} times in {which}): each call "
                           "reduces a partial gradient. Call it once, when the last of the unit's gradients is in",
                           COUNT, mistake="fires_every_hook")
            one_short = early and early[0] == n - 1 and len(counts) == 1 and not run["tensor_hooks"][u.name]
            if one_short and run["hooked"][u.name] == n:
                raise Hint(f"on_ready ran for {u.name} in {which} with {n - 1} of its {n} gradients in, though "
                           f"you hooked all {n} parameters: your count is off by one. It must reach zero "
                           "(or len(params)) only when every one of the unit's gradients has arrived",
                           "start the countdown at len(params) and call on_ready when it reaches 0",
                           mistake="count_off_by_one")
            if one_short:
                raise Hint(f"on_ready ran for {u.name} in {which} with {n - 1} of its {n} gradients in: the "
                           "parameter you hooked is not the last to arrive. Gradients arrive roughly in reverse "
                           "order of use, and not exactly (the first parameter's is not the last). Hook every "
                           "parameter and count down", COUNT, mistake="hooked_one_param")
            if early and early[0] == n - 1 and len(counts) == 1:
                raise Hint(f"on_ready ran for {u.name} in {which} just before its last gradient was stored in "
                           "p.grad: a tensor hook (p.register_hook, and register_multi_grad_hook, which is built "
                           "on them) runs when a gradient is computed, before it is accumulated. "
                           "Use p.register_post_accumulate_grad_hook", "which hook runs after p.grad is updated?",
                           mistake="tensor_hook")
            if early and (b == 0 or len(counts) == 1):
                raise Hint(f"on_ready ran for {u.name} in {which} when only {early[0]} of its {n} gradients "
                           "were in: reducing then sends a partial gradient. Hook every parameter, count the "
                           "hook calls down and call on_ready only at zero", COUNT, mistake="fires_early")
            if len(counts) > 1:
                raise Hint(f"on_ready ran {len(counts)} times for {u.name} in {which}: each call reduces "
                           "again (double reduction). Call it once per backward: reset your count when it fires",
                           REARM, mistake="fires_again")
            if not counts:
                if b == 0:
                    raise Hint(f"on_ready never ran for {u.name}: call it when the last of its "
                               f"{n} gradients has been accumulated", COUNT, mistake="never_fires")
                raise Hint(f"on_ready never ran for {u.name} in {which}: your count did not start again "
                           "after the first backward. Re-arm it when it fires", REARM, mistake="not_rearmed")
    for u, w in zip(run["units"], want):
        if not lab_model.close(run["shards"][u.name], w):
            raise Hint(f"{u.name}: the gradient shards summed over {BACKWARDS} backwards differ from the "
                       "reference; call on_ready exactly once per backward, after the unit's last gradient",
                       mistake="wrong_values")
    _per_unit_count(uneven)
    peak, every = run["peak"], run["all_grads"]
    if peak >= every:
        raise Hint(f"full gradients peaked at {peak:,} bytes, as much as keeping all of them ({every:,}): "
                   "call on_ready as soon as each unit is done, not at the end", mistake="fires_at_the_end")
    return (f"on_ready ran once per unit per backward, after its last gradient ({BACKWARDS} backwards); "
            f"gradient shards match the all-reduce reference; full gradients peaked at {peak:,} bytes "
            f"vs {every:,} with all alive ({peak / every:.2f}x)")


def _per_unit_count(run: dict) -> None:
    """On units of different sizes, on_ready must still run once per unit, after its last gradient."""
    sizes = ", ".join(f"{u.name} {len(u.params)}" for u in run["units"])
    for b, per_unit in enumerate(run["calls"]):
        for u in run["units"]:
            counts, n = per_unit[u.name], len(u.params)
            if counts == [n]:
                continue
            when = (f"never ran for {u.name}, though all its {n} gradients came" if not counts else
                    f"ran for {u.name} when {counts[0]} of its {n} gradients were in" if len(counts) == 1 else
                    f"ran {len(counts)} times for {u.name}, first when {counts[0]} of its {n} gradients were in")
            raise Hint(f"on units of different sizes (parameters: {sizes}), in backward {b + 1}, on_ready {when}: "
                       "each unit needs its own count, of its own len(params). One count shared by every unit "
                       "(made outside when_ready), or a fixed number, works only while all units have the same "
                       "size, as the four blocks do", "make the count inside when_ready, from len(params): each "
                       "call then gets its own", mistake="count_not_per_unit")


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
