"""Parameters that got no gradient: an optimizer over flat shards must not move them.

A per-parameter optimizer skips a parameter whose ``grad`` is None. Ours steps one flat master
per unit, so after backward each unit lists its unused params (``unit.unused``, found by the
sign of zero, see ``missing_grads.py``), and the optimizer holds their elements and state
aside, steps the master whole, and puts them back. Both optimizers do this: the one
``parallelize`` returns (``optim.py``) and ``ShardedOptimizer``.

One thing cannot be put back per parameter: a per-tensor step count (Adam's bias correction).
A param that skipped steps and then trains again is stepped with its unit's count, so it no
longer matches ``torch.optim.AdamW(model.parameters())``; :meth:`HeldBack.warn_if_count_is_shared`
says so, once, with the fix.
"""

from __future__ import annotations

import warnings

import torch

from shardlab.engine.flat import FlatUnit


class HeldBack:
    """Holds the unused params of each unit out of one ``inner`` optimizer's step."""

    def __init__(self, inner: torch.optim.Optimizer, names: dict[int, str] | None = None):
        self.inner = inner
        self.names = names or {}  # id(param) -> its name in the model, for the warning
        self._skipped: dict[int, set[int]] = {}  # id(unit) -> params held back at some step
        self._warned = False

    def _master_state(self, unit: FlatUnit) -> dict:
        """The optimizer state tensors shaped like the master (momentum, variance, ...)."""
        state = self.inner.state.get(unit.master, {})
        return {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == unit.master.shape}

    def hold(self, unit: FlatUnit):
        """Copies of the unused params' elements of the master and of its state, or None."""
        self.warn_if_count_is_shared(unit)
        if unit.master.grad is None or not unit.unused:
            return None
        spans = [span for i, span in enumerate(unit.ranges(unit.master)) if i in unit.unused]
        state = self._master_state(unit)
        return [(a, b, unit.master[a:b].clone(), {k: v[a:b].clone() for k, v in state.items()}) for a, b in spans]

    def put_back(self, unit: FlatUnit, kept) -> None:
        """After the step: the held elements and their state as they were."""
        if kept is None:
            return
        state = self._master_state(unit)
        for a, b, weights, old in kept:
            unit.master[a:b] = weights
            for k, v in state.items():
                v[a:b] = old[k] if k in old else 0  # state born this step: as if never stepped

    def warn_if_count_is_shared(self, unit: FlatUnit) -> None:
        """Warn (once) when a param that was held back while its unit stepped trains again and
        the optimizer keeps a per-tensor count: from now on its bias correction is its unit's,
        not its own. A param that never trains (a spare) or an optimizer without a count (SGD)
        stays exact, so neither warns."""
        if unit.master.grad is None:  # the whole unit was unused: nothing steps, nothing counts
            return
        skipped = self._skipped.setdefault(id(unit), set())
        if not skipped:  # the normal path: nothing held back yet, so nothing can come back
            skipped.update(unit.unused)
            return
        here = {i for i, (a, b) in enumerate(unit.ranges(unit.master)) if b > a}
        back = skipped & (here - set(unit.unused))
        state = self.inner.state.get(unit.master, {})
        counted = any(torch.is_tensor(v) and v.shape != unit.master.shape for v in state.values())
        if back and counted and not self._warned:
            self._warned = True
            which = ", ".join(self.names.get(id(unit.params[i]), f"param #{i}") for i in sorted(back))
            warnings.warn(
                f"{which} trained again after skipping steps (no rank gave it a gradient) while the rest "
                f"of unit {unit.name!r} stepped. {type(self.inner).__name__} keeps one step count per "
                "unit shard, so its bias correction now counts the skipped steps too, unlike "
                "torch.optim on model.parameters(). For exact per-parameter counts make such "
                "parameters their own units (the default for each Linear; drop units=...), or at "
                "stage 3 step model.parameters() with your own optimizer.", RuntimeWarning, stacklevel=4)
        skipped |= set(unit.unused)
