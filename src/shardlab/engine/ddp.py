"""Stage 0, plain data parallelism (DDP): every rank holds everything, gradients are all-reduced.

Every rank keeps the full weights, the full gradients and the full optimizer state: that is
the redundancy ZeRO removes. As soon as a unit's gradients are ready its all-reduce starts, so
communication overlaps the backward of the units before it (PyTorch's DDP overlaps the same
way, with size-capped gradient *buckets* instead of units).

What ``base.py`` does for this file, in one backward::

    autograd accumulates p.grad      -> the post-accumulate hook (Engine._on_grad_ready)
    the unit's last gradient is in   -> post_backward(unit) -> issue_reductions():
                                        in reduce_order (reverse registration, root last),
                                        each unit whose gradients are all in: reduce_grads(unit)
    a reduction lands                -> keep_grads(reduction)   (at most 2 in flight)
    autograd is done                 -> _finalize_backward(): units this rank never ran join
                                        with -0.0 ("no gradient"), every reduction lands; the
                                        master's grad is the average (None where no rank used
                                        a param), and in fp32 each p.grad is a view of it
    optimizer.step()                 -> after_step(unit)

``no_sync()`` skips the reductions; the gradients add up locally until a backward outside it.
"""

from __future__ import annotations

import torch

from shardlab.engine import comm
from shardlab.engine.base import Engine
from shardlab.engine.flat import FlatUnit, Reduction


class DataParallel(Engine):
    stage = 0

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        """No sharding: the optimizer steps the whole flat buffer (the parameters themselves in fp32)."""
        return unit.full

    def reduce_grads(self, unit: FlatUnit) -> Reduction:
        """Sum every rank's gradients with one all-reduce per unit (divided when it lands)."""
        grad = unit.pack_grads(self.reduce_dtype)
        unit.set_param_grads(None)  # packed: the per-parameter copies can go (views come back after backward)
        return Reduction(unit, comm.all_reduce(grad, unit=unit.name, owner=unit, async_op=True), grad)

    def keep_grads(self, reduction: Reduction) -> None:
        """The landed SUM, divided by N (the course sums and divides on every backend), is the gradient."""
        self.accumulate(reduction.unit, reduction.grad)

    def after_step(self, unit: FlatUnit) -> None:
        """Mixed precision: copy the fp32 master into the bf16 parameters. Else nothing to do."""
        if self.mixed:
            unit.full.copy_(unit.master)
