"""The optimizers ShardLab builds step one piece per parameter, so each parameter keeps its own state.

A unit's master is one flat shard, but the torch optimizer inside is not given that shard: it
is given each parameter's *piece* of it (``FlatUnit.pieces``, a 1-D view, possibly empty),
wrapped as an ``nn.Parameter`` that shares the master's memory::

    master shard (rank 1):   [ ..w1 | b1 | w2.. ]        what the stage keeps, gathers, all-gathers
    pieces:                  [ ..w1 ] [ b1 ] [ w2.. ]    what the optimizer steps, in place

Stepping a piece writes into the master, so nothing is copied. And the optimizer keeps exactly
what ``torch.optim.AdamW(model.parameters())`` keeps: state per parameter (FSDP1's
``use_orig_params`` layout), Adam's step count and bias correction included.

The optimizer's side of the rule for parameters that got no gradient (``missing_grads.py``)
lives here. Before each step every piece's ``grad`` is pointed at its piece of the master's
gradient (a view, no copy), or set to None when no rank gave that parameter a gradient
(``unit.unused``, read from the sign of zero after backward). A torch optimizer skips a
parameter whose ``grad`` is None, so it does not move and its state (moments, step count)
waits unchanged, as in one process. After the step the pieces let go of the gradient again,
so ``zero_grad`` frees it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlab.engine.flat import FlatUnit


class PerParamOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` over the pieces of ``units``' masters; ``param_groups`` and ``state``
    are its own, so LR schedulers and ``state_dict()`` work as on any torch optimizer."""

    def __init__(self, units: list[FlatUnit], optimizer_cls, **kwargs):
        self.units = units
        #: per unit, one Parameter per model parameter (empty where this rank holds none of it)
        self.pieces = [[nn.Parameter(v) for v in unit.pieces(unit.master.detach())] for unit in units]
        params = [p for pieces in self.pieces for p in pieces]
        self.inner = optimizer_cls(params, **kwargs)
        super().__init__(params, self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("step(closure) is not supported: compute the loss, call backward(), then step()")
        self._show_grads()
        try:
            self.inner.step()
        finally:
            for pieces in self.pieces:
                for piece in pieces:
                    piece.grad = None

    def _show_grads(self) -> None:
        """Each piece's ``grad``: its piece of the master's gradient, or None (not stepped)."""
        for unit, pieces in zip(self.units, self.pieces):
            grad = unit.master.grad
            parts = unit.pieces(grad) if grad is not None else [None] * len(pieces)
            unused = set(unit.unused) if grad is not None else ()
            for i, (piece, g) in enumerate(zip(pieces, parts)):
                piece.grad = g if g is not None and g.numel() and i not in unused else None

    def piece_state(self) -> list[list[dict]]:
        """Per unit, per parameter: the optimizer state of its piece ({} if never stepped)."""
        return [[self.inner.state.get(p, {}) for p in pieces] for pieces in self.pieces]

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
