"""The public engine API: ``parallelize`` and the few functions that need to see every shard.

::

    model, optimizer = shardlab.parallelize(model, stage=3, optimizer_cls=torch.optim.AdamW, lr=1e-3)
    for x, y in data:                                  # a plain PyTorch loop
        loss_fn(model(x), y).backward()
        shardlab.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    state = shardlab.full_state_dict(model)            # whole tensors, original names

The model is changed in place, not wrapped: parameter names, ``state_dict`` keys and the
module's own ``forward`` stay as they were, as with PyTorch's ``fully_shard``.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.engine import comm
from shardlab.engine.base import Engine
from shardlab.engine.ddp import DataParallel
from shardlab.engine.optim import StageOptimizer, guard
from shardlab.engine.zero1 import ZeRO1
from shardlab.engine.zero2 import ZeRO2
from shardlab.engine.zero3 import FSDP

STAGES: dict[int, type[Engine]] = {0: DataParallel, 1: ZeRO1, 2: ZeRO2, 3: FSDP}

_live: weakref.WeakSet = weakref.WeakSet()  # parallelized models alive in this process


@dataclass(frozen=True)
class MixedPrecision:
    """Compute and gather weights in ``param_dtype``; reduce gradients in ``reduce_dtype``.

    The master weights and optimizer state stay in the model's own dtype: fp32 for an fp32
    model (the paper's 2 + 2 + 12 bytes); a model already cast to bf16 keeps bf16 masters.
    Reducing in fp32 (the default) avoids summing N low-precision gradients in low precision.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32


class ShardedModule:
    """Mixed into a parallelized model's class (like FSDP2 does) to add ``no_sync``."""

    _shardlab: Engine

    def no_sync(self) -> AbstractContextManager:
        """Accumulate gradients locally; the first backward outside communicates them all."""
        return self._shardlab.no_sync()


def _check(model, stage, optimizer_cls) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModule):
        raise ValueError("this model is already parallelized; build a fresh model to change the stage")
    if stage not in STAGES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3 (FSDP); got {stage!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "no process group: call torch.distributed.init_process_group() first "
            "(or run under torchrun, shardlab.run_ranks or shardlab.start_cluster)")
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError("the model has no trainable parameters: there is nothing to shard or train")
    if len({(p.device, p.dtype) for p in params if p.requires_grad}) > 1:
        raise ValueError("all trainable parameters must share one device and one dtype; "
                         "move the model with model.to(device, dtype) first")
    if not (inspect.isclass(optimizer_cls) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
    if optimizer_cls is torch.optim.LBFGS:
        raise ValueError("LBFGS needs whole-model closures; use an elementwise optimizer (SGD, Adam, AdamW, ...)")


def parallelize(model: nn.Module, stage: int = 3, optimizer_cls=torch.optim.AdamW, *, units=None,
                reshard_after_forward: bool = True, prefetch: bool = True, mixed_precision=None,
                **optimizer_kwargs) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Make ``model`` data-parallel at ZeRO ``stage`` and return it with its optimizer.

    Args:
        stage: 0 = DDP, 1 = + optimizer state sharded, 2 = + gradients, 3 = + weights (FSDP).
        optimizer_cls, **optimizer_kwargs: any elementwise torch optimizer and its arguments.
        units: the submodules gathered and freed as one at stage 3 (and communicated as one at
            every stage): a class, a tuple of classes or a predicate. Default: each child of every
            ``nn.ModuleList`` (the transformer blocks); what is left belongs to the root unit.
        reshard_after_forward: stage 3 only: free each unit after its forward (ZeRO-3). False
            keeps them gathered until backward (less communication, ZeRO-2-like weight memory).
        prefetch: stage 3 only: start the next unit's all-gather before it is needed.
        mixed_precision: a dtype (e.g. ``torch.bfloat16``) or a :class:`MixedPrecision`.

    Every rank starts from rank 0's parameters and buffers, as with DDP; gradients are the mean
    over ranks; frozen parameters are kept whole and untouched. A parameter no rank gave a
    gradient keeps ``grad = None`` and is not stepped; one used on some ranks gets the sum of
    the gradients that exist divided by N, as with DDP.

    Your own optimizer: at stage 3 ``model.parameters()`` are this rank's shards (see
    ``zero3.py``), so ``torch.optim.AdamW(model.parameters())`` works; at stages 1 and 2 (and
    stage 0 in mixed precision) its first ``step()`` raises: use the returned optimizer.
    """
    _check(model, stage, optimizer_cls)
    cls = STAGES[stage]
    stage3_options = dict(reshard_after_forward=reshard_after_forward, prefetch=prefetch)
    if not cls.shards_params:
        if not (reshard_after_forward and prefetch):
            raise ValueError(f"reshard_after_forward and prefetch apply to stage 3 only (weights gathered "
                             f"and freed); stage {stage} keeps every weight. Drop them or use stage=3")
        stage3_options = {}
    if isinstance(mixed_precision, torch.dtype):
        mixed_precision = MixedPrecision(param_dtype=mixed_precision)
    precision = dict(param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype) \
        if mixed_precision is not None else {}
    engine = cls(model, units=units, **stage3_options, **precision)
    model._shardlab = engine
    model.__class__ = type(f"Sharded{type(model).__name__}", (ShardedModule, type(model)), {})
    _live.add(model)
    optimizer = StageOptimizer(engine, optimizer_cls, **optimizer_kwargs)
    guard(engine)  # an optimizer over model.parameters() that would train nothing raises at step()
    engine.optimizer = weakref.ref(optimizer)  # for instruments that are given only the model
    return model, optimizer


def engine_of(model: nn.Module | None = None) -> Engine:
    """The engine behind a model that :func:`parallelize` returned (its units, stage, shards).

    The one way in: instruments and checkpoints ask here instead of reading private attributes.
    With no model: the engine of the one parallelized model alive in this process.
    """
    if model is None:
        models = list(_live)
        if len(models) != 1:
            raise ValueError(f"found {len(models)} parallelized models in this process; pass the one you mean")
        model = models[0]
    if not isinstance(model, ShardedModule):
        raise TypeError(f"expected a model returned by shardlab.parallelize, got {type(model).__name__}")
    return model._shardlab


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model as ``model.state_dict()`` would give it unsharded, on every rank.

    Trainable weights come from the fp32 masters (all-gathered from the shards), so this is
    exact even under mixed precision. Keys and order are those of the original model.
    """
    engine = engine_of(model)
    full = {}
    for unit in engine.units:
        for p, t in zip(unit.params, unit.views(unit.gather_full_master())):
            full[id(p)] = t.clone()
    state = {}
    for name, t in model.state_dict(keep_vars=True).items():
        state[name] = full[id(t)] if id(t) in full else t.detach().clone()
    return state


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full tensors (as from :func:`full_state_dict`); each rank keeps its own shards."""
    engine = engine_of(model)
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    by_id = {id(t): name for name, t in own.items()}
    shapes = {id(p): tuple(s) for unit in engine.units for p, s in zip(unit.params, unit.shapes)}
    for name, t in own.items():  # (at stage 3 the params show shards: compare with the full shapes)
        expected = shapes.get(id(t), tuple(t.shape))
        if tuple(state[name].shape) != expected:
            raise ValueError(f"{name}: expected shape {expected}, got {tuple(state[name].shape)}")
    in_units = set()
    for unit in engine.units:
        unit.load([state[by_id[id(p)]] for p in unit.params])
        in_units.update(id(p) for p in unit.params)
    for name, t in own.items():
        if id(t) not in in_units:
            t.copy_(state[name])


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so that their global L2 norm is at most ``max_norm``; return that norm.

    At stages 1-3 each rank holds a shard of the gradients, so the squares are summed locally
    and all-reduced: the norm is that of the whole, unsharded model. Call after ``backward()``.
    """
    if norm_type != 2.0:
        raise ValueError("only the L2 norm (norm_type=2.0) is supported")
    engine = engine_of(model)
    masters = [u.master for u in engine.units if u.master.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=engine.units[0].master.device)
    for m in masters:
        total += m.grad.double().pow(2).sum()
    if engine.shards_optimizer_state:  # the squares are spread over the ranks' shards
        comm.all_reduce(total)
    norm = total.sqrt().float()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [m.grad for m in masters]  # what the optimizer steps; any p.grad is a view of them
    if grads:
        torch._foreach_mul_(grads, coef)
    return norm
