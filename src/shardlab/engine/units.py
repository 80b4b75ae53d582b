"""Which submodules are units, which unit owns each parameter, and one model on every rank.

A *unit* is what a stage communicates as one buffer, and what stage 3 gathers and frees as one
(FSDP2 calls it an ``FSDPParamGroup``, DDP a bucket). The default rule: each child of every
``nn.ModuleList``, which is one unit per transformer block for the usual model layouts; all
that is left over belongs to the root unit. Activation checkpointing follows the same rule,
so its recompute happens inside the unit's gather.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from shardlab.engine import comm


def find_unit_modules(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    """The submodules that become units. Default: each child of every ``nn.ModuleList``.

    That is one unit per transformer block for the usual model layouts; ``units`` may instead be
    a module class, a tuple of classes, or a predicate ``f(module) -> bool``.
    """
    if units is None:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        chosen = {id(child) for lst in lists for child in lst}
        match = lambda m: id(m) in chosen  # noqa: E731
    elif isinstance(units, type) or (isinstance(units, tuple) and all(isinstance(u, type) for u in units)):
        match = lambda m: isinstance(m, units)  # noqa: E731
    elif callable(units):
        match = units
    else:
        raise TypeError(f"units must be None, a module class, a tuple of classes or a predicate; got {units!r}")
    return [(name, m) for name, m in model.named_modules() if m is not model and match(m)]


def group_params(model: nn.Module, unit_modules) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Assign every trainable parameter to the innermost unit that contains it (root last).

    A parameter reached from two different units (tied across units) cannot be sharded with
    one owner, so it is rejected with the names that share it.
    """
    unit_of = {id(m): name for name, m in unit_modules}
    owner: dict[int, str] = {}
    names: dict[int, list[str]] = {}
    params: dict[str, list[nn.Parameter]] = {name: [] for name, _ in unit_modules}
    params[""] = []

    def walk(module, prefix, unit):
        unit = unit_of.get(id(module), unit)
        for pname, p in module._parameters.items():
            if p is None or not p.requires_grad:
                continue
            names.setdefault(id(p), []).append(prefix + pname)
            if id(p) in owner and owner[id(p)] != unit:
                raise ValueError(
                    f"parameter {names[id(p)]} is shared by units {owner[id(p)]!r} and {unit!r}; "
                    "put both modules in one unit (units=...) or untie the weights")
            if id(p) not in owner:
                owner[id(p)] = unit
                params[unit].append(p)
        for cname, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{cname}.", unit)

    walk(model, "", "")
    modules = dict(unit_modules) | {"": model}
    order = [name for name, _ in unit_modules] + [""]
    return [(name or "root", modules[name], params[name]) for name in order if params[name]]


def checkpoint_units(model: nn.Module, modules=None) -> nn.Module:
    """Wrap each unit's forward in activation checkpointing (``use_reentrant=False``), in place.

    ``modules`` defaults to the units :func:`find_unit_modules` picks (the blocks). Module hooks
    stay outside the checkpoint, so stage 3 gathers a unit before its recompute.
    """
    if modules is None:
        modules = [m for _, m in find_unit_modules(model, None)]
    if not modules:
        raise ValueError("no modules to checkpoint: pass modules=[...] (e.g. model.blocks)")
    for m in modules:
        inner = m.forward
        m.forward = lambda *a, _f=inner, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    return model


def check_same_model_on_every_rank(groups, world_size: int) -> None:
    """Every rank must build the same units with the same trainable sizes: one all-gather says."""
    device = groups[0][2][0].device  # NCCL only moves tensors on the GPU
    mine = torch.tensor([len(groups), sum(p.numel() for _, _, ps in groups for p in ps)], device=device)
    everyone = torch.empty(2 * world_size, dtype=mine.dtype, device=device)
    comm.all_gather(everyone, mine)
    if not torch.equal(everyone.view(-1, 2), mine.expand(world_size, 2)):
        raise ValueError(
            "ranks hold different models (units, trainable elements per rank: "
            f"{everyone.view(-1, 2).tolist()}); build the same model on every rank")


@torch.no_grad()
def broadcast_untrained_state(model: nn.Module) -> None:
    """Frozen parameters and buffers are not sharded; every rank takes rank 0's copy."""
    for p in model.parameters():
        if not p.requires_grad:
            comm.broadcast(p.data)
    for b in model.buffers():
        comm.broadcast(b)
