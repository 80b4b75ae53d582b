"""Rank functions that train the same model with PyTorch's own data-parallel tools.

ShardLab must give the same numbers as DDP (stage 0), DDP + ZeroRedundancyOptimizer
(stage 1) and ``fully_shard`` per block (stage 3), so these run side by side with it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import OPTIMIZERS, loss_of, make_batch, make_model, train

import shardlab


def train_torch(system: str, kind="gpt", optimizer="adamw", steps=3, seed=0, reshard_after_forward=True):
    """Train with one of PyTorch's systems; return the full state dict (like full_state_dict)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(kind, seed)
    cls, kw = OPTIMIZERS[optimizer]
    if system == "fully_shard":
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        opt = cls(model.parameters(), **kw)
    else:
        model = DDP(model)
        if system == "ddp":
            opt = cls(model.parameters(), **kw)
        elif system == "ddp+zero":
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kw)
        elif system == "ddp+sharded_optimizer":
            opt = shardlab.ShardedOptimizer(model.parameters(), cls, **kw)
        else:
            raise ValueError(system)
    for step in range(steps):
        loss_of(kind, model, *make_batch(kind, step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    state = model.module.state_dict() if isinstance(model, DDP) else model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def shardlab_and_torch(pairs: list[tuple[dict, dict]]):
    """For each (shardlab config, torch config): both final full state dicts."""
    return [(train(**ours)[0], train_torch(**theirs)) for ours, theirs in pairs]
