"""Measured memory: what this rank holds, by category, now and across a training step.

The formulas of :mod:`shardlab.memory_math` say what ZeRO *should* save; these instruments
count what the tensors actually hold, so the two can be set side by side:

* :func:`memory_report` - bytes held now: ``params``, ``grads``, ``optimizer``, ``gathered``
  (stage-3 units borrowed for compute), ``frozen``, ``buffers`` and ``total``;
* :func:`track_memory` - the same tally at every engine event of a step (gather, forward,
  free, reduce-scatter, step), plus the bytes saved for backward, and the peak;
* :func:`saved_activations` - the bytes autograd keeps for backward, which no ZeRO stage
  shrinks (only activation checkpointing does: see :func:`checkpoint_units`).

Counting rule: every tensor is counted by its *storage*, once (``untyped_storage().nbytes()``,
keyed by data pointer). The parameters of a unit are views of one flat buffer, so they count
as that buffer, padding included: the reported bytes are what is allocated, the padding
(at most N-1 elements per unit) sits inside them, and ``report["padding"]`` says how much of
``total`` it is (it is *not* added to ``total`` again). A storage freed to size 0 (a stage-3
unit at rest) counts 0. Roles follow the ZeRO paper: an fp32 master copy kept beside
low-precision weights is optimizer state (its K = 12 includes it); a master that *is* the
weights (fp32 training) counts as params. AdamW's ``step`` counters (4 bytes per tensor it
steps) are optimizer state too.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from shardlab import events

CATEGORIES = ("params", "grads", "optimizer", "gathered", "frozen", "buffers")


class MemoryReport(dict):
    """A dict of bytes per category (plus ``total`` and ``padding``) that prints as a table."""

    def table(self, unit: str = "KB") -> str:
        scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
        rows = [f"{'category':<12}{unit:>12}"]
        rows += [f"{k:<12}{v / scale:>12.3f}" for k, v in self.items()]
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


class _Tally:
    """Adds tensors to categories, each storage once (views of one buffer count once)."""

    def __init__(self):
        self.seen: set = set()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.padding = 0

    def add(self, category: str, t, unit=None) -> None:
        if t is None:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = (str(t.device), storage.data_ptr())
        if nbytes == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[category] += nbytes
        if unit is not None:
            self.padding += _padding_elements(unit, nbytes // t.element_size()) * t.element_size()


def _padding_elements(unit, elements: int) -> int:
    """Padding inside a unit's flat buffer of ``elements``: the whole one, or this rank's shard."""
    if elements == unit.padded_numel:
        return unit.padded_numel - unit.numel
    if elements == unit.shard_numel:  # the padding is at the end: the last shard(s) hold it
        start = unit.rank * unit.shard_numel
        return max(0, start + unit.shard_numel - max(unit.numel, start))
    return 0


def _engine(model):
    return getattr(model, "_shardlab", None)


def _inner(optimizer):
    """The torch optimizer holding the state (``parallelize`` returns a wrapper around it)."""
    return getattr(optimizer, "inner", optimizer)


def _tally(model: nn.Module, optimizer=None, include_constant: bool = True) -> _Tally:
    tally = _Tally()
    engine = _engine(model)
    if engine is not None:
        for unit in engine.units:  # the weights the forward uses come first: masters may view them
            tally.add("gathered" if engine.stage == 3 else "params", unit.full, unit)
        for unit in engine.units:
            extra_copy = unit.master.dtype != unit.full.dtype  # fp32 master beside bf16 weights
            tally.add("optimizer" if extra_copy else "params", unit.master, unit)
        for unit in engine.units:
            tally.add("grads", unit.master.grad, unit)
            for p in unit.params:
                tally.add("grads", p.grad, unit)
        for unit, pending, buf in getattr(engine, "_pending", ()):  # reductions still in flight
            tally.add("grads", buf, unit)
            for t in getattr(pending, "_keep_alive", ()):
                tally.add("grads", t, unit)
    else:
        for p in model.parameters():
            if p.requires_grad:
                tally.add("params", p)
                tally.add("grads", p.grad)
    if optimizer is not None:
        owner = {id(u.master): u for u in engine.units} if engine is not None else {}
        for p, state in _inner(optimizer).state.items():
            for v in state.values():
                if torch.is_tensor(v):
                    tally.add("optimizer", v, owner.get(id(p)) if v.numel() > 1 else None)
    if include_constant:
        for p in model.parameters():
            if not p.requires_grad:
                tally.add("frozen", p)
        for b in model.buffers():
            tally.add("buffers", b)
    return tally


def memory_report(model: nn.Module, optimizer=None) -> MemoryReport:
    """Bytes this rank holds now for ``model`` (and ``optimizer``'s state), by category.

    Works on a model returned by ``shardlab.parallelize`` (any stage) and on a plain model
    with a plain optimizer. ``total`` is the sum of the categories; ``padding`` is the part of
    ``total`` that is flat-buffer padding. Activations are not here: see :func:`saved_activations`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memory_report expects an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(_inner(optimizer), torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch optimizer, got {type(optimizer).__name__}")
    tally = _tally(model, optimizer)
    return MemoryReport(**tally.bytes, total=sum(tally.bytes.values()), padding=tally.padding)


# -- activations ------------------------------------------------------------------------------
class _Saved:
    """What autograd stores instead of the tensor; its death means the graph let go of it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner._release(self.key)


class SavedActivations:
    """Live bytes saved for backward (unique storages, parameters and buffers excluded)."""

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.bytes = 0  # saved now
        self.peak = 0  # most saved at once
        self.tensors = 0  # saved tensors seen (views of one storage count once in bytes)
        self._live: dict = {}  # storage key -> [references, nbytes]

    def _excluded(self) -> set:
        if self.model is None:
            return set()
        tensors = [*self.model.parameters(), *self.model.buffers()]
        engine = _engine(self.model)
        tensors += [u.full for u in engine.units] if engine is not None else []
        return {(str(t.device), t.untyped_storage().data_ptr()) for t in tensors}

    def _pack(self, t):
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if isinstance(t, nn.Parameter) or storage.nbytes() == 0 or key in self._excluded():
            return t
        self.tensors += 1
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.bytes += entry[1]
            self.peak = max(self.peak, self.bytes)
        entry[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self._live[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


@contextmanager
def saved_activations(model: nn.Module | None = None):
    """Count the bytes autograd saves for backward during the ``with`` block.

    ::

        with shardlab.saved_activations(model) as act:
            loss = loss_fn(model(x), y)
        act.bytes      # saved for backward right now (falls to 0 once backward frees the graph)
        act.peak       # the most at any moment

    Pass ``model`` so its parameters (and stage-3 gathered buffers) are not counted as
    activations. Under non-reentrant checkpointing only each checkpointed region's inputs are
    saved; backward then recomputes one region at a time (about one block more, not seen here).
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"saved_activations expects an nn.Module or None, got {type(model).__name__}")
    act = SavedActivations(model)
    with act.hooks():
        yield act


def checkpoint_units(model: nn.Module, modules=None) -> nn.Module:
    """Wrap each unit's forward in activation checkpointing (``use_reentrant=False``), in place.

    ``modules`` defaults to the children of every ``nn.ModuleList`` (the transformer blocks,
    the same units ``parallelize`` picks). Hooks stay outside the checkpoint, so stage 3
    gathers the unit before backward recomputes it.
    """
    if modules is None:
        modules = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    if not modules:
        raise ValueError("no modules to checkpoint: pass modules=[...] (e.g. model.blocks)")
    for m in modules:
        inner = m.forward
        m.forward = lambda *a, _f=inner, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    return model


# -- over a step ------------------------------------------------------------------------------
class MemoryTrack:
    """Samples of this rank's memory at engine events; ``peak`` is the sample with most bytes.

    ``samples`` is in the format ``shardlab.plots.memory_over_time`` draws: dicts with ``rank``,
    ``time`` (seconds since the ``with`` began), ``event``, ``unit``, ``phase`` and ``bytes``
    (params, grads, optimizer, gathered, activations, frozen, buffers) plus ``total``.
    """

    def __init__(self, model, optimizer, rank: int):
        self.model, self.optimizer, self.rank = model, optimizer, rank
        self.samples: list[dict] = []
        self.activations = SavedActivations(model)
        self.cuda = any(p.is_cuda for p in model.parameters())
        self.cuda_peak: int | None = None  # torch.cuda.max_memory_allocated() over the block
        const = _tally(model, None)
        self._constant = {"frozen": const.bytes["frozen"], "buffers": const.bytes["buffers"]}
        self.t0 = time.perf_counter()

    def sample(self, event: str = "sample", fields: dict | None = None) -> dict:
        """Tally now (the engine's tensors plus saved activations) and append a sample."""
        fields = fields or {}
        tally = _tally(self.model, self.optimizer, include_constant=False)
        parts = {**tally.bytes, **self._constant, "activations": self.activations.bytes}
        s = {"rank": self.rank, "time": fields.get("time", time.perf_counter()) - self.t0,
             "event": event, "unit": fields.get("unit"), "phase": fields.get("phase", events.phase),
             "bytes": parts, "total": sum(parts.values())}
        if self.cuda:
            s["cuda_allocated"] = torch.cuda.memory_allocated()
        self.samples.append(s)
        return s

    @property
    def peak(self) -> dict:
        """The sample with the largest ``total`` (its ``bytes`` say what made the peak)."""
        if not self.samples:
            raise ValueError("no samples yet: run a step inside track_memory()")
        return max(self.samples, key=lambda s: s["total"])

    def peak_of(self, category: str) -> int:
        """The most bytes one category reached at a sample (category peaks need not coincide).

        ``"activations"`` is exact (tracked at every saved tensor), not only at samples.
        """
        if category == "activations":
            return self.activations.peak
        return max(s["bytes"][category] for s in self.samples)

    def gather(self) -> list[dict]:
        """Every rank's samples, on every rank (a collective: call it on all ranks)."""
        from shardlab.timeline import gather_lists

        return gather_lists(self.samples)


_SAMPLED = {"forward", "forward_done", "backward", "backward_done", "free", "comm", "comm_done",
            "step_start", "step_end"}


def _live_engine_model():
    """The one parallelized model alive in this process (for ``track_memory()`` with no model)."""
    from shardlab.engine import Engine, StageOptimizer

    objects = gc.get_objects()
    engines = [o for o in objects if issubclass(type(o), Engine)]  # type(): no __class__ lookups
    if len(engines) != 1:
        raise ValueError(f"found {len(engines)} parallelized models; pass one: track_memory(model, optimizer)")
    optimizers = [o for o in objects if issubclass(type(o), StageOptimizer) and o.engine is engines[0]]
    return engines[0].model, optimizers[0] if len(optimizers) == 1 else None


@contextmanager
def track_memory(model: nn.Module | None = None, optimizer=None):
    """Record this rank's memory at every engine event inside the block, and its peak.

    ::

        with shardlab.track_memory(model, optimizer) as mem:
            loss_fn(model(x), y).backward(); optimizer.step()
        mem.peak["bytes"], mem.samples      # plots.memory_over_time(mem.samples)

    Samples are taken when the engine emits an event (gather, forward, free, reduce-scatter,
    backward done, step), so a plain model gives only the first and last samples. With no
    ``model``, the single parallelized model alive in the process is used. On CUDA each sample
    also records ``torch.cuda.memory_allocated()`` and ``mem.cuda_peak`` the allocator's peak,
    to cross-check the tally (the allocator also sees workspaces and fragmentation).
    """
    if model is None:
        model, optimizer = _live_engine_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"track_memory expects an nn.Module, got {type(model).__name__}")
    rank = _engine(model).rank if _engine(model) is not None else 0
    mem = MemoryTrack(model, optimizer, rank)
    if mem.cuda:
        torch.cuda.reset_peak_memory_stats()

    def on_event(name, fields):
        if name in _SAMPLED:
            mem.sample(name, fields)

    # the root's forward hooks add samples where activations peak, at every stage
    def hook(name):  # a hook that returns None, so it changes neither inputs nor output
        return lambda *_: mem.sample(name) and None

    hooks = [model.register_forward_pre_hook(hook("model_forward")),
             model.register_forward_hook(hook("model_forward_done"))]
    mem.sample("start")
    try:
        with mem.activations.hooks(), events.listen(on_event):
            yield mem
    finally:
        for h in hooks:
            h.remove()
    mem.sample("end")
    if mem.cuda:
        mem.cuda_peak = torch.cuda.max_memory_allocated()
