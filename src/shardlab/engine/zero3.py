"""ZeRO-3 / FSDP: ZeRO-2, but the weights are sharded too and borrowed one unit at a time.

The delta from ``zero2.py``: at rest a rank holds only its shard of every unit. Around each
unit's forward and backward it borrows the rest and gives it back::

    forward:   gather(unit) -> run -> free(unit)            (the root unit stays gathered)
    backward:  gather(unit) -> run -> reduce_scatter(grads) -> free(unit)

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

Gathers are collectives too, and which units a rank runs can depend on its data (an expert no
token chose). So every rank walks the units in one fixed order, forward (registration order)
and backward (its reverse, a nested unit after the one around it): on reaching a unit it first
does, for each unit it skipped, what the ranks that ran it do (gather, free; in backward the
skipped unit's reduction starts with ``-0.0``). The price of that rule, as in FSDP: a unit that
runs twice in one forward (weights reused) must do so on every rank.

Loops people write all train like one process (``tests/test_loop_shapes.py``): a backward per
micro-batch with or without ``no_sync``, a validation forward in between, checkpointing, and
several forwards before one backward (two inputs, one summed loss). That last shape is *held*
(:attr:`FSDP.holding`): from its second forward every unit stays gathered, and the reductions
wait for the end of backward.
"""

from __future__ import annotations

import torch

from shardlab.engine import events
from shardlab.engine.base import TrainingState, on_output_grad
from shardlab.engine.flat import FlatUnit, Reduction
from shardlab.engine.missing_grads import walked_past
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
        for unit in self.others:  # the last unit nested inside each (units are in registration order)
            inside = {id(m) for m in unit.module.modules()}
            unit.last_index = max(u.index for u in self.others if id(u.module) in inside)
        root = [self.root] if self.root else []
        # forward: registration order; backward: the reverse of the order in which units finish
        # their forward (a nested unit after its parent)
        self.order = {TrainingState.FORWARD: root + self.others,
                      TrainingState.BACKWARD: root + sorted(self.others, key=lambda u: (u.last_index, -u.index), reverse=True)}
        self._position = {phase: {u: i for i, u in enumerate(order)} for phase, order in self.order.items()}
        self._next = 0  # how far this phase's walk has come
        #: forwards with autograd on since the first forward after the last backward: the
        #: graph the next backward walks (a retained graph is walked again with the same count)
        self._window_forwards, self._window_closed = 0, False
        for unit in self.units:
            unit.shard_views = unit.pieces(unit.master.detach())
            unit.free()  # at rest: the master shard only

    def shard(self, unit: FlatUnit) -> torch.Tensor:
        """A shard with its own memory: the full buffer it came from is about to be freed."""
        return unit.my_shard(unit.full).clone()

    def reduce_grads(self, unit: FlatUnit) -> Reduction:
        reduction = super().reduce_grads(unit)  # packed: the gathered weights can go
        unit.free()
        return reduction

    def after_step(self, unit: FlatUnit) -> None:
        """Nothing to gather: the next forward borrows the fresh shards when it needs them."""

    # -- the walk: every rank gathers the same units in the same order ----------------------
    def _walk_to(self, phase: TrainingState, unit: FlatUnit, skipped) -> None:
        """Gather ``unit``, first catching up on the units before it that this rank skipped."""
        order, position = self.order[phase], self._position[phase][unit]
        if position < self._next:  # passed already: a unit run twice (every rank must do so)
            unit.gather()
            return
        for other in order[self._next : position]:
            self._enter(phase, other)
            skipped(other)
        self._enter(phase, unit)

    def _enter(self, phase: TrainingState, unit: FlatUnit) -> None:
        order = self.order[phase]
        self._next = self._position[phase][unit] + 1
        if phase is TrainingState.BACKWARD:  # the units after this one's subtree are done: reduce them now
            self.issue_reductions(force=lambda u: walked_past(u, entering=unit, root=self.root))
        unit.gather()  # waits here if a prefetch already started it
        if self.prefetch:
            self.prefetch_next(order, unit)

    def prefetch_next(self, order: list[FlatUnit], unit: FlatUnit) -> None:
        """Start the all-gather of the unit after ``unit`` in ``order``, without waiting."""
        nxt = order.index(unit) + 1
        if nxt < len(order):
            order[nxt].gather(async_op=True)

    @property
    def holding(self) -> bool:
        """Several forwards before one backward (two inputs, one summed loss): keep every unit
        gathered from the second forward until backward ends, and reduce when backward ends.

        Why: the backward walk assumes one forward per backward. With two, a unit's gradients
        arrive only after the backward of its *first* use, which the walk cannot place; and a
        rank that skipped a unit in one forward would gather it at a different point than the
        others. Holding needs no gathers in backward and issues every reduction in the fixed
        order at its end, so all ranks still issue the same collectives. The price: the
        weight memory of ``reshard_after_forward=False`` and no overlap, for this shape only.
        """
        return self._window_forwards > 0 and not self._window_closed

    @property
    def held_backward(self) -> bool:
        """This backward walks a graph of several forwards: reduce when it ends (see ``holding``)."""
        return self._window_forwards > 1

    def _free_after_forward(self, unit: FlatUnit) -> None:
        if self.holding:
            return  # an earlier forward's backward may still need it (see ``holding``)
        if not torch.is_grad_enabled() or (self.reshard_after_forward and unit is not self.root):
            unit.free()  # (no grad: no backward will come, give everything back)

    # -- forward ----------------------------------------------------------------------------
    def count_accumulators(self, unit: FlatUnit) -> None:
        """Mixed precision: note each param's gradient accumulator in this use of the unit.

        Why: a param's dtype flips between bf16 (gathered) and its fp32 piece (at rest), and
        torch drops a param's accumulator when its dtype changes. A unit freed between two uses
        in one graph (called twice, or two forwards) so has two accumulators, and each calls
        the post-accumulate hook: the countdown must expect both, or it reduces too early.
        """
        for p, seen in zip(unit.params, unit.accumulators):
            node = p.view_as(p).grad_fn.next_functions[0][0]  # its AccumulateGrad, as FSDP1 finds it
            if id(node) not in seen:
                unit.grads_to_come += 1 if seen else 0
                seen[id(node)] = node  # (held: the id stays unique while the graph lives)

    def forward_start(self) -> None:
        """Count this forward's unit calls afresh; after a backward, a new graph begins."""
        for unit in self.units:
            unit.forward_calls = 0
        if self._window_closed and torch.is_grad_enabled():  # forget the last graph's accumulators
            self._window_forwards, self._window_closed = 0, False
            for unit in self.units:
                unit.accumulators = [{} for _ in unit.params]
                unit.grads_to_come = len(unit.params)

    def pre_forward(self, unit: FlatUnit) -> None:
        if self.state is TrainingState.FORWARD:
            unit.forward_calls += 1
            self._walk_to(TrainingState.FORWARD, unit, skipped=self._free_after_forward)
        else:  # a checkpoint's recompute in backward, or a unit called on its own
            unit.gather()
        events.emit("forward", unit=unit.name)

    def post_forward(self, unit: FlatUnit, output) -> None:
        events.emit("forward_done", unit=unit.name)
        if self.mixed and torch.is_grad_enabled() and self.state is TrainingState.FORWARD:
            self.count_accumulators(unit)
        if self.state is not TrainingState.BACKWARD:  # (in backward: a recompute, keep it)
            self._free_after_forward(unit)
        if torch.is_grad_enabled():
            on_output_grad(output, lambda: self.pre_backward(unit))

    def forward_done(self) -> None:
        """Catch up on the units nobody here ran; the backward walk starts from the top."""
        for unit in self.order[TrainingState.FORWARD][self._next :]:
            self._enter(TrainingState.FORWARD, unit)
            self._free_after_forward(unit)
        self._next = 0
        if torch.is_grad_enabled():
            self._window_forwards += 1

    # -- backward ---------------------------------------------------------------------------
    def pre_backward(self, unit: FlatUnit) -> None:
        """The gradient of the unit's output has arrived: its backward is next, gather it."""
        events.set_phase("backward")
        if self.held_backward:  # every unit is gathered already (a retained graph's second
            unit.gather()        # backward: in autograd's order, the same on every rank)
        else:
            self._walk_to(TrainingState.BACKWARD, unit, skipped=FlatUnit.free)
        events.emit("backward", unit=unit.name)

    def post_backward(self, unit: FlatUnit) -> None:
        if not self.held_backward:  # (held: reduce when backward ends)
            super().post_backward(unit)  # reduce-scatter the gradients (async)
        unit.free()

    def backward_done(self) -> None:
        if not self.held_backward:
            for unit in self.order[TrainingState.BACKWARD][self._next :]:  # units nobody here ran
                self._enter(TrainingState.BACKWARD, unit)
                unit.free()
        self._next = 0
        self._window_closed = True
        for unit in self.units:  # e.g. a prefetched unit that was not used after all
            unit.free()
