"""ZeRO-3 / FSDP: ZeRO-2, but the weights are sharded too and borrowed one unit at a time.

The delta from ``zero2.py``: at rest a rank holds only its shard of every unit. Around each
unit's forward and backward it borrows the rest and gives it back::

    forward:   gather(unit) -> run -> free(unit)            (the root unit stays gathered)
    backward:  gather(unit) -> run -> reduce_scatter(grads) -> free(unit)

so the full weights of only about two units exist at any moment (the one running and the next
one, prefetched). Communication rises from 2 to 3 model-sizes a step: the weights are
all-gathered twice, and gradients are reduce-scattered once.
"""

from __future__ import annotations

import torch

from shardlab.engine import events
from shardlab.engine.base import on_output_grad
from shardlab.engine.flat import FlatUnit
from shardlab.engine.zero2 import ZeRO2


class FSDP(ZeRO2):
    stage = 3

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._recording: list[FlatUnit] = []
        self._set_order(list(self.units))  # a guess for step 1; recorded from then on
        self._in_backward = False
        for unit in self.units:
            unit.free()  # at rest: the master shard only
        model.register_forward_hook(self._on_root_forward_end)

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        """A shard with its own memory: the full buffer it came from is about to be freed."""
        return unit.my_shard(unit.full).clone()

    def after_step(self, unit: FlatUnit) -> None:
        """Nothing to gather: the next forward borrows the fresh shards when it needs them."""

    # -- forward ----------------------------------------------------------------------------
    def _on_root_forward(self, module, args, kwargs):
        self._recording, self._in_backward = [], False
        return super()._on_root_forward(module, args, kwargs)

    def _on_root_forward_end(self, module, args, output):
        self._set_order(self._recording)

    def _set_order(self, forward_order: list[FlatUnit]) -> None:
        """Prefetch orders: forward as recorded; backward reversed, the root (always gathered) first."""
        self.forward_order = forward_order
        others = [u for u in reversed(forward_order) if u is not self.root]
        self.backward_order = ([self.root] if self.root else []) + others

    def pre_forward(self, unit: FlatUnit) -> None:
        if not self._in_backward:  # (in backward, this is activation checkpointing's recompute)
            self._recording.append(unit)
        unit.gather()  # waits here if a prefetch already started it
        events.emit("forward", unit=unit.name)
        if self.prefetch and not self._in_backward:
            self._prefetch(self.forward_order, unit)

    def post_forward(self, unit: FlatUnit, output) -> None:
        events.emit("forward_done", unit=unit.name)
        if not torch.is_grad_enabled():  # no backward will come: give everything back
            self._free(unit)
            return
        if self.reshard_after_forward and unit is not self.root and not self._in_backward:
            self._free(unit)  # (in backward, this forward is a checkpoint's recompute: keep it)
        on_output_grad(output, lambda: self.pre_backward(unit))

    # -- backward ---------------------------------------------------------------------------
    def pre_backward(self, unit: FlatUnit) -> None:
        """The gradient of the unit's output has arrived: its backward is next, gather it."""
        self._in_backward = True
        events.set_phase("backward")
        unit.gather()
        events.emit("backward", unit=unit.name)
        if self.prefetch:
            self._prefetch(self.backward_order, unit)

    def post_backward(self, unit: FlatUnit) -> None:
        super().post_backward(unit)  # reduce-scatter the gradients (async)
        self._free(unit)

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        for unit in self.units:  # e.g. a prefetched unit that was not used after all
            self._free(unit)

    # -- helpers ----------------------------------------------------------------------------
    def _prefetch(self, order: list[FlatUnit], unit: FlatUnit) -> None:
        """Start the all-gather of the unit after ``unit`` in ``order``, without waiting."""
        nxt = order.index(unit) + 1 if unit in order else len(order)
        if nxt < len(order):
            order[nxt].gather(async_op=True)

    def _free(self, unit: FlatUnit) -> None:
        if unit.is_gathered:
            unit.free()
            events.emit("free", unit=unit.name)
