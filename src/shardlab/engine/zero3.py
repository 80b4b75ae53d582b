"""ZeRO-3 / FSDP: ZeRO-2, but the weights are sharded too and borrowed one unit at a time.

The delta from ``zero2.py``: at rest a rank holds only its shard of every unit. Around each
unit's forward and backward it borrows the rest and gives it back, in four hooks::

    pre_forward:    gather(unit), prefetch the next one
    post_forward:   free(unit)                             (the root unit stays gathered)
    pre_backward:   gather(unit), prefetch the next one
    post_backward:  reduce_scatter(grads), free(unit)

so the full weights of only about two units exist at any moment (the one running and the next
one, prefetched). Communication rises from 2 to 3 model-sizes a step: the weights are
all-gathered twice, and gradients are reduce-scattered once.

At rest, ``model.parameters()`` are this rank's pieces of each parameter: 1-D views into the
master shard, possibly empty (FSDP1's ``use_orig_params`` layout). We keep it because a shard
boundary cuts the flat buffer anywhere, so pieces are plain views, free; FSDP2's dim-0 shards
would need padding per parameter and a copy in and out of every all-gather (and a DTensor to
say which rows a rank holds). While a unit is gathered they are full views again.
After backward each ``p.grad`` is this rank's piece of the mean gradient (a view into the
master's gradient, in the master's dtype), so ``torch.optim.AdamW(model.parameters())`` trains
exactly like the optimizer ``parallelize`` returns, with 1/N of the state.

Two special cases have parts of their own, which the hooks call by name. ``self.walk``
(``lockstep.py``): every rank gathers the units in one fixed order, so a rank whose data skips a
unit still joins its collectives. ``self.window`` (``graph_window.py``): several forwards before
one backward keep every unit gathered and reduce when backward ends.
"""

from __future__ import annotations

import torch

from shardlab.engine import events
from shardlab.engine.base import TrainingState, on_output_grad
from shardlab.engine.flat import FlatUnit, Reduction
from shardlab.engine.graph_window import GraphWindow
from shardlab.engine.lockstep import UnitWalk
from shardlab.engine.zero2 import ZeRO2


class FSDP(ZeRO2):
    stage = 3
    shards_params = True

    def __init__(self, model, *, reshard_after_forward: bool = True, prefetch: bool = True, **kwargs):
        #: free each unit after its forward (ZeRO-3); False keeps it until backward (ZeRO-2-like memory)
        self.reshard_after_forward = reshard_after_forward
        #: start the next unit's all-gather before it is needed
        self.prefetch = prefetch
        super().__init__(model, **kwargs)
        self.walk = UnitWalk(self)
        self.window = GraphWindow(self.units, mixed=self.mixed)
        for unit in self.units:
            unit.shard_views = unit.pieces(unit.master.detach())
            unit.free()  # at rest: the master shard only

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        """A shard with its own memory: the full buffer it came from is about to be freed."""
        return unit.my_shard(unit.full).clone()

    def reduce_grads(self, unit: FlatUnit) -> Reduction:
        """ZeRO-2's reduce-scatter; the gradients are packed, so the gathered weights can go."""
        reduction = super().reduce_grads(unit)
        unit.free()
        return reduction

    def after_step(self, unit: FlatUnit) -> None:
        """Nothing to gather: the next forward borrows the fresh shards when it needs them."""

    def prefetch_next(self, order: list[FlatUnit], unit: FlatUnit) -> None:
        """Start the all-gather of the unit after ``unit`` in ``order``, without waiting."""
        nxt = order.index(unit) + 1
        if nxt < len(order):
            order[nxt].gather(async_op=True)

    def free_after_forward(self, unit: FlatUnit) -> None:
        """Give a unit back after its forward, unless it stays: the root, ``reshard_after_forward=False``."""
        if self.window.keeps_units_gathered:
            return  # an earlier forward's backward may still need it
        if not torch.is_grad_enabled() or (self.reshard_after_forward and unit is not self.root):
            unit.free()  # (no grad: no backward will come, give everything back)

    # -- the four hooks ---------------------------------------------------------------------
    def pre_forward(self, unit: FlatUnit) -> None:
        if self.state is TrainingState.FORWARD:
            self.walk.forward_to(unit)  # gather (after any units this rank skipped), prefetch
        else:  # a checkpoint's recompute in backward, or a unit called on its own
            unit.gather()
        events.emit(events.FORWARD, unit=unit.name)

    def post_forward(self, unit: FlatUnit, output) -> None:
        events.emit(events.FORWARD_DONE, unit=unit.name)
        if self.state is TrainingState.FORWARD:
            self.window.count_accumulators(unit)  # (mixed precision)
        if self.state is not TrainingState.BACKWARD:  # (in backward: a recompute, keep it)
            self.free_after_forward(unit)
        if torch.is_grad_enabled():
            on_output_grad(output, lambda: self.pre_backward(unit))

    def pre_backward(self, unit: FlatUnit) -> None:
        """The gradient of the unit's output has arrived: its backward is next, gather it."""
        self._start_backward()  # (normally started already, by the root's output)
        if self.window.backward_spans_forwards:  # every unit is gathered already
            unit.gather()
        else:
            self.walk.backward_to(unit)  # gather (after any units this rank skipped), prefetch
        events.emit(events.BACKWARD, unit=unit.name)

    def post_backward(self, unit: FlatUnit) -> None:
        if not self.window.backward_spans_forwards:  # (else: reduce when backward ends)
            super().post_backward(unit)  # reduce-scatter the gradients that are due (async)
        unit.free()  # safe before its reduction starts: p.grad keeps the full gradient until then

    # -- the root's forward and backward ----------------------------------------------------
    def root_pre_forward(self) -> None:
        self.walk.new_forward()
        self.window.forward_started()

    def root_post_forward(self) -> None:
        """Catch up on the units nobody here ran; the backward walk starts from the top."""
        self.walk.finish(TrainingState.FORWARD, then=self.free_after_forward)
        self.window.forward_ended()

    def root_post_backward(self) -> None:
        """Catch up on the units nobody here ran, then free every unit."""
        held = self.window.backward_spans_forwards  # (every unit was gathered all along)
        self.walk.finish(TrainingState.BACKWARD, then=None if held else FlatUnit.free)
        self.window.backward_ended()
        for unit in self.units:  # e.g. a prefetched unit that was not used after all
            unit.free()
