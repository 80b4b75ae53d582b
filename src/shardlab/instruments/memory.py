"""Measured memory: what this rank holds, by category, now and across a training step.

The formulas of :mod:`shardlab.instruments.memory_math` say what ZeRO *should* save; these instruments
count what the tensors actually hold, so the two can be set side by side:

* :func:`memory_report` - bytes held now, by category (``gathered``: stage-3 units borrowed);
* :func:`track_memory` - that tally at every engine event of a step, activations too, and the peak;
* :func:`saved_activations` - the bytes autograd keeps for backward, which no ZeRO stage
  shrinks (activation checkpointing does: :func:`shardlab.engine.units.checkpoint_units`).

A collective in flight counts with its unit: a reduction's buffers (the packed full gradient
and the shard it lands in) as ``grads``, a gather's as the unit's weights, from the collective's
own ``COMM`` event to its ``COMM_DONE`` (:func:`shardlab.engine.comm.in_flight`). It is matched to
its unit by the unit object (``Pending.owner``), not by name: two models of one architecture have
units of the same names.

Counting rule: each *storage* counts once (``untyped_storage().nbytes()``, keyed by data
pointer), so the parameters of a unit, views of one flat buffer, count as that buffer. Padding
(at most N-1 elements per unit) is allocated, so it is inside the bytes; ``report["padding"]``
says how much of ``total`` it is (not added again). A freed stage-3 unit counts 0. Roles follow
the ZeRO paper: an fp32 master beside bf16 weights is optimizer state (K = 12 includes it); a
master that *is* the weights (fp32) is params. AdamW's ``step`` counters (4 bytes per tensor
it steps) are optimizer state.

Every byte count returned is a :class:`~shardlab.instruments.measured.Measured` number
(``.by`` names the instrument), so the course's tables accept it as a measurement.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.nn as nn

from shardlab.engine import comm, events
from shardlab.engine.api import ShardedModule, engine_of
from shardlab.instruments.measured import Measured

CATEGORIES = ("params", "grads", "optimizer", "gathered", "frozen", "buffers")


class MemoryReport(dict):
    """A dict of bytes per category (plus ``total`` and ``padding``) that prints as a table."""

    def table(self, unit: str = "KB") -> str:
        scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
        rows = [f"{'category':<12}{unit:>12}"]
        rows += [f"{k:<12}{v / scale:>12.3f}" for k, v in self.items()]
        return "\n".join(rows)

    __str__ = table


class _Tally:
    """Adds tensors to categories, each storage once (views of one buffer count once)."""

    def __init__(self):
        self.seen: set = set()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.padding = 0

    def add(self, category: str, t, unit=None) -> None:
        nbytes = t.untyped_storage().nbytes() if t is not None else 0
        if nbytes == 0 or _key(t) in self.seen:
            return
        self.seen.add(_key(t))
        self.bytes[category] += nbytes
        elements = nbytes // t.element_size()
        if unit is not None and elements == unit.padded_numel:  # a whole flat buffer
            self.padding += (unit.padded_numel - unit.numel) * t.element_size()
        elif unit is not None and elements == unit.shard_numel:  # a shard: the last ones hold it
            start = unit.rank * unit.shard_numel
            self.padding += max(0, start + unit.shard_numel - max(unit.numel, start)) * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    return str(t.device), t.untyped_storage().data_ptr()


def _engine(model):
    return engine_of(model) if isinstance(model, ShardedModule) else None


def _inner(optimizer):  # parallelize returns a wrapper; the state lives in the torch optimizer
    return getattr(optimizer, "inner", optimizer)


def _tally(model: nn.Module, optimizer=None, include_constant: bool = True) -> _Tally:
    tally = _Tally()
    engine = _engine(model)
    if engine is not None:
        for unit in engine.units:  # the weights the forward uses come first: masters may view them
            tally.add("gathered" if engine.shards_params else "params", unit.full, unit)
            extra_copy = unit.master.dtype != unit.full.dtype  # fp32 master beside bf16 weights
            tally.add("optimizer" if extra_copy else "params", unit.master, unit)
            tally.add("grads", unit.master.grad, unit)
            for p in unit.params:
                tally.add("grads", p.grad, unit)
        owners = {id(unit): unit for unit in engine.units}
        for collective in comm.in_flight():  # from its COMM event to its COMM_DONE, both included
            owner = collective.owner
            unit = owners.get(id(owner)) if owner is not None else None
            if unit is None:  # by the unit object, not its name: another model has units of the same names
                continue  # not this model's unit: a loss, a gradient norm, a model check, another model
            weights = "gathered" if engine.shards_params else "params"
            category = "grads" if collective.kind in ("reduce_scatter", "all_reduce") else weights
            for t in collective.buffers:  # a gathered unit's ``full`` is counted above already
                tally.add(category, t, unit)
    else:
        for p in model.parameters():
            if p.requires_grad:
                tally.add("params", p)
                tally.add("grads", p.grad)
    if optimizer is not None:  # per parameter (piece): no padding in it
        for state in _inner(optimizer).state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    tally.add("optimizer", v)
    frozen = [p for p in model.parameters() if not p.requires_grad] if include_constant else []
    for category, tensors in (("frozen", frozen), ("buffers", model.buffers() if include_constant else ())):
        for t in tensors:  # kept whole at every stage
            tally.add(category, t)
    return tally


def memory_report(model: nn.Module, optimizer=None) -> MemoryReport:
    """Bytes this rank holds now for ``model`` (and ``optimizer``'s state), by category.

    Works on a model from ``shardlab.parallelize`` (any stage) and on a plain model and
    optimizer. ``total`` sums the categories; ``padding`` is the part of it that is padding.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memory_report expects an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(_inner(optimizer), torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch optimizer, got {type(optimizer).__name__}")
    tally = _tally(model, optimizer)
    counted = dict(**tally.bytes, total=sum(tally.bytes.values()), padding=tally.padding)
    return MemoryReport({k: Measured(v, by="memory_report") for k, v in counted.items()})


class _Saved:
    """What autograd stores instead of the tensor: its death means the graph let go of it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        entry = self.owner._live[self.key]
        entry[0] -= 1
        if entry[0] == 0:
            self.owner._bytes -= entry[1]
            del self.owner._live[self.key]


class SavedActivations:
    """Live bytes saved for backward (unique storages, parameters and buffers excluded)."""

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self._bytes = 0  # saved now
        self._peak = 0  # most saved at once
        self._live: dict = {}  # storage key -> [references, nbytes]

    @property
    def bytes(self) -> Measured:
        """Bytes saved for backward now (0 once backward has freed the graph)."""
        return Measured(self._bytes, by="saved_activations")

    @property
    def peak(self) -> Measured:
        """The most bytes saved at once."""
        return Measured(self._peak, by="saved_activations")

    def _excluded(self) -> set:
        """Weights and buffers are saved by layers but are not activations. Read at each save:
        stage 3 re-allocates its gathered buffers (new data pointers) at every gather."""
        if self.model is None:
            return set()
        units = _engine(self.model).units if _engine(self.model) is not None else []
        return {_key(t) for t in (*self.model.parameters(), *self.model.buffers(), *(u.full for u in units))}

    def _pack(self, t):
        key, nbytes = _key(t), t.untyped_storage().nbytes()
        if isinstance(t, nn.Parameter) or nbytes == 0 or key in self._excluded():
            return t
        entry = self._live.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self._bytes += entry[1]
            self._peak = max(self._peak, self._bytes)
        entry[0] += 1
        return _Saved(t, key, self)

    def hooks(self):
        unpack = lambda p: p.tensor if isinstance(p, _Saved) else p  # noqa: E731
        return torch.autograd.graph.saved_tensors_hooks(self._pack, unpack)


@contextmanager
def saved_activations(model: nn.Module | None = None):
    """Count the bytes autograd saves for backward during the ``with`` block.

    ``with shardlab.saved_activations(model) as act: loss = loss_fn(model(x), y)``, then
    ``act.bytes`` is saved now (0 once backward frees the graph), ``act.peak`` the most at once.

    Pass ``model`` so its weights are not counted. Under checkpointing only each region's
    input is saved; backward's recompute of one region at a time is not seen here.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"saved_activations expects an nn.Module or None, got {type(model).__name__}")
    act = SavedActivations(model)
    with act.hooks():
        yield act


class MemoryTrack:
    """Samples of this rank's memory at engine events; ``peak`` is the sample with most bytes.

    ``samples`` have the format ``shardlab.instruments.plots.memory_over_time`` draws: ``rank``, ``time``
    (seconds since the block began), ``event``, ``unit``, ``phase``, ``bytes`` (per category,
    activations included) and ``total``.
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.rank = _engine(model).rank if _engine(model) is not None else 0
        self.samples: list[dict] = []
        self.activations = SavedActivations(model)
        self.cuda = any(p.is_cuda for p in model.parameters())
        self.cuda_peak: int | None = None  # torch.cuda.max_memory_allocated() over the block
        self._constant = {k: v for k, v in _tally(model).bytes.items() if k in ("frozen", "buffers")}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def sample(self, event: str = "sample", fields: dict | None = None) -> None:
        """Tally now (the engine's tensors plus saved activations) and append a sample."""
        fields = fields or {}
        tally = _tally(self.model, self.optimizer, include_constant=False)
        raw = {**tally.bytes, **self._constant, "activations": self.activations._bytes}
        seconds = Measured(fields.get("time", time.perf_counter()) - self.t0, by="track_memory")
        s = {"rank": self.rank, "time": seconds,
             "event": event, "unit": fields.get("unit"), "phase": fields.get("phase", events.phase),
             "bytes": {k: Measured(v, by="track_memory") for k, v in raw.items()},
             "total": Measured(sum(raw.values()), by="track_memory")}
        if self.cuda:
            s["cuda_allocated"] = Measured(torch.cuda.memory_allocated(), by="torch.cuda.memory_allocated")
        self.samples.append(s)

    @property
    def peak(self) -> dict:
        """The sample with the largest ``total`` (its ``bytes`` say what made the peak)."""
        return max(self.samples, key=lambda s: s["total"])

    def peak_of(self, category: str) -> int:
        """The most bytes of one category at any sample (exact, every save, for activations)."""
        if category == "activations":
            return self.activations.peak
        return max(s["bytes"][category] for s in self.samples)

    def gather(self) -> list[dict]:
        """Every rank's samples, on every rank (a collective: call it on all ranks)."""
        return comm.gather_lists(self.samples)


@contextmanager
def track_memory(model: nn.Module | None = None, optimizer=None):
    """Record this rank's memory at every engine event inside the block, and its peak.

    ``with shardlab.track_memory(model, optimizer) as mem:`` around a step, then ``mem.peak``
    (the sample with most bytes) and ``plots.memory_over_time(mem.samples)``.

    Samples are taken at each engine event (a unit's forward and backward start and end, a
    free, a collective issued and landed, the optimizer step's start and end), at the model's
    forward start and end, and at the block's start and end: nowhere else. In particular no
    sample falls between the model's forward end and backward's first event, where a loss
    computed outside the model holds its saved buffers (a log-softmax: 4·b·T·vocab bytes) on
    top of every activation; call ``mem.sample("loss")`` there to count that moment
    (``shardlab.course.symptoms.peak`` does). Nothing is sampled inside an operation, and a
    tensor that is neither the engine's, the optimizer's nor saved for backward (the logits
    inside the loss, a gradient being computed) is in no category. With no ``model``, the one
    parallelized model alive is used. On CUDA, samples also hold ``torch.cuda.memory_allocated()`` and ``mem.cuda_peak``
    the allocator's peak: a cross-check (the allocator also holds workspaces, fragmentation).
    """
    if model is None:
        engine = engine_of()
        model, optimizer = engine.model, engine.optimizer()
    if not isinstance(model, nn.Module):
        raise TypeError(f"track_memory expects an nn.Module, got {type(model).__name__}")
    mem = MemoryTrack(model, optimizer)
    # The root's forward hooks sample where activations peak, at every stage. (``sample``
    # returns None: a hook's return value would replace the model's inputs or output.)
    hooks = [model.register_forward_pre_hook(lambda *_: mem.sample("model_forward")),
             model.register_forward_hook(lambda *_: mem.sample("model_forward_done"))]
    mem.sample("start")
    try:
        with mem.activations.hooks(), events.listen(lambda name, fields: mem.sample(name, fields)):
            yield mem
    finally:
        for h in hooks:
            h.remove()
    mem.sample("end")
    if mem.cuda:
        mem.cuda_peak = Measured(torch.cuda.max_memory_allocated(), by="torch.cuda.max_memory_allocated")
