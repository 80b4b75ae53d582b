"""Stage 3 with several forwards before one backward (two inputs, one summed loss).

The backward walk (``lockstep.py``) assumes one forward per backward. With two, a unit's
gradients arrive only after the backward of its *first* use, which the walk cannot place; and a
rank that skipped a unit in one forward would gather it at a different point than the others.
So the window the next backward will walk is tracked here, and while it spans several forwards
every unit stays gathered from the second forward on, and every reduction waits for the end of
backward, where the base issues them in the fixed order: all ranks still issue the same
collectives. The price: the weight memory of ``reshard_after_forward=False`` and no overlap,
for this shape only. The window's states (``forwards``, ``closed``)::

    state                forwards  closed  keeps_units_gathered  backward_spans_forwards
    no forward yet       0         False   no                    no
    k forwards, open     k >= 1    False   yes                   when k > 1
    walked by backward   k         True    no                    when k > 1 (retain_graph)

    root forward with autograd on:  if walked, start afresh (0, False, accumulators forgotten)
    root forward ends, autograd on: forwards + 1
    root backward ends:             closed = True

A forward without autograd (validation) opens nothing and counts nothing: no backward will come.
"""

from __future__ import annotations

import torch

from shardlab.engine.flat import FlatUnit


class GraphWindow:
    """The forwards the next backward will walk: one engine's, over its ``units``."""

    def __init__(self, units: list[FlatUnit], *, mixed: bool):
        self.units = units
        self.mixed = mixed  # params in a compute dtype: see count_accumulators
        self.forwards = 0  # forwards with autograd on since the first one after the last backward
        self.closed = False  # a backward has walked them (a retained graph is walked with the same count)

    @property
    def keeps_units_gathered(self) -> bool:
        """A forward has run and no backward yet: a later forward frees nothing, since an
        earlier forward's backward may still need the unit."""
        return self.forwards > 0 and not self.closed

    @property
    def backward_spans_forwards(self) -> bool:
        """This backward walks a graph of several forwards: every unit is gathered already, and
        reductions wait for the end of backward."""
        return self.forwards > 1

    def forward_started(self) -> None:
        """A root forward begins; after a backward, with autograd on, a new graph begins."""
        if self.closed and torch.is_grad_enabled():
            self.forwards, self.closed = 0, False
            for unit in self.units:
                unit.backward_count.new_graph()

    def forward_ended(self) -> None:
        if torch.is_grad_enabled():
            self.forwards += 1

    def backward_ended(self) -> None:
        self.closed = True

    def count_accumulators(self, unit: FlatUnit) -> None:
        """Mixed precision: note each param's gradient accumulator in this use of the unit.

        A param's dtype flips between bf16 (gathered) and its fp32 piece (at rest), and torch
        drops a param's accumulator when its dtype changes. A unit freed between two uses in one
        graph (called twice, or two forwards) so has two accumulators, and each calls the
        post-accumulate hook: the countdown must expect both, or it reduces too early.
        """
        if not (self.mixed and torch.is_grad_enabled()):
            return
        for i, p in enumerate(unit.params):
            node = p.view_as(p).grad_fn.next_functions[0][0]  # its AccumulateGrad, as FSDP1 finds it
            unit.backward_count.note_accumulator(i, node)
