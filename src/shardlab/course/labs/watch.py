"""What a check watches while the learner's code runs: every collective, and each unit's story.

:class:`Collectives` sees every collective this rank's process group runs, however the learner
called it (``shardlab.comm``, ``torch.distributed``, or a name bound earlier with ``from
torch.distributed import all_reduce``): it is a ``TorchDispatchMode``, so it sits under every
Python API, at the dispatcher where each c10d operation passes (PyTorch's own ``CommDebugMode``
counts collectives the same way). It also refuses, before they reach gloo, the calls whose
buffers cannot fit (gloo aborts the process on some of them), with a hint in the lab's words.

:class:`Trace` records what happened to each unit, in order: gather, forward, free, backward,
all_gather, reduce_scatter..., and the most units that held their full weights at once.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shardlab.course.labs.tasks import Hint
from shardlab.engine import events
from shardlab.engine.flat import FlatUnit

_KINDS = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "allgather_": "all_gather",
          "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
          "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
          "broadcast_": "broadcast", "allreduce_coalesced_": "all_reduce"}

SIZES = ("your {kind} got buffers that do not fit: {got}. {rule}. Are all your shards the same "
         "size, i.e. did you pad to a multiple of the world size?")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str    # all_gather, reduce_scatter, all_reduce, broadcast (or the c10d op's name)
    numel: int   # elements of the full buffer (the gathered one, or the one reduced)
    sent: int    # bytes this rank sends on a ring: (N-1)/N of the full buffer, twice for all-reduce


def _numel(x) -> int:
    if torch.is_tensor(x):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(t) for t in x)
    return 0


def _bytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


class Collectives(TorchDispatchMode):
    """``with Collectives() as seen: fn(...)``; then ``seen.kinds()``, ``seen.log``, ``seen.sent()``."""

    def __init__(self):
        super().__init__()
        self.log: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            op = func._opname
            kind = _KINDS.get(op)
            if kind is not None:
                self._record(kind, op, args)
        return func(*args, **kwargs)

    def _record(self, kind: str, op: str, args) -> None:
        n = dist.get_world_size()
        out, inp = args[0], args[1]
        if kind == "all_gather":
            full, part = out, inp
        elif kind == "reduce_scatter":
            full, part = inp, out
        else:
            full = part = out
        if kind in ("all_gather", "reduce_scatter") and _numel(full) != n * _numel(part):
            rule = ("all-gather fills full (world_size x shard elements) with every rank's shard"
                    if kind == "all_gather" else
                    "reduce-scatter reduces full (world_size x shard elements) into each rank's shard")
            got = f"full has {_numel(full)} elements, shard {_numel(part)}, on {n} ranks"
            if n != 4 and _numel(full) == 4 * _numel(part):
                raise Hint(f"your {kind.replace('_', '-')} got a buffer of 4 x shard elements on {n} ranks: "
                           "size it with world_size, not a fixed 4", mistake="hard_coded_world_size", broken=True)
            raise Hint(SIZES.format(kind=kind.replace("_", "-"), got=got, rule=rule),
                       mistake="collective_sizes", broken=True)
        share = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(kind, (n - 1) / n)
        self.log.append(Collective(kind, _numel(full), round(share * _bytes(full))))

    def kinds(self) -> list[str]:
        return [c.kind for c in self.log]

    def sent(self) -> int:
        return sum(c.sent for c in self.log)


def traffic(numel: int, element_size: int, n: int, kinds=("reduce_scatter", "all_gather")) -> int:
    """Bytes one rank sends on a ring for ``kinds`` over a ``numel``-element buffer: the lab's formula."""
    share = {"all_reduce": 2 * (n - 1) / n}
    return sum(round(share.get(k, (n - 1) / n) * numel * element_size) for k in kinds)


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
