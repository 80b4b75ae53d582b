"""What a check watches while the learner's code runs: every collective, and each unit's story.

:class:`Collectives` sees every collective this rank's process group runs, however the learner
called it (``shardlab.comm``, ``torch.distributed``, or a name bound earlier with ``from
torch.distributed import all_reduce``): it is the instruments' dispatcher recorder
(:mod:`shardlab.instruments.collectives`), which sits under every Python API, where each c10d
operation passes (PyTorch's own ``CommDebugMode`` counts collectives the same way). It also
refuses, before they reach gloo, the calls whose buffers cannot fit (gloo aborts the process on
some of them), with a hint in the lab's words.

:class:`Trace` records what happened to each unit, in order: gather, forward, free, backward,
all_gather, reduce_scatter..., and the most units that held their full weights at once.
"""

from __future__ import annotations

import torch.distributed as dist

from shardlab.course.labs.tasks import Hint
from shardlab.engine import events
from shardlab.engine.flat import FlatUnit
from shardlab.instruments.collectives import Call, Recorder, numel_of
from shardlab.instruments.traffic import ring_bytes

SIZES = ("your {kind} got buffers that do not fit: {got}. {rule}. Are all your shards the same "
         "size, i.e. did you pad to a multiple of the world size?")

Collective = Call  # one recorded collective: kind, numel (of the full buffer), ring_bytes (formula), ...


class Collectives(Recorder):
    """``with Collectives() as seen: fn(...)``; then ``seen.kinds()``, ``seen.log``, ``seen.ring_bytes()``.

    The instruments' dispatcher :class:`~shardlab.instruments.collectives.Recorder`, which also
    refuses, with a hint in the lab's words, the buffers gloo would abort the process on.
    """

    def check(self, kind: str, full, part) -> None:
        if kind not in ("all_gather", "reduce_scatter"):
            return
        n = dist.get_world_size()
        if numel_of(full) != n * numel_of(part):
            rule = ("all-gather fills full (world_size x shard elements) with every rank's shard"
                    if kind == "all_gather" else
                    "reduce-scatter reduces full (world_size x shard elements) into each rank's shard")
            got = f"full has {numel_of(full)} elements, shard {numel_of(part)}, on {n} ranks"
            if n != 4 and numel_of(full) == 4 * numel_of(part):
                raise Hint(f"your {kind.replace('_', '-')} got a buffer of 4 x shard elements on {n} ranks: "
                           "size it with world_size, not a fixed 4", mistake="hard_coded_world_size", broken=True)
            raise Hint(SIZES.format(kind=kind.replace("_", "-"), got=got, rule=rule),
                       mistake="collective_sizes", broken=True)


def traffic(numel: int, element_size: int, n: int, kinds=("reduce_scatter", "all_gather")) -> int:
    """Bytes one rank sends on a ring for ``kinds`` over a ``numel``-element buffer: the ledger's
    formula (``traffic.ring_bytes``), as each recorded ``Call.ring_bytes`` counts it."""
    return sum(round(ring_bytes(k, numel, n, element_size)) for k in kinds)


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

    def add(self, what: str, unit_name: str | None) -> None:
        self.log.append((what, unit_name))
        self.most_gathered = max(self.most_gathered, gathered(self.units))

    def watch(self, unit: FlatUnit, *, forward_check=None) -> None:
        gather, free = unit.gather, unit.free

        def traced_gather(*, async_op: bool = False):
            gather(async_op=async_op)
            self.add("prefetch" if async_op else "gather", unit.name)

        def traced_free():
            self.add("free", unit.name)  # before: the peak counts the unit that is being freed
            free()

        unit.gather, unit.free = traced_gather, traced_free

        def pre(module, args):
            if forward_check is not None:
                forward_check(unit)
            self.add("forward", unit.name)

        self._handles += [unit.module.register_forward_pre_hook(pre),
                          unit.module.register_forward_hook(lambda m, a, o: self.add("forward_done", unit.name))]

    def on_event(self, name: str, fields: dict) -> None:
        if name in ("comm", "comm_done"):
            self.add(fields["kind"] + ("" if name == "comm" else "_done"), fields.get("unit"))

    def listen(self):
        return events.listen(self.on_event)

    def of(self, unit_name: str, kinds=None) -> list[str]:
        return [w for w, u in self.log if u == unit_name and (kinds is None or w in kinds)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
