"""The optimizer ``parallelize`` returns, and the guard that stops one that would train nothing.

Bring your own optimizer: at stage 0 (full precision) and stage 3, ``p.grad`` holds after
backward exactly what an optimizer over ``model.parameters()`` must step (stage 3: this rank's
piece of each parameter, see ``zero3.py``), so ``torch.optim.AdamW(model.parameters())`` works.
At stages 1 and 2 the parameters are full but their averaged gradients live only in the
sharded masters, so such an optimizer would step nothing; a global step pre-hook makes its
first ``step()`` raise instead.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardlab.engine import events
from shardlab.engine.base import Engine
from shardlab.engine.per_param import PerParamOptimizer

_guarded: weakref.WeakSet = weakref.WeakSet()  # engines whose params' .grad stays None


class StageOptimizer(PerParamOptimizer):
    """The optimizer ``parallelize`` returns: ``optimizer_cls`` on this rank's masters.

    ``step()`` runs the wrapped optimizer on whatever the stage gave it (the whole model at
    stage 0, one shard per unit at stages 1-3), cut into one piece per parameter
    (``per_param.py``), then lets the stage bring the new weights back. So each parameter keeps
    its own state, as with ``torch.optim`` on ``model.parameters()``, and one that got no
    gradient is not stepped.
    """

    def __init__(self, engine: Engine, optimizer_cls, **kwargs):
        self.engine = engine
        super().__init__(engine.units, optimizer_cls, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        events.set_phase("step")
        events.emit(events.STEP_START)
        super().step(closure)
        self.engine.step()
        events.emit(events.STEP_END)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)


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
