"""ZeRO-1: stage 0, but each rank keeps optimizer state for its shard only.

The deltas from ``ddp.py``:

* the optimizer steps one shard per unit instead of the whole flat buffer, so the fp32
  master weights and Adam's two moments (12 of the 16 bytes a parameter costs in mixed
  precision) shrink by N;
* a rank only needs the summed gradient of its own shard, so a reduce-scatter replaces the
  all-reduce (an all-reduce *is* a reduce-scatter followed by an all-gather: half the traffic);
* after the step each rank holds fresh weights for its shard only, so the shards are
  all-gathered back into the full buffer. Per step: Ψ reduce-scattered + Ψ gathered = 2Ψ.

ZeRO-1 still lets backward produce every full gradient and reduces them all when backward ends
(``reduce_as_ready = False``), so gradient memory is not saved: that is ZeRO-2's delta.
"""

from __future__ import annotations

import torch

from shardlab.engine import comm
from shardlab.engine.ddp import DataParallel
from shardlab.engine.flat import FlatUnit, Reduction


class ZeRO1(DataParallel):
    stage = 1
    shards_optimizer_state = True
    reduce_as_ready = False

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        """Only this rank's shard is optimized (a view in fp32, a copy when params are bf16)."""
        shard = unit.my_shard(unit.full)
        return shard.clone() if self.mixed else shard

    def reduce_grads(self, unit: FlatUnit) -> Reduction:
        """Sum the unit's gradients over ranks, keeping only this rank's shard of the sum."""
        grad = unit.pack_grads(self.reduce_dtype)
        unit.set_param_grads(None)  # the full per-parameter gradients are no longer needed
        return unit.reduce_scatter(grad)

    def after_step(self, unit: FlatUnit) -> None:
        """Each rank updated its shard; all-gather the shards so every rank has all weights."""
        comm.all_gather(unit.full, unit.master.detach().to(unit.full.dtype), unit=unit.name, owner=unit)
