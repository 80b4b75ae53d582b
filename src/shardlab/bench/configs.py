"""What ``python -m shardlab bench`` compares: nine ways to train one model, and how to count them.

Each configuration turns a freshly built model into ``(model, optimizer)``. ShardLab's stages
go through :func:`shardlab.parallelize`; PyTorch's references are built the way their docs
show (DDP; DDP + ``ZeroRedundancyOptimizer``; ``fully_shard`` on every block, then the root).
All use AdamW with the same hyper-parameters, so on the same data they must reach the same
loss: that agreement is the benchmark's proof that every row did the same work.

Communication is counted per step and per rank, in elements of the buffers handed to each
collective (a reduce-scatter counts its full input, an all-gather its full output):

* ShardLab's engine books every collective in :func:`shardlab.count_comm`'s ledger;
* PyTorch's FSDP2 and ``ZeroRedundancyOptimizer`` call ``torch.distributed`` from Python, so
  wrapping those functions for one step sees their traffic;
* DDP's reducer all-reduces from C++, out of Python's sight, so its traffic is the known
  algorithm: one all-reduce of every trainable gradient per step.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import models
from shardlab.engine.api import parallelize
from shardlab.engine.comm import barrier
from shardlab.instruments.memory import memory_report
from shardlab.instruments.traffic import KINDS, count_comm, volume

OPTIMIZER = torch.optim.AdamW
OPTIMIZER_KW = dict(lr=1e-3, weight_decay=0.1)


@dataclass(frozen=True)
class Config:
    """One row of the benchmark: a name, what it is, and how to build it."""

    name: str
    family: str  # "shardlab" or "torch"
    stage: int  # the ZeRO stage it implements, for the memory formula
    build_kw: dict = field(default_factory=dict)
    note: str = ""


CONFIGS = [
    Config("shardlab-0", "shardlab", 0, dict(stage=0), "ShardLab stage 0 (DDP)"),
    Config("shardlab-1", "shardlab", 1, dict(stage=1), "ShardLab ZeRO-1"),
    Config("shardlab-2", "shardlab", 2, dict(stage=2), "ShardLab ZeRO-2"),
    Config("shardlab-3", "shardlab", 3, dict(stage=3), "ShardLab ZeRO-3 / FSDP, prefetch"),
    Config("shardlab-3-noprefetch", "shardlab", 3, dict(stage=3, prefetch=False), "ZeRO-3, prefetch off"),
    Config("shardlab-3-keep", "shardlab", 3, dict(stage=3, reshard_after_forward=False),
           "ZeRO-3, reshard_after_forward=False"),
    Config("torch-ddp", "torch", 0, dict(kind="ddp"), "DistributedDataParallel"),
    Config("torch-ddp-zero", "torch", 1, dict(kind="zero"), "DDP + ZeroRedundancyOptimizer"),
    Config("torch-fsdp", "torch", 3, dict(kind="fsdp", reshard=True), "fully_shard per block + root"),
    Config("torch-fsdp-keep", "torch", 3, dict(kind="fsdp", reshard=False),
           "fully_shard, reshard_after_forward=False"),
]
BY_NAME = {c.name: c for c in CONFIGS}
DDP, FSDP = "torch-ddp", "torch-fsdp"  # the two baselines every row is divided by


def build(config: Config, model: nn.Module, device: torch.device):
    """Make ``model`` (fresh, already on ``device``) data-parallel as ``config`` says."""
    kw = dict(config.build_kw)
    if config.family == "shardlab":
        return parallelize(model, optimizer_cls=OPTIMIZER, **kw, **OPTIMIZER_KW)
    kind = kw.pop("kind")
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=kw["reshard"])
        fully_shard(model, reshard_after_forward=kw["reshard"])
        return model, OPTIMIZER(model.parameters(), **OPTIMIZER_KW)
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    if kind == "ddp":
        return ddp, OPTIMIZER(ddp.parameters(), **OPTIMIZER_KW)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=OPTIMIZER, **OPTIMIZER_KW)


def train_step(model, optimizer, x, y) -> torch.Tensor:
    """One plain PyTorch step; ``zero_grad`` is left to the caller (memory is read before it)."""
    loss = models.lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


# -- communication ------------------------------------------------------------------------
_WRAPPED = {  # torch.distributed function -> (kind, position and name of the full buffer)
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
}


@contextmanager
def count_config_traffic(config: Config, model: nn.Module):
    """Count, for the steps run inside, the elements each collective kind moves on this rank.

    Yields a Counter ``{kind: elements}``; bytes are kept under ``"<kind>_bytes"``.
    """
    counts: Counter = Counter()

    def add(kind, numel, element_size):
        counts[kind] += numel
        counts[f"{kind}_bytes"] += numel * element_size

    if config.family == "shardlab":  # the engine's own ledger (shardlab.instruments.traffic)
        with count_comm(wire=False) as ledger:
            yield counts
        for rec in ledger.records:
            add(rec["kind"], rec["numel"], rec["dtype"].itemsize)
        return
    originals = {}

    def wrap(fname, kind, pos, arg):
        fn = originals[fname] = getattr(dist, fname)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            t = args[pos] if len(args) > pos else kwargs.get(arg)
            if torch.is_tensor(t):
                add(kind, t.numel(), t.element_size())
            return fn(*args, **kwargs)
        setattr(dist, fname, counted)

    for fname, (kind, pos, arg) in _WRAPPED.items():
        if hasattr(dist, fname):
            wrap(fname, kind, pos, arg)
    try:
        yield counts
    finally:
        for fname, fn in originals.items():
            setattr(dist, fname, fn)
    if config.build_kw.get("kind") in ("ddp", "zero"):  # the C++ reducer: one all-reduce of all grads
        grads = [p for p in model.parameters() if p.requires_grad]
        add("all_reduce", sum(p.numel() for p in grads), grads[0].element_size())


def paper_volume(counts: Counter, steps: int = 1) -> float:
    """Elements per step as the ZeRO paper counts them: an all-reduce is RS + AG, so it counts 2."""
    return sum(volume(kind, counts.get(kind, 0)) for kind in KINDS) / steps


# -- memory -------------------------------------------------------------------------------
def model_states_formula(config: Config, params: int, world_size: int) -> float:
    """The ZeRO paper's model-state bytes for this stage, all in fp32 (4 + 4 + 8 bytes/param)."""
    from shardlab.instruments.memory_math import RECIPES, model_state_bytes
    from shardlab.instruments.stages import stage

    return model_state_bytes(params, world_size, RECIPES["fp32-adam"])[stage(config.stage).name]


def measure(config: Config, make_model, x, y, device: torch.device) -> dict:
    """Build ``config`` afresh, run two steps, and measure the second one on this rank.

    Returns ``states`` (bytes held right after ``optimizer.step()``: weights, gradients,
    optimizer state and the engine's own buffers, the paper's "model states"), ``peak`` (the
    most bytes live during the step: activations, gathered units and temporaries on top) and
    ``comm`` (what the step's collectives moved).

    On CUDA both come from the allocator. On CPU there is no allocator counter, so ``states``
    is a tally of the storages the configuration holds (:func:`held_bytes`) and ``peak`` adds
    to the tally at the step's start the largest rise of the profiler's allocation events
    (``profile_memory=True``) inside the step.
    """
    import gc

    gc.collect()
    model, optimizer = build(config, make_model(), device)
    train_step(model, optimizer, x, y)
    optimizer.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device) - held_bytes(config, model, optimizer)
        torch.cuda.reset_peak_memory_stats(device)
        with count_config_traffic(config, model) as comm:
            train_step(model, optimizer, x, y)
        torch.cuda.synchronize(device)
        states = torch.cuda.memory_allocated(device) - base
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        from torch.profiler import ProfilerActivity, profile, record_function

        # Kineto prints "USDT: ... profiler_start/stop" to stderr at every profile, under a log
        # level above ERROR; only level 6 (its count of levels) keeps the benchmark's output clean.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        barrier()  # lets the last step's collectives release their buffers
        start = held_bytes(config, model, optimizer)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with count_config_traffic(config, model) as comm, record_function("bench:step"):
                train_step(model, optimizer, x, y)
        states = held_bytes(config, model, optimizer)
        peak = start + _largest_rise(prof.profiler.kineto_results.events())
    del model, optimizer
    gc.collect()
    return dict(states=int(states), peak=int(max(peak, states)), comm=dict(comm))


def _local(t):
    """A DTensor's shard on this rank (fully_shard's parameters and gradients), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(config: Config, model: nn.Module, optimizer) -> int:
    """Bytes of every storage the model and optimizer hold on this rank, each counted once.

    ShardLab models are counted by :func:`shardlab.memory_report` (its flat buffers, masters
    and gradient shards). For PyTorch's: parameters and gradients (the local shard under
    ``fully_shard``), optimizer state, buffers, and DDP's gradient buckets, which live in C++
    and are counted from DDP's own logging data.
    """
    if config.family == "shardlab":
        return int(memory_report(model, optimizer)["total"])
    seen, total = set(), 0
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
               *(v for st in inner.state.values() for v in st.values())]
    for t in tensors:
        if torch.is_tensor(t):
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    if hasattr(model, "_get_ddp_logging_data"):
        info = model._get_ddp_logging_data()
        if not info.get("gradient_as_bucket_view"):
            total += sum(int(b) for b in str(info.get("bucket_sizes", "")).split(",") if b.strip())
    return total


def _largest_rise(kineto_events) -> int:
    """The most the live bytes rose above their level at the start of ``bench:step``."""
    step = next(e for e in kineto_events if e.name() == "bench:step")
    allocs = sorted((e.start_ns(), e.nbytes()) for e in kineto_events
                    if e.name() == "[memory]" and step.start_ns() <= e.start_ns() <= step.end_ns())
    live = rise = 0
    for _, nbytes in allocs:
        live += nbytes
        rise = max(rise, live)
    return rise
