"""ShardLab: ZeRO-1/2/3 and FSDP built from scratch on torch.distributed, to be read and measured.

The public names are imported lazily, so ``import shardlab`` is quick and a notebook only pays
for the parts it uses.

Engine (one plain-PyTorch API for stages 0-3)::

    model, optimizer = shardlab.parallelize(model, stage=3, optimizer_cls=torch.optim.AdamW, lr=1e-3)

Instruments (every number measured on live ranks)::

    shardlab.memory_report(model, optimizer)        with shardlab.count_comm() as comm: ...
    with shardlab.count_wire() as wire: ...         # bytes on this rank's wire, from the kernel
    with shardlab.track_memory() as mem: ...        with shardlab.trace() as tr: ...
    with shardlab.emulate_link("10GbE"): ...

Runtime (ranks inside a notebook)::

    cluster = shardlab.start_cluster(world_size=4)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # engine
    "parallelize": "shardlab.engine.api",
    "full_state_dict": "shardlab.engine.api",
    "load_full_state_dict": "shardlab.engine.api",
    "clip_grad_norm_": "shardlab.engine.api",
    "MixedPrecision": "shardlab.engine.api",
    "ShardedOptimizer": "shardlab.engine.sharded_optimizer",
    "run_ranks": "shardlab.launch",
    "RankError": "shardlab.launch",
    "checkpoint_units": "shardlab.engine.units",
    # instruments
    "memory_report": "shardlab.instruments.memory",
    "track_memory": "shardlab.instruments.memory",
    "saved_activations": "shardlab.instruments.memory",
    "count_comm": "shardlab.instruments.traffic",
    "count_wire": "shardlab.instruments.wire",
    "trace": "shardlab.instruments.timeline",
    "emulate_link": "shardlab.instruments.link",
    "LINKS": "shardlab.instruments.link",
    # runtime
    "start_cluster": "shardlab.cluster",
    "Cluster": "shardlab.cluster",
    "ClusterError": "shardlab.cluster",
    "CollectiveTimeout": "shardlab.cluster",
    "RankTimeout": "shardlab.cluster",
    "engine_of": "shardlab.engine.api",
    "save_checkpoint": "shardlab.engine.checkpoint",
    "load_checkpoint": "shardlab.engine.checkpoint",
    "CheckpointError": "shardlab.engine.checkpoint",
}

#: Modules a learner reaches from the top: ``from shardlab import comm``.
_MODULES = {
    "comm": "shardlab.engine.comm",
    "events": "shardlab.engine.events",
    "memory_math": "shardlab.instruments.memory_math",
    "course": "shardlab.course",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_MODULES))
