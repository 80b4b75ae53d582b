"""Every collective this process issues, seen at the dispatcher: kind, size, dtype, order, unit.

A collective reaches gloo through one of torch's c10d operators (``c10d::_allgather_base_``,
``c10d::_reduce_scatter_base_``, ...) whatever Python API called it: ``shardlab``'s
``engine/comm.py``, ``torch.distributed``, or PyTorch's own FSDP. :class:`Recorder` is a
``TorchDispatchMode``, so it sits under all of them, where each of those operators passes (the
way torch's ``CommDebugMode`` counts collectives). That makes it the one honest way to set two
systems side by side: both are recorded by the same instrument at the same place::

    with Recorder() as seen:
        loss_fn(model(x), y).backward()
    seen.log        # one Call per collective, in issue order
    seen.stream     # the same, interleaved with "forward", "backward" and "free" marks

The recorder does not know which unit a collective belongs to; whoever does says so first
(``seen.unit = "blocks.0"``): :mod:`shardlab.instruments.schedule` takes it from the engine's
``comm`` event, :mod:`shardlab.instruments.fsdp2` from PyTorch's ``FSDPParamGroup``.
``sent`` is the ring formula, (N-1)/N of the full buffer (twice for an all-reduce), not a
measurement of the wire.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shardlab.instruments import traffic

#: c10d operator -> the course's name for the collective
KINDS = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "allgather_": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
         "broadcast_": "broadcast", "allreduce_coalesced_": "all_reduce"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective, as the dispatcher saw it."""

    kind: str                     # all_gather, reduce_scatter, all_reduce, broadcast
    op: str                       # the c10d operator, e.g. "_allgather_base_"
    numel: int                    # elements of the FULL buffer (the gathered one, or the one reduced)
    shard: int                    # elements of this rank's part (== numel for all-reduce, broadcast)
    dtype: torch.dtype | None    # None: a coalesced call with no tensors
    world_size: int
    order: int = 0                # place in the recorder's log
    unit: str | None = None       # whose weights or gradients it moves, when someone said so
    phase: str | None = None      # forward, backward, step (when someone said so)
    reduce_op: str | None = None  # SUM, AVG, ... for reductions

    @property
    def ring_bytes(self) -> int:
        """Bytes this rank sends on a ring: a FORMULA, the ledger's own (``traffic.ring_bytes``),
        (N-1)/N × the paper's volume × element size. Not what gloo wrote: that is ``wire_bytes``."""
        if self.dtype is None:  # no tensors: nothing to send
            return 0
        return round(traffic.ring_bytes(self.kind, self.numel, self.world_size, self.dtype.itemsize))

    def record(self) -> dict:
        """The fields of a traffic-ledger record (kind, phase, unit, numel, dtype) and the rest."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {"ring_bytes": self.ring_bytes}


def numel_of(x) -> int:
    if torch.is_tensor(x):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(numel_of(t) for t in x)
    return 0


def _dtype_of(x) -> torch.dtype | None:
    """The element type of a tensor, or of a list's first; None for an empty list (a coalesced call
    with no tensors, which sends nothing)."""
    if torch.is_tensor(x):
        return x.dtype
    return _dtype_of(x[0]) if isinstance(x, (list, tuple)) and x else None


def _reduce_op(args) -> str | None:
    """The ReduceOp among the operator's arguments (a TorchScript object holding an int)."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().name() == "ReduceOp":
            return dist.ReduceOp.RedOpType(a.op()).name
    return None


class Recorder(TorchDispatchMode):
    """``with Recorder() as seen: ...``; then ``seen.log``, ``seen.stream``, ``seen.kinds()``, ``seen.ring_bytes()``."""

    def __init__(self):
        super().__init__()
        self.log: list[Call] = []
        self.stream: list[tuple[str, str | None]] = []  # (what, unit): collectives and marks, in order
        self.unit: str | None = None   # the unit the next collectives belong to (set by the caller)
        self.phase: str | None = None

    def mark(self, what: str, unit: str | None) -> None:
        """Note a non-collective moment (``"forward"``, ``"backward"``, ``"free"``) in the stream."""
        self.stream.append((what, unit))

    def check(self, kind: str, full, part) -> None:
        """Called before each collective runs; a subclass may refuse bad buffers (the labs do)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = KINDS.get(func._opname) if func.namespace == "c10d" else None
        if kind is not None:
            self._record(kind, func._opname, args)
        return func(*args, **kwargs)

    def _record(self, kind: str, op: str, args) -> None:
        out, inp = args[0], args[1]
        full, part = {"all_gather": (out, inp), "reduce_scatter": (inp, out)}.get(kind, (out, out))
        self.check(kind, full, part)
        call = Call(kind, op, numel_of(full), numel_of(part), _dtype_of(full), dist.get_world_size(),
                    order=len(self.log), unit=self.unit, phase=self.phase,
                    reduce_op=_reduce_op(args) if kind in ("all_reduce", "reduce_scatter") else None)
        self.log.append(call)
        self.stream.append((kind, self.unit))

    def kinds(self) -> list[str]:
        return [c.kind for c in self.log]

    def ring_bytes(self) -> int:
        """The ring formula's bytes for every recorded call (a formula, not a measurement)."""
        return sum(c.ring_bytes for c in self.log)

    def records(self) -> list[dict]:
        """One dict per collective, with the traffic ledger's keys (kind, phase, unit, numel, dtype)."""
        return [c.record() for c in self.log]
