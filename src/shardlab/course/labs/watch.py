"""What a check watches while the learner's code runs: every collective, and each unit's story.

:class:`Collectives` sees every collective this rank's process group runs, however the learner
called it (``shardlab.comm``, ``torch.distributed``, or a name bound earlier with ``from
torch.distributed import all_reduce``): it is the instruments' dispatcher recorder
(:mod:`shardlab.instruments.collectives`), which sits under every Python API, where each c10d
operation passes (PyTorch's own ``CommDebugMode`` counts collectives the same way). Beside the
four the course uses (all-gather, reduce-scatter, all-reduce, broadcast) it notes the c10d
operations no task calls for (``reduce``, ``gather``, ``scatter``, all-to-all, send and recv), so
that a hint names them rather than saying no collective ran. It also refuses, before they reach
gloo, the calls whose buffers cannot fit (gloo aborts the process on some of them), with a hint
in the lab's words.

:class:`Trace` records what happened to each unit, in order: gather, forward, free, backward,
all_gather, reduce_scatter..., and the most units that held their full weights at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.course.labs.tasks import Hint
from shardlab.engine import events
from shardlab.engine.flat import FlatUnit
from shardlab.instruments.collectives import Call, Recorder, numel_of
from shardlab.instruments.traffic import ring_bytes

SIZES = ("your {kind} got buffers that do not fit: {got}. {rule}. Are all your shards the same "
         "size, i.e. did you pad to a multiple of the world size?")

Collective = Call  # one recorded collective: kind, numel (of the full buffer), ring_bytes (formula), ...
SWAPPED = ("your {kind}'s arguments look swapped: its output has {out} elements and its input {inp}, on "
           "{n} ranks. Both collectives take (output, input): comm.reduce_scatter(shard, full) writes each "
           "rank's shard of the sum, comm.all_gather(full, shard) writes the full buffer")

#: The stronger hint when a unit's weights were used while its own gather was still in flight.
GATHER_WAITS = "unit.gather() returns once the weights are in"


def used_in_flight(name: str, what: str) -> Hint:
    """``name``'s ``what`` (its forward ran, its backward started) while its gather was in flight."""
    return Hint(f"{name}'s {what} while its gather was still in flight (async_op=True, never waited for): its "
                "weights may not have arrived. Gather without async_op here", GATHER_WAITS, mistake="used_in_flight")


#: c10d operations no lab task calls for, by the name a hint gives them, and what each does instead
OTHERS = {"reduce_": "reduce", "gather_": "gather", "scatter_": "scatter", "alltoall_": "all_to_all",
          "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv", "recv_any_source_": "recv"}
WHAT_OTHERS_DO = {
    "reduce": "dist.reduce sums onto one rank (dst) only; the other ranks do not get the sum",
    "gather": "dist.gather collects every shard on one rank (dst) only",
    "scatter": "dist.scatter hands out one rank's pieces and sums nothing",
    "all_to_all": "all-to-all swaps pieces between ranks and sums nothing",
    "send": "send and recv move a tensor between two ranks only",
    "recv": "send and recv move a tensor between two ranks only",
}


class Collectives(Recorder):
    """``with Collectives() as seen: fn(...)``; then ``seen.kinds()``, ``seen.log``, ``seen.ring_bytes()``.

    The instruments' dispatcher :class:`~shardlab.instruments.collectives.Recorder`, which also
    refuses, with a hint in the lab's words, the buffers gloo would abort the process on.
    ``seen.ring_bytes()`` is the ring formula's bytes, (N-1)/N x volume x element size, not bytes
    measured on the wire. ``reduce_full``: the padded gradient's length the task reduce-scatters,
    so that a reduce-scatter of one shard of it is named as that (it fits on 4 ranks, not on 3).
    ``seen.others``: the c10d operations outside the course's four (:data:`OTHERS`), as (kind,
    elements); ``seen.kinds()`` lists both, in issue order.
    """

    def __init__(self, reduce_full: int | None = None):
        super().__init__()
        self.reduce_full = reduce_full
        self.others: list[tuple[str, int]] = []
        self._order: list[tuple[str, int]] = []  # (kind, elements of the full buffer), every call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname in OTHERS:
            call = (OTHERS[func._opname], numel_of(args[0]) if args else 0)
            self.others.append(call)
            self._order.append(call)
            self.stream.append((call[0], self.unit))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, kind: str, op: str, args) -> None:
        super()._record(kind, op, args)
        self._order.append((kind, self.log[-1].numel))

    def kinds(self) -> list[str]:
        """Every collective's kind, in issue order, those outside the course's four included."""
        return [kind for kind, _ in self._order]

    def described(self) -> str:
        """"all_gather of 16, reduce of 12": every collective and its full buffer's elements, or "none"."""
        return ", ".join(f"{kind} of {numel}" for kind, numel in self._order) or "none"

    def check(self, kind: str, full, part) -> None:
        if kind not in ("all_gather", "reduce_scatter"):
            return
        n = dist.get_world_size()
        if n > 1 and numel_of(full) and numel_of(part) == n * numel_of(full):
            out, inp = (full, part) if kind == "all_gather" else (part, full)
            raise Hint(SWAPPED.format(kind=kind.replace("_", "-"), out=numel_of(out), inp=numel_of(inp), n=n),
                       mistake="swapped_arguments", broken=True)
        if kind == "reduce_scatter" and self.reduce_full and n > 1 \
                and numel_of(full) == self.reduce_full // n != self.reduce_full:
            raise Hint(f"your reduce-scatter got {numel_of(full)} elements, one rank's shard of the padded "
                       f"{self.reduce_full}-element gradient: mean_grad_shard takes the whole padded "
                       "gradient and hands back this rank's shard; do not split it first",
                       "pass the whole padded gradient to the reduce-scatter (in task 4: torch.cat of the shards)",
                       mistake="reduced_a_shard", broken=True)
        if numel_of(full) != n * numel_of(part):
            rule = ("all-gather fills full (world_size x shard elements) with every rank's shard"
                    if kind == "all_gather" else
                    "reduce-scatter reduces full (world_size x shard elements) into each rank's shard")
            got = f"full has {numel_of(full)} elements, shard {numel_of(part)}, on {n} ranks"
            if n != 4 and numel_of(full) == 4 * numel_of(part):
                raise Hint(f"your {kind.replace('_', '-')} got a buffer of 4 x shard elements on {n} ranks: "
                           "size it with world_size, not a fixed 4", mistake="hard_coded_world_size", broken=True)
            if kind == "all_gather":  # the shards are what they are: the buffer is what was sized
                raise Hint(f"your all-gather got buffers that do not fit: {got}. {rule}: size full as "
                           f"world_size x shard.numel() = {n * numel_of(part)} elements (the padded length; "
                           "drop the padding after the gather)", mistake="collective_sizes", broken=True)
            raise Hint(SIZES.format(kind=kind.replace("_", "-"), got=got, rule=rule),
                       mistake="collective_sizes", broken=True)


def refuse_others(seen: Collectives, task_words: str) -> None:
    """A collective outside the course's four: named, on every rank alike (the same code ran on each),
    before any rank judges its values (``dist.reduce`` leaves the right values on one rank only)."""
    if seen.others:
        kinds = list(dict.fromkeys(kind for kind, _ in seen.others))
        raise Hint(f"your code called {', '.join(k.replace('_', '-') for k in kinds)}: "
                   f"{'; '.join(dict.fromkeys(WHAT_OTHERS_DO[k] for k in kinds))}. {task_words}",
                   "every rank passes its whole buffer to the same collective, and every rank gets its result",
                   mistake="other_collective")


def traffic(numel: int, element_size: int, n: int, kinds=("reduce_scatter", "all_gather")) -> int:
    """Bytes one rank sends on a ring for ``kinds`` over a ``numel``-element buffer: the ledger's
    formula (``traffic.ring_bytes``), as each recorded ``Call.ring_bytes`` counts it."""
    return sum(round(ring_bytes(k, numel, n, element_size)) for k in kinds)


def _no_hook_argument(method: str, args) -> None:
    """``unit.gather``/``unit.free`` take no positional argument. A tensor as one means the method was
    registered as a hook (``out.register_hook(unit.gather)``: autograd calls a tensor hook with the
    gradient); a bool means ``gather(True)``, where ``async_op`` is keyword-only."""
    if args and isinstance(args[0], bool) and method == "gather":
        raise Hint(f"unit.gather({args[0]}): gather takes async_op by keyword only, so a positional "
                   f"{args[0]} is refused. Write unit.gather(async_op={args[0]})",
                   "FlatUnit.gather(self, *, async_op=False): the * makes what follows keyword-only",
                   mistake="positional_async")
    if args and not torch.is_tensor(args[0]):
        raise Hint(f"unit.{method} was called with an argument (a {type(args[0]).__name__}), and it takes "
                   f"none{' but async_op, by keyword' if method == 'gather' else ''}: "
                   f"unit.{method}({'async_op=True' if method == 'gather' else ''})", mistake="method_argument")
    if args:
        got = type(args[0]).__name__
        raise Hint(f"unit.{method} was called with an argument (a {got}): did you register the method "
                   f"itself as a hook? Autograd calls a tensor hook with the gradient, hook(grad), and "
                   f"unit.{method} takes none. Wrap it: out.register_hook(lambda grad: unit.{method}())",
                   "a hook gets the gradient as its argument: the lambda takes it and ignores it",
                   mistake="method_as_hook")


def cycle(log, unit_name: str, kinds) -> list[str]:
    """What happened to one unit in ``log`` ((what, unit) pairs), of ``kinds``, with each gather the
    learner started early (``gather(async_op=True)``, "prefetch") and then waited for (a plain
    ``gather()`` or ``wait_gather()``) told as one "gather", where the wait was. A prefetch never
    waited for stays in the list, as "prefetch"."""
    seen = [w for w, u in log if u == unit_name and w in (*kinds, "prefetch", "gather", "wait")]
    out = []
    for i, w in enumerate(seen):
        if w == "prefetch" and seen[i + 1:i + 2] in (["gather"], ["wait"]):
            continue  # told at its wait
        w = "gather" if w == "wait" else w
        if w in kinds or w == "prefetch":
            out.append(w)
    return out


def gathered(units) -> int:
    """How many units hold their full weights now (a gather in flight counts: its memory exists)."""
    return sum(u.holds_full for u in units)


class Trace:
    """What happened to each unit, in order: gather, free, forward, backward, all_gather, reduce_scatter...

    ``watch(unit)`` wraps the unit's ``gather``/``free`` and hooks its module; communication is
    recorded from the engine's events (``comm`` when issued, ``comm_done`` when waited for).
    ``most_gathered`` is the largest number of units holding full weights at any recorded moment.
    """

    def __init__(self, units):
        self.units = list(units)
        self.log: list[tuple[str, str]] = []
        self.most_gathered = gathered(self.units)
        self._handles = []
        self._skip: tuple[str, ...] = ()

    def add(self, what: str, unit_name: str | None) -> None:
        self.log.append((what, unit_name))
        self.most_gathered = max(self.most_gathered, gathered(self.units))

    def watch(self, unit: FlatUnit, *, forward_check=None) -> None:
        gather, free, wait_gather = unit.gather, unit.free, unit.wait_gather
        inside = [False]  # gather() and free() call wait_gather() themselves: only the learner's own call counts

        def traced_gather(*args, async_op: bool = False):
            _no_hook_argument("gather", args)
            inside[0] = True
            try:
                gather(async_op=async_op)
            finally:
                inside[0] = False
            self.add("prefetch" if async_op else "gather", unit.name)

        def traced_free(*args):
            _no_hook_argument("free", args)
            self.add("free", unit.name)  # before: the peak counts the unit that is being freed
            inside[0] = True
            try:
                free()
            finally:
                inside[0] = False

        def traced_wait(*args):
            _no_hook_argument("wait_gather", args)
            waits = unit.gathering is not None and not inside[0]
            wait_gather()
            if waits:  # the learner waited for a gather it had started: that gather is done now
                self.add("wait", unit.name)

        unit.gather, unit.free, unit.wait_gather = traced_gather, traced_free, traced_wait

        def pre(module, args):
            if forward_check is not None:
                forward_check(unit)
            self.add("forward", unit.name)

        self._handles += [unit.module.register_forward_pre_hook(pre),
                          unit.module.register_forward_hook(lambda m, a, o: self.add("forward_done", unit.name))]

    def on_event(self, name: str, fields: dict) -> None:
        if name in (events.COMM, events.COMM_DONE) and fields["kind"] not in self._skip:
            self.add(fields["kind"] + ("" if name == events.COMM else "_done"), fields.get("unit"))

    def listen(self, skip=()):
        """Record the engine's ``comm`` events, except those of the kinds in ``skip`` (which a
        check records another way)."""
        self._skip = tuple(skip)
        return events.listen(self.on_event)

    def of(self, unit_name: str, kinds=None) -> list[str]:
        return [w for w, u in self.log if u == unit_name and (kinds is None or w in kinds)]

    def cycle(self, unit_name: str, kinds) -> list[str]:
        return cycle(self.log, unit_name, kinds)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
