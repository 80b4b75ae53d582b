"""Stage 0, plain data parallelism (DDP): every rank holds everything, gradients are all-reduced.

Every rank keeps the full weights, the full gradients and the full optimizer state: that is
the redundancy ZeRO removes. As soon as a unit's gradients are ready its all-reduce starts, so
communication overlaps the backward of the units before it (DDP calls a unit a bucket).
"""

from __future__ import annotations

import torch

from shardlab.engine import comm
from shardlab.engine.base import Engine
from shardlab.engine.flat import FlatUnit


class DataParallel(Engine):
    stage = 0

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        """The optimizer steps the whole flat buffer (the parameters themselves in fp32)."""
        return unit.full

    def reduce_grads(self, unit: FlatUnit) -> None:
        """Sum every rank's gradients with one all-reduce per unit (divided when it lands)."""
        grad = unit.pack_grads(self.reduce_dtype)
        unit.set_param_grads(None)  # packed: the per-parameter copies can go (views come back below)
        self._pending.append((unit, comm.all_reduce(grad, unit=unit.name, async_op=True), grad))

    def finish_grads(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        grad.div_(self.world_size)  # SUM / N: gloo's ReduceOp.AVG cannot be trusted
        unit.set_param_grads(grad)  # p.grad shows the averaged gradient, as with DDP (if same dtype)
        self.accumulate(unit, grad)

    def after_step(self, unit: FlatUnit) -> None:
        """Mixed precision: copy the fp32 master into the bf16 parameters. Else nothing to do."""
        if self.mixed:
            unit.full.copy_(unit.master)
