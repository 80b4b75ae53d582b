"""Rank functions that train the same model with PyTorch's own data-parallel tools.

ShardLab must give the same numbers as DDP (stage 0), DDP + ZeroRedundancyOptimizer
(stage 1) and ``fully_shard`` per block (stage 3), so these run side by side with it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import AdamW
from workers import OPTIMIZERS, loss_of, make_batch, make_model, train

import shardlab
from shardlab.instruments.fsdp2 import dtensor_shards, record_fully_shard
from shardlab.instruments.schedule import Schedule, record_shardlab
from shardlab.models import batch, gpt, lm_loss


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


def schedules(n_layer=2):
    """One step of ShardLab stage 3 and of ``fully_shard``, each recorded at the dispatcher.

    Both train the tiny GPT from the same weights on this rank's slice of the same batch, after
    one unrecorded step (Adam's state exists). A third model is
    ``fully_shard(..., reshard_after_forward=True)`` said explicitly, which reshards the root too.
    Returns the schedules, each unit's parameter shapes, and fully_shard's DTensor shards.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def fresh():
        torch.manual_seed(0)
        return gpt("tiny", n_layer=n_layer)

    net = fresh()
    shapes = {f"blocks.{i}": [p.shape for p in b.parameters()] for i, b in enumerate(net.blocks)}
    shapes["root"] = [p.shape for n, p in net.named_parameters() if not n.startswith("blocks.")]
    ours, ours_opt = shardlab.parallelize(fresh(), stage=3, optimizer_cls=AdamW, lr=1e-3)
    theirs, explicit = fresh(), fresh()
    for block in theirs.blocks:
        fully_shard(block)
    fully_shard(theirs)                  # as notebook 04 does: the root's reshard is left to torch
    for block in explicit.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(explicit, reshard_after_forward=True)
    runs = ((ours, ours_opt, record_shardlab), (theirs, AdamW(theirs.parameters(), lr=1e-3), record_fully_shard),
            (explicit, AdamW(explicit.parameters(), lr=1e-3), record_fully_shard))
    recorded = []
    for model, opt, record in runs:
        for step in range(2):
            x, y = batch(model.cfg, 2, seed=step, rank=rank, world_size=world_size)
            opt.zero_grad()
            if step == 1:
                with record() as seen:
                    lm_loss(model(x), y).backward()
                recorded.append(Schedule.of(seen))
            else:
                lm_loss(model(x), y).backward()
            opt.step()
    return {"ours": recorded[0], "theirs": recorded[1], "explicit": recorded[2], "shapes": shapes,
            "shards": dtensor_shards(theirs)}
