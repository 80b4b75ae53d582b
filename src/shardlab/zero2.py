"""ZeRO-2: ZeRO-1, but gradients are reduce-scattered, so each rank keeps only its shard.

The delta from ``zero1.py``: a reduce-scatter replaces the all-reduce. It moves half the data
(an all-reduce is a reduce-scatter followed by an all-gather) and leaves each rank exactly the
summed gradient of the shard it optimizes. The unit's full gradient is freed at once.
"""

from __future__ import annotations

import torch

from shardlab import comm
from shardlab.flat import FlatUnit
from shardlab.zero1 import ZeRO1


class ZeRO2(ZeRO1):
    stage = 2

    def reduce_grads(self, unit: FlatUnit) -> None:
        grad = unit.pack_grads(self.reduce_dtype)
        unit.set_param_grads(None)  # free the full per-parameter gradients now
        shard = torch.empty(unit.shard_numel, dtype=grad.dtype, device=grad.device)
        self._pending.append((unit, comm.reduce_scatter(shard, grad, unit=unit.name, async_op=True), shard))

    def finish_grads(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        shard.div_(self.world_size)
        self.accumulate(unit, shard)
