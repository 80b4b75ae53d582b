"""Lab 4 checks: the FSDP cycle of one unit, gather -> forward -> free -> gather -> backward -> reduce-scatter -> free.

The units are the engine's own FlatUnits, sharded: at rest a rank holds ``unit.master`` (its
shard) and ``unit.full`` has no memory. ``unit.gather()`` borrows the other shards,
``unit.free()`` gives them back. Two tasks: ``forward(unit, x)`` (borrow around the forward)
and ``prepare_backward(unit, out)`` (borrow again for the backward, then reduce-scatter and
give back). The checks drive a 4-block model through them, record what happened to each unit
and how many units held full weights at once, run backward through what the forward built,
and compare the gradient shards with ShardLab's stage 3, over 3 steps where hooks could pile up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.course.labs import lab_model, watch
from shardlab.course.labs.lab_model import on_grads_ready, reduce_grads  # noqa: F401 - the lab uses lab4.<name>
from shardlab.course.labs.tasks import Hint, task
from shardlab.engine import api, events

STEPS = 3
MOST = 2  # units gathered at once in backward: the one running and the one whose gradients are landing
CYCLE_FORWARD = ["gather", "forward", "free"]
CYCLE = ["gather", "forward", "free", "gather", "backward", "reduce_scatter", "free"]
FREE_FIRST = ["gather", "forward", "free", "gather", "backward", "free", "reduce_scatter"]  # PyTorch FSDP2's order (fully_shard frees, then reduce-scatters)
AFTER_BACKWARD = ("once all the unit's gradients are in (lab4.on_grads_ready), two things remain to do: "
                  "reduce them (lab4.reduce_grads) and give the weights back")
GATHER_AGAIN = "out.register_hook(fn) runs fn when backward reaches this unit's output: the moment to borrow"


def _at_rest(units) -> str:
    held = sum(u.full.untyped_storage().nbytes() for u in units)
    if held:
        busy = [u.name for u in units if u.holds_full]
        raise Hint(f"{', '.join(busy)} still hold their full weights: at rest a rank keeps only its shard",
                   mistake="not_at_rest")
    u = units[0]
    return (f"at rest each rank holds {u.shard_numel:,} of {u.padded_numel:,} elements per unit "
            f"(1/{u.world_size}), full weights freed")


def _forward_on_gathered(trace):
    def check(unit) -> None:
        if unit.gathering is not None:
            raise watch.used_in_flight(unit.name, "forward ran")
        if unit.holds_full:
            return
        if "gather" in trace.of(unit.name, ("gather",)):
            raise Hint(f"{unit.name}'s forward ran after you freed it: it computed on released memory. Free "
                       "a unit only once its output is computed", "look at the order of your three lines",
                       mistake="freed_before_forward")
        raise Hint(f"{unit.name}'s forward ran on freed weights: only the shard is there. Gather the unit "
                   "before its forward", "borrow first: unit.gather()", mistake="never_gathered")
    return check


@task("lab4.forward", fn_name="forward")
def check_forward(fn) -> str:
    """Run a 4-block model unit by unit through ``fn``; the weights must be borrowed only meanwhile."""
    rank = dist.get_rank()
    units = lab_model.flat_units(lab_model.make_model(), sharded=True)
    trace = watch.Trace(units)
    for u in units:
        trace.watch(u, forward_check=_forward_on_gathered(trace))
    x, _ = lab_model.batch(rank, 0)
    out = x
    try:
        for u in units:
            out = fn(u, out)
            if u.holds_full:
                raise Hint(f"after your forward, {u.name} still holds its full weights: free it once its output "
                           "is computed, or no memory is saved (every unit ends up gathered)",
                           "the last thing before return gives the weights back", mistake="not_freed")
            if not torch.is_tensor(out):
                raise Hint(f"forward returned {type(out).__name__}: return the unit's output, unit.module(x)",
                           mistake="not_a_tensor")
    finally:
        trace.close()
    want = lab_model.make_model()(x)
    if not lab_model.close(out.detach(), want.detach()):
        raise Hint("the output differs from the whole model's: return unit.module(x), run on the gathered weights",
                   mistake="wrong_values")
    for u in units:
        seen = trace.cycle(u.name, ("gather", "forward", "free"))  # gather(async_op=True) + its wait: one gather
        # a gather of a unit that holds its full weights is a no-op (FlatUnit.gather): not a mistake
        seen = [w for i, w in enumerate(seen) if not (w == "gather" and seen[i - 1:i] == ["gather"])]
        if seen == ["gather", "free"]:  # the right output (checked above) with no forward seen
            raise Hint(f"{u.name} went gather -> free: its forward hooks never ran, though your output is right. "
                       "Calling unit.module.forward(x) skips a module's hooks, and FSDP hangs its gather and "
                       "free on them. Call the module itself: unit.module(x)", mistake="forward_not_called")
        if seen != CYCLE_FORWARD:
            raise Hint(f"{u.name} went {' -> '.join(seen)}; expected {' -> '.join(CYCLE_FORWARD)}", mistake="cycle")
    rest = _at_rest(units)
    _backward_reaches_every_unit(units, out)
    return f"every unit went {' -> '.join(CYCLE_FORWARD)}; output matches the whole model; backward reaches every unit; {rest}"


def _backward_reaches_every_unit(units, out) -> None:
    """The output must carry its autograd graph: backward (on re-gathered weights) reaches every unit."""
    if not out.requires_grad or out.grad_fn is None:
        raise Hint("your output has no autograd graph, so backward cannot run: did the forward run under "
                   "torch.no_grad(), or return a detached tensor? Training needs the graph",
                   "return unit.module(x) itself", mistake="no_graph")
    for u in units:
        u.gather()
    try:
        out.sum().backward()
    finally:
        for u in units:
            u.free()
    missed = [u.name for u in units if any(p.grad is None for p in u.params)]
    if missed:
        raise Hint(f"backward from the output never reached {', '.join(missed)}: the graph is cut between "
                   "units (a detached output, or torch.no_grad()). Return unit.module(x) itself",
                   "return unit.module(x) itself", mistake="no_graph")


@task("lab4.prepare_backward", fn_name="prepare_backward")
def check_prepare_backward(fn) -> str:
    """Forward unit by unit, ``fn(unit, out)`` after each; then backward, compared with stage 3; 3 steps."""
    rank = dist.get_rank()
    units = lab_model.flat_units(lab_model.make_model(), sharded=True)
    trace = watch.Trace(units)
    left = {u.name: 0 for u in units}
    complete: list[str] = []  # units whose gradients are all in, not yet reduce-scattered, oldest first
    reductions = _Reductions(trace, complete)

    def counted(p, name):
        left[name] -= 1
        if left[name] == 0:
            complete.append(name)

    for u in units:
        trace.watch(u)
        for p in u.params:  # registered before the learner's hooks: counts each gradient first
            p.register_post_accumulate_grad_hook(lambda p, name=u.name: counted(p, name))
        traced_free = u.free

        def guarded_free(u=u, traced_free=traced_free):
            if left[u.name] > 0:
                raise Hint(f"{u.name} was freed while {left[u.name]} of its {len(u.params)} gradients were still "
                           "to come: its backward needs the full weights until the last one. Free it when "
                           "all are in (lab4.on_grads_ready). Two hooks look right and are not: "
                           "register_multi_grad_hook runs before the last p.grad is stored, and a module's full "
                           "backward hook runs when the gradient of its input is ready, which is not tied to its "
                           "parameters' p.grad (for a unit whose input needs no gradient, such as the first, "
                           "before any of them)", AFTER_BACKWARD, mistake="freed_too_early")
            traced_free()

        u.free = guarded_free

    def backward_starts(u):
        if u.gathering is not None:
            raise watch.used_in_flight(u.name, "backward started")
        if not u.holds_full:
            raise Hint(f"{u.name}'s backward ran on freed weights: only the shard is there. Gather the unit "
                       "again before its backward", GATHER_AGAIN, mistake="backward_on_freed")
        trace.add("backward", u.name)
        left[u.name] = len(u.params)

    reference = lab_model.make_model()  # stage 3 on the same data: every collective before any verdict
    _, ref_optimizer = api.parallelize(reference, stage=3, optimizer_cls=torch.optim.SGD, lr=0.1)
    steps = []
    try:
        for step in range(STEPS):
            start, trace.most_gathered = len(trace.log), 0
            for u in units:
                u.master.grad = None
            x, y = lab_model.batch(rank, step)
            out = x
            complete.clear()
            # the learner's collectives only (the reference's units share the names); reduce-scatters
            # at the dispatcher, however they were called
            with trace.listen(skip=("reduce_scatter",)), events.listen(reductions.on_event), reductions:
                for u in units:
                    u.gather()
                    out = u.module(out)
                    u.free()
                    fn(u, out)
                    out.register_hook(lambda grad, u=u: backward_starts(u))  # after the learner's hooks
                lab_model.loss_fn(out, y).backward()
            ref_optimizer.zero_grad()
            lab_model.loss_fn(reference(x), y).backward()
            steps.append({"log": trace.log[start:], "most": trace.most_gathered,
                          "gathered": [u.name for u in units if u.holds_full],
                          "grads": [None if u.master.grad is None else u.master.grad.clone() for u in units],
                          "want": [r.master.grad.clone() for r in api.engine_of(reference).units]})
    finally:
        trace.close()
    orders = set()
    for k, step in enumerate(steps, 1):
        orders |= _judge_step(units, step, k)
    most = max(s["most"] for s in steps)
    went = " or ".join(" -> ".join(o) for o in (CYCLE, FREE_FIRST) if tuple(o) in orders)
    fsdp2 = " (free before reduce_scatter: FSDP2's order)" if tuple(FREE_FIRST) in orders else ""
    return (f"every unit went {went}{fsdp2} in each of {STEPS} steps; at most {most} unit"
            f"{'s' if most != 1 else ''} held full weights at once; gradient shards match ShardLab stage 3; "
            f"{_at_rest(units)}")


def _judge_step(units, step: dict, k: int) -> set[tuple[str, ...]]:
    """Raises the step's first mistake; returns the orders the units went in (CYCLE or FREE_FIRST)."""
    for name in step["gathered"]:
        raise Hint(f"after backward, {name} still holds its full weights: free it once its gradients "
                   "are reduce-scattered", AFTER_BACKWARD, mistake="not_freed_after_backward")
    for u, grad in zip(units, step["grads"]):
        if grad is None and "reduce_scatter" in _order(step, u.name):
            raise Hint(f"{u.name}'s gradients were reduce-scattered, but it has no gradient shard after backward: "
                       "the shard must end up in unit.master.grad, where the optimizer finds it. "
                       "lab4.reduce_grads(unit) stores it there; a shard your own code reduce-scatters is yours "
                       "to store, divided by the world size", "what did you do with the shard the reduce-scatter "
                       "returned?", mistake="shard_not_kept")
        if grad is None:
            raise Hint(f"{u.name} has no gradient shard after backward: call lab4.reduce_grads(unit) once all "
                       "its gradients are in (lab4.on_grads_ready)", AFTER_BACKWARD, mistake="no_reduce")
    for u in units:
        seen = _order(step, u.name)
        reductions = seen.count("reduce_scatter")
        if k > 1 and reductions > 1:
            raise Hint(f"in step {k}, {u.name}'s gradients were reduce-scattered {reductions} times: the hooks "
                       f"you registered in earlier steps still fire (prepare_backward runs every step). Use "
                       "hooks that remove themselves once they ran, as lab4.on_grads_ready does",
                       "register_post_accumulate_grad_hook returns a handle: what should happen to it?",
                       mistake="hooks_pile_up")
        if step["most"] > MOST and seen[:4] == CYCLE[:4]:
            raise Hint(f"{step['most']} units held their full weights at once: you gather each unit again right "
                       "after its forward, so at the end of forward every unit is gathered. Gather it when "
                       "backward reaches it", GATHER_AGAIN, mistake="gathered_too_early")
        if seen not in (CYCLE, FREE_FIRST):
            raise Hint(f"in step {k}, {u.name} went {' -> '.join(seen)}; expected {' -> '.join(CYCLE)}",
                       mistake="cycle")
    if step["most"] > MOST:
        raise Hint(f"{step['most']} units held their full weights at once in step {k}; at most {MOST} may",
                   mistake="too_many_gathered")
    for u, grad, want in zip(units, step["grads"], step["want"]):
        if not lab_model.close(grad, want):
            raise Hint(f"in step {k}, {u.name}'s gradient shard differs from ShardLab stage 3's: reduce once, "
                       "after the unit's last gradient", mistake="wrong_values")
    return {tuple(_order(step, u.name)) for u in units}


def _order(step: dict, unit_name: str) -> list[str]:
    """What happened to one unit in a step, in order: its gathers, frees, passes and reduce-scatters.

    A gather started with ``async_op=True`` ("prefetch") and then waited for, by a plain ``gather()``
    or by ``wait_gather()``, is one gather; a prefetch never waited for stays in the list, as "prefetch"."""
    return watch.cycle(step["log"], unit_name, ("gather", "free", "forward", "backward", "reduce_scatter"))


class _Reductions(watch.Collectives):
    """Every reduce-scatter the learner's code runs, however it was called (``lab4.reduce_grads``,
    ``comm.reduce_scatter``, ``torch.distributed``), told to the trace as one unit's: the unit the
    engine's ``comm`` event names (``comm.reduce_scatter(..., unit=name)``, as ``lab4.reduce_grads``
    does), else the unit whose gradients were all in the earliest and that has no reduce-scatter yet
    (what ``lab4.on_grads_ready`` hands the learner's function)."""

    def __init__(self, trace: watch.Trace, complete: list[str]):
        super().__init__()
        self.trace, self.complete, self.named = trace, complete, None
        self._named_start = None  # the start of the reduce-scatter that named it

    def on_event(self, name: str, fields: dict) -> None:
        if name == events.COMM and fields["kind"] == "reduce_scatter":
            self.named = fields.get("unit")  # announced just before the call reaches the dispatcher
            self._named_start = fields["start"]
        elif name == events.COMM_FAILED and fields["start"] == self._named_start:
            # it raised before the dispatcher took the name
            self.named = None

    def _record(self, kind: str, op: str, args) -> None:
        named, self.named = self.named, None
        super()._record(kind, op, args)
        if kind == "reduce_scatter":
            unit = named or (self.complete[0] if self.complete else None)
            if unit in self.complete:
                self.complete.remove(unit)
            self.trace.add("reduce_scatter", unit)
