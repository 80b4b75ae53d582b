"""Lab 4 checks: the FSDP cycle of one unit, gather -> forward -> free -> gather -> backward -> reduce-scatter -> free.

The units are the engine's own FlatUnits, sharded: at rest a rank holds ``unit.master`` (its
shard) and ``unit.full`` has no memory. ``unit.gather()`` borrows the other shards,
``unit.free()`` gives them back. Two tasks: ``forward(unit, x)`` (borrow around the forward)
and ``prepare_backward(unit, out)`` (borrow again for the backward, then reduce-scatter and
give back). The checks drive a 4-block model through them, record what happened to each unit,
and compare the gradient shards with ShardLab's stage 3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.course.labs import lab_model
from shardlab.course.labs.lab_model import on_grads_ready, reduce_grads  # noqa: F401 - the lab uses lab4.<name>
from shardlab.course.labs.tasks import Hint, task
from shardlab.engine import api

CYCLE_FORWARD = ["gather", "forward", "free"]
CYCLE = ["gather", "forward", "free", "gather", "backward", "reduce_scatter", "free"]
AFTER_BACKWARD = "lab4.on_grads_ready(unit, lambda: (lab4.reduce_grads(unit), unit.free()))"


def _at_rest(units) -> str:
    held = sum(u.full.untyped_storage().nbytes() for u in units)
    if held:
        busy = [u.name for u in units if u.is_gathered]
        raise Hint(f"{', '.join(busy)} still hold their full weights: at rest a rank keeps only its shard")
    u = units[0]
    return (f"at rest each rank holds {u.shard_numel:,} of {u.padded_numel:,} elements per unit "
            f"(1/{u.world_size}), full weights freed")


def _must_be_gathered(unit, when: str) -> None:
    if not unit.is_gathered:
        raise Hint(f"{unit.name}'s {when} ran on freed weights: only the shard is there. Gather the unit "
                   f"before its {when}" + (", free it after" if when == "forward" else ""),
                   stronger="unit.gather()" if when == "forward" else
                   "out.register_hook(lambda grad: unit.gather())  # runs just before the unit's backward")


@task("lab4.forward", fn_name="forward")
def check_forward(fn) -> str:
    """Run a 4-block model unit by unit through ``fn``; the weights must be borrowed only meanwhile."""
    rank = dist.get_rank()
    units = lab_model.flat_units(lab_model.make_model(), sharded=True)
    trace = watch.Trace(units)
    for u in units:
        trace.watch(u, forward_check=lambda u: _must_be_gathered(u, "forward"))
    x, _ = lab_model.batch(rank, 0)
    out = x
    try:
        for u in units:
            out = fn(u, out)
            if u.is_gathered:
                raise Hint(f"after your forward, {u.name} still holds its full weights: free it once its "
                           "output is computed, or no memory is saved (every unit ends up gathered)",
                           stronger="out = unit.module(x); unit.free(); return out")
            if not torch.is_tensor(out):
                raise Hint(f"forward returned {type(out).__name__}: return the unit's output, unit.module(x)")
    finally:
        trace.close()
    want = lab_model.make_model()(x)
    if not lab_model.close(out.detach(), want.detach()):
        raise Hint("the output differs from the whole model's: return unit.module(x), run on the gathered weights")
    for u in units:
        seen = trace.of(u.name, ("gather", "forward", "free"))
        if seen != CYCLE_FORWARD:
            raise Hint(f"{u.name} went {' -> '.join(seen)}; expected {' -> '.join(CYCLE_FORWARD)}")
    return f"every unit went {' -> '.join(CYCLE_FORWARD)}; output matches the whole model; {_at_rest(units)}"


@task("lab4.prepare_backward", fn_name="prepare_backward")
def check_prepare_backward(fn) -> str:
    """Forward unit by unit, ``fn(unit, out)`` after each; then one backward, compared with stage 3."""
    rank = dist.get_rank()
    units = lab_model.flat_units(lab_model.make_model(), sharded=True)
    trace = watch.Trace(units)
    left = {u.name: 0 for u in units}
    for u in units:
        trace.watch(u)
        for p in u.params:  # registered before the learner's hooks: counts each gradient first
            p.register_post_accumulate_grad_hook(lambda p, name=u.name: left.__setitem__(name, left[name] - 1))
        traced_free = u.free

        def guarded_free(u=u, traced_free=traced_free):
            if left[u.name] > 0:
                raise Hint(f"{u.name} was freed while {left[u.name]} of its {len(u.params)} gradients were still "
                           "to come: its backward needs the full weights until the last one. Free it when "
                           "all are in (lab4.on_grads_ready), after lab4.reduce_grads", stronger=AFTER_BACKWARD)
            traced_free()

        u.free = guarded_free

    def backward_starts(u):
        _must_be_gathered(u, "backward")
        trace.add("backward", u.name)
        left[u.name] = len(u.params)

    x, y = lab_model.batch(rank, 0)
    out = x
    try:
        with trace.listen():
            for u in units:
                u.gather()
                out = u.module(out)
                u.free()
                fn(u, out)
                out.register_hook(lambda grad, u=u: backward_starts(u))  # after the learner's hooks
            lab_model.loss_fn(out, y).backward()
    finally:
        trace.close()
    reference = lab_model.make_model()  # stage 3 on the same data: every collective before any verdict
    api.parallelize(reference, stage=3, optimizer_cls=torch.optim.SGD, lr=0.1)
    lab_model.loss_fn(reference(x), y).backward()

    for u in units:
        if u.is_gathered:
            raise Hint(f"after backward, {u.name} still holds its full weights: free it once its gradients "
                       "are reduce-scattered", stronger=AFTER_BACKWARD)
        if u.master.grad is None:
            raise Hint(f"{u.name} has no gradient shard after backward: call lab4.reduce_grads(unit) once all "
                       "its gradients are in (lab4.on_grads_ready)", stronger=AFTER_BACKWARD)
    keep = ("gather", "free", "forward", "backward", "reduce_scatter")
    for u in units:
        seen = trace.of(u.name, keep)
        if seen != CYCLE:
            raise Hint(f"{u.name} went {' -> '.join(seen)}; expected {' -> '.join(CYCLE)}")
    for u, ref in zip(units, api.engine_of(reference).units):
        if not lab_model.close(u.master.grad, ref.master.grad):
            raise Hint(f"{u.name}'s gradient shard differs from ShardLab stage 3's: reduce once, after the "
                       "unit's last gradient")
    return (f"every unit went {' -> '.join(CYCLE)}; gradient shards match ShardLab stage 3; {_at_rest(units)}")
