"""ZeRO-1 on its own: a drop-in optimizer that shards its state across the ranks.

Like PyTorch's ``ZeroRedundancyOptimizer``, it expects gradients that are already averaged
over ranks (for example by DDP or by ``parallelize(model, stage=0)``)::

    model = DistributedDataParallel(model)
    optimizer = shardlab.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

Unlike it, the parameters are flattened into one padded buffer and every rank owns one equal
contiguous shard (``ZeroRedundancyOptimizer`` hands out whole parameters, so its shards are
uneven). ``step()`` runs the wrapped optimizer on this rank's shard only, then all-gathers
the updated shards so every rank holds all the new weights. The wrapped optimizer steps one
piece per parameter (``per_param.py``), so each keeps its own state (Adam's step count too),
and a parameter whose ``grad`` is None (unused, on every rank under DDP) does not move, as with
``ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.engine import comm
from shardlab.engine.flat import FlatUnit
from shardlab.engine.per_param import PerParamOptimizer


class ShardedOptimizer(PerParamOptimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs a process group: call torch.distributed.init_process_group()")
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("ShardedOptimizer got no trainable parameters")
        if len({(p.device, p.dtype) for p in params}) > 1:
            raise ValueError("ShardedOptimizer needs all parameters on one device with one dtype")
        # The parameters' data becomes views into one flat buffer, so the final all-gather
        # writes every parameter at once.
        self.unit = FlatUnit("params", params, rank=dist.get_rank(), world_size=dist.get_world_size())
        self.unit.master = nn.Parameter(self.unit.my_shard(self.unit.full))
        super().__init__([self.unit], optimizer_cls, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("step(closure) is not supported")
        unit = self.unit
        grad = unit.my_shard(unit.pack_grads(unit.full.dtype))  # -0.0 where a param's grad is None
        unit.master.grad = unit.mark_unused(grad)
        super().step()
        comm.all_gather(unit.full, unit.master, unit="params", owner=unit)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.unit.master.grad = None
        self.unit.set_param_grads(None)
