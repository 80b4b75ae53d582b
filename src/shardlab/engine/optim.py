"""The optimizer ``parallelize`` returns, and the guard that stops one that would train nothing.

Bring your own optimizer: at stage 0 (full precision) and stage 3, ``p.grad`` holds after
backward exactly what an optimizer over ``model.parameters()`` must step (stage 3: this rank's
piece of each parameter, see ``zero3.py``), so ``torch.optim.AdamW(model.parameters())`` works.
At stages 1 and 2 the parameters are full but their averaged gradients live only in the
sharded masters, so such an optimizer would step nothing; a global step pre-hook makes its
first ``step()`` raise instead.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardlab.engine import events
from shardlab.engine.base import Engine
from shardlab.engine.flat import FlatUnit

_guarded: weakref.WeakSet = weakref.WeakSet()  # engines whose params' .grad stays None


class StageOptimizer(torch.optim.Optimizer):
    """The optimizer ``parallelize`` returns: ``optimizer_cls`` on this rank's masters.

    ``step()`` runs the wrapped optimizer on whatever the stage gave it (the whole model at
    stage 0, one shard per unit at stages 1-3), then lets the stage bring the new weights back.
    ``param_groups`` and ``state`` are the wrapped optimizer's, so LR schedulers just work.
    A master that mixes used and unused params is stepped whole, then its unused elements (and
    their optimizer state) are put back: they do not move, as with a per-parameter optimizer.
    One thing cannot be put back per parameter: a per-tensor step count (Adam's bias
    correction). A param that skipped steps and then trains again is stepped with its unit's
    count, so ``step()`` warns when that happens (:meth:`_warn_if_count_is_shared`).
    """

    def __init__(self, engine: Engine, optimizer_cls, **kwargs):
        self.engine = engine
        self.inner = optimizer_cls([u.master for u in engine.units], **kwargs)
        super().__init__([u.master for u in engine.units], self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self._skipped: dict[int, set[int]] = {}  # unit index -> params held back at some step
        self._warned = False

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("step(closure) is not supported: compute the loss, call backward(), then step()")
        events.set_phase("step")
        events.emit("step_start")
        for unit in self.engine.units:
            self._warn_if_count_is_shared(unit)
        held = [self._hold_unused(unit) for unit in self.engine.units]
        self.inner.step()
        for unit, kept in zip(self.engine.units, held):
            self._put_back(unit, kept)
        self.engine.step()
        events.emit("step_end")

    def _warn_if_count_is_shared(self, unit: FlatUnit) -> None:
        """Warn (once) when a param that was held back while its unit stepped trains again and
        the optimizer keeps a per-tensor count: from now on its bias correction is its unit's,
        not its own, so it no longer matches ``torch.optim.X(model.parameters())``. A param
        that never trains (a spare) or an optimizer without a count (SGD) stays exact."""
        if unit.master.grad is None:  # the whole unit was unused: nothing steps, nothing counts
            return
        skipped = self._skipped.setdefault(unit.index, set())
        here = {i for i, (a, b) in enumerate(unit.ranges(unit.master)) if b > a}
        back = skipped & (here - set(unit.unused))
        state = self.inner.state.get(unit.master, {})
        counted = any(torch.is_tensor(v) and v.shape != unit.master.shape for v in state.values())
        if back and counted and not self._warned:
            self._warned = True
            names = {id(p): n for n, p in self.engine.model.named_parameters()}
            which = ", ".join(names.get(id(unit.params[i]), f"#{i}") for i in sorted(back))
            warnings.warn(
                f"{which} trained again after skipping steps (no rank gave it a gradient) while the rest "
                f"of unit {unit.name!r} stepped. {type(self.inner).__name__} keeps one step count per "
                "unit shard, so its bias correction now counts the skipped steps too, unlike "
                "torch.optim on model.parameters(). For exact per-parameter counts make such "
                "parameters their own units (the default for each Linear; drop units=...), or at "
                "stage 3 step model.parameters() with your own optimizer.", RuntimeWarning, stacklevel=3)
        skipped |= set(unit.unused)

    def _hold_unused(self, unit: FlatUnit):
        """Copies of the unused params' elements of the master and of its state, or None."""
        if unit.master.grad is None or not unit.unused:
            return None
        spans = [span for i, span in enumerate(unit.ranges(unit.master)) if i in unit.unused]
        tensors = {k: v for k, v in self.inner.state.get(unit.master, {}).items()
                   if torch.is_tensor(v) and v.shape == unit.master.shape}
        return [(a, b, unit.master[a:b].clone(), {k: v[a:b].clone() for k, v in tensors.items()}) for a, b in spans]

    def _put_back(self, unit: FlatUnit, kept) -> None:
        if kept is None:
            return
        state = self.inner.state.get(unit.master, {})
        for a, b, weights, old in kept:
            unit.master[a:b] = weights
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape == unit.master.shape:
                    v[a:b] = old[k] if k in old else 0  # state born this step: as if never stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)


def guard(engine: Engine) -> None:
    """Make any optimizer over this engine's params refuse to step, unless their .grad is real."""
    if not engine.params_hold_grads:
        _guarded.add(engine)


def _refuse_params_without_grads(optimizer, args, kwargs) -> None:
    if not _guarded:
        return
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in list(_guarded):
        if ids & engine.param_ids:
            how = "with mixed precision " if engine.mixed else ""
            raise RuntimeError(
                f"this {type(optimizer).__name__} steps the parameters of a model parallelized at stage "
                f"{engine.stage} {how}whose gradients live only in the sharded masters (p.grad is None): "
                "it would train nothing. Use the optimizer shardlab.parallelize returned, or "
                "shardlab.ShardedOptimizer on a stage-0 model, or stage 3, whose parameters are shards "
                "any optimizer can step")


register_optimizer_step_pre_hook(_refuse_params_without_grads)
