"""ZeRO-1: stage 0, but each rank keeps optimizer state for its shard only.

The delta from ``ddp.py``: the optimizer steps one shard per unit instead of the whole flat
buffer, so Adam's momentum and variance (8 of the 16 bytes a parameter costs in mixed
precision, plus the 4-byte fp32 master) shrink by N. After the step every rank holds fresh
weights for its shard only, so the shards are all-gathered back into the full buffer.
"""

from __future__ import annotations

import torch

from shardlab import comm
from shardlab.ddp import DataParallel
from shardlab.flat import FlatUnit


class ZeRO1(DataParallel):
    stage = 1

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        """Only this rank's shard is optimized (a view in fp32, a copy when params are bf16)."""
        shard = unit.my_shard(unit.full)
        return shard.clone() if self.mixed else shard

    def finish_grads(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        grad.div_(self.world_size)
        unit.set_param_grads(grad)  # the full gradient is still kept: ZeRO-1 does not shard it
        self.accumulate(unit, unit.my_shard(grad))

    def after_step(self, unit: FlatUnit) -> None:
        """Each rank updated its shard; all-gather the shards so every rank has all weights."""
        comm.all_gather(unit.full, unit.master.detach().to(unit.full.dtype), unit=unit.name)
