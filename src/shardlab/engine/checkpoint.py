"""Sharded checkpoints that reshard: every rank writes its shard, any world size and stage reads them.

::

    shardlab.save_checkpoint(model, optimizer, "ckpt")   # 4 ranks, stage 3
    shardlab.load_checkpoint(model, optimizer, "ckpt")   # later: 2 ranks, stage 2, or 3 ranks...

* **Sharded.** Rank r writes elements ``[r * shard_numel, (r+1) * shard_numel)`` of each unit's
  fp32 master weights and optimizer state, nothing more; no rank ever assembles the full model
  (at stage 0 every rank holds it all, and still writes only its slice). Rank 0 adds the
  metadata and the small replicated part (frozen parameters, buffers). Layout:
  :mod:`shardlab.engine.checkpoint_format` and ``docs/checkpoints.md``.
* **Resharding.** A loading rank computes the range of each unit its master holds in the *new*
  layout (its shard; all of it at stage 0) and reads, parameter by parameter, only the old
  shard files that overlap it. Stages 1-2 then all-gather each unit's new shards, one unit at a
  time, to refresh the full parameters they keep.
* **Atomic.** Files go to a temporary directory beside ``path``; when every rank reports
  success, rank 0 swaps it into place. A crash before that leaves the previous checkpoint as it was.
* **Every rank agrees.** Each phase ends with one collective through :mod:`shardlab.engine.comm`
  in which the ranks swap their errors, so one failing rank makes every rank raise
  :class:`CheckpointError` (naming the rank, file or parameter) instead of leaving others hanging.
  Nothing is changed in the model or optimizer until every rank has read everything it needs.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.nn as nn

from shardlab.engine import comm
from shardlab.engine.api import engine_of
from shardlab.engine.checkpoint_format import (
    FORMAT,
    METADATA,
    REPLICATED,
    VERSION,
    CheckpointError,
    ShardReader,
    compare_shapes,
    decode_scalar,
    describe_units,
    dtype_name,
    dumps,
    flat_state,
    jsonable,
    last_step,
    local_state,
    merge_states,
    read_metadata,
    read_range,
    shard_file,
)
from shardlab.engine.per_param import PerParamOptimizer

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError"]


def _agree(error: Exception | None, what: str, value=None) -> list:
    """Every rank learns every rank's outcome. If any failed, all raise; else return all ``value``s."""
    mine = None
    if error is not None:
        mine = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    reports = comm.gather_lists([(mine, value)])
    failed: dict[str, list[int]] = {}
    for rank, (message, _) in enumerate(reports):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if failed:
        detail = "; ".join(f"on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {m}"
                           for m, ranks in failed.items())
        raise CheckpointError(f"{what} failed {detail}") from error
    return [v for _, v in reports]


def _optimizer(engine, optimizer) -> PerParamOptimizer | None:
    """The optimizer stepping this rank's masters (one piece per parameter), or None: weights only."""
    if optimizer is None:
        return None
    if not (isinstance(optimizer, PerParamOptimizer) and optimizer.units == engine.units):
        raise TypeError(
            f"checkpoints need the optimizer that shardlab.parallelize returned with this model "
            f"(or optimizer=None for the weights only); got {type(optimizer).__name__}")
    return optimizer


def _replicated(model: nn.Module, engine) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers: every rank holds them whole and equal, so rank 0 saves them."""
    in_units = {id(p) for unit in engine.units for p in unit.params}
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if id(t) not in in_units}


def _save_file(obj, file: Path) -> int:
    """``torch.save`` to ``file``, flushed to disk; return its size in bytes."""
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return file.stat().st_size


def _my_slice(unit, t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` as a compact CPU copy (torch.save would write a view's whole storage)."""
    t = t.detach()
    return (unit.my_shard(t) if t.numel() == unit.padded_numel else t).to("cpu", copy=True)


def save_checkpoint(model: nn.Module, optimizer, path) -> Path:
    """Write this rank's shard of the weights and optimizer state to directory ``path``. Call on every rank.

    ``optimizer`` is the one :func:`shardlab.parallelize` returned (or None: weights only). An
    existing checkpoint at ``path`` is replaced only once the new one is complete. All ranks
    must see one filesystem (one machine, or a shared file system).
    """
    engine = engine_of(model)
    opt = _optimizer(engine, optimizer)
    path = Path(path).absolute()
    token = comm.gather_lists([uuid.uuid4().hex[:12]])[0]  # rank 0's: one name on every rank
    tmp = path.parent / f".{path.name}.tmp-{token}"
    name, error, size, mine = shard_file(engine.rank, engine.world_size), None, 0, None
    try:  # first every rank learns which state keys exist anywhere: each shard file holds them all
        mine = local_state(model, engine, opt)
    except Exception as e:  # noqa: BLE001 - reported to every rank just below
        error = e
    kinds, scalars = merge_states(_agree(error, f"saving {path}", value=mine))
    error = None
    try:
        if path.exists() and not (path / METADATA).is_file():
            raise CheckpointError(f"{path} exists and is not a ShardLab checkpoint; refusing to replace it")
        tmp.mkdir(parents=True, exist_ok=True)
        units = {}
        for unit, states in zip(engine.units, opt.piece_state() if opt is not None else [[]] * len(engine.units)):
            units[unit.name] = {"weights": _my_slice(unit, unit.master), "state": {
                k: _my_slice(unit, flat_state(unit, states, k, dtype)) for k, dtype in kinds.get(unit.name, {}).items()}}
        size = _save_file({"units": units}, tmp / name)
    except Exception as e:  # noqa: BLE001 - reported to every rank just below
        error = e
    sizes = _agree(error, f"saving {path}", value=(name, size))
    error = None
    if engine.rank == 0:
        try:
            _write_metadata(model, engine, opt, describe_units(model, engine, kinds, scalars), tmp, dict(sizes))
            _swap_into_place(tmp, path, token)
        except Exception as e:  # noqa: BLE001
            error = e
    _agree(error, f"saving {path}")  # no rank returns before the checkpoint is in place
    return path


def _write_metadata(model, engine, opt, units: list[dict], tmp: Path, files: dict[str, int]) -> None:
    inner = opt.inner if opt is not None else None
    replicated = {name: t.detach().to("cpu", copy=True) for name, t in _replicated(model, engine).items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups] if inner is not None else None
    files[REPLICATED] = _save_file({"tensors": replicated, "param_groups": groups}, tmp / REPLICATED)
    meta = dict(
        format=FORMAT, version=VERSION, world_size=engine.world_size, stage=engine.stage, step=last_step(units),
        torch=torch.__version__, shardlab=importlib.metadata.version("shardlab"),
        param_dtype=dtype_name(engine.units[0].params[0].dtype),
        optimizer=None if inner is None else dict(
            cls=f"{type(inner).__module__}.{type(inner).__qualname__}",
            param_groups=[{k: jsonable(v) for k, v in g.items()} for g in groups]),
        replicated={name: dict(shape=list(t.shape), dtype=dtype_name(t.dtype)) for name, t in replicated.items()},
        files=files, units=units)
    (tmp / METADATA).write_text(dumps(meta))


def _swap_into_place(tmp: Path, path: Path, token: str) -> None:
    """Rename ``tmp`` to ``path``; the old checkpoint is moved aside first and removed only after."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{token}")
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):  # left by saves that crashed
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(model: nn.Module, optimizer, path) -> dict:
    """Load a checkpoint saved at any world size and stage into ``model`` (and ``optimizer``); return its metadata.

    Call on every rank. The model must have the same parameter names and shapes (its units may
    be split differently); the optimizer, the same class as the one saved (None: weights only).
    """
    engine = engine_of(model)
    opt = _optimizer(engine, optimizer)
    path = Path(path).absolute()
    error, plan = None, None
    try:
        plan = _read(model, engine, opt.inner if opt is not None else None, path)
    except Exception as e:  # noqa: BLE001 - reported to every rank just below
        error = e
    # which units hold full parameters (stages 0-2, a gathered stage-3 unit) that must be
    # refreshed too: the units say, and every rank takes one answer
    holds_full = [any(per_rank) for per_rank in zip(*_agree(error, f"loading {path}",
                                                             value=[u.holds_full for u in engine.units]))]
    _apply(model, engine, opt, holds_full, *plan)
    return plan[0]


def _master_range(engine, unit) -> tuple[int, int]:
    """The elements of the unit's padded flat buffer that this rank's master and optimizer state hold."""
    if unit.master.numel() == unit.padded_numel:  # stage 0: all of them
        return 0, unit.padded_numel
    start = engine.rank * unit.shard_numel
    return start, start + unit.shard_numel


def _read(model, engine, inner, path: Path):
    """Everything this rank will load, read and checked, with nothing changed yet."""
    meta = read_metadata(path)
    where = {p["name"]: (u, p["offset"]) for u in meta["units"] for p in u["params"]}
    shapes = {p["name"]: tuple(p["shape"]) for u in meta["units"] for p in u["params"]}
    scalars = {p["name"]: p["state"] for u in meta["units"] for p in u["params"]}  # None: never stepped
    names = {id(p): name for name, p in model.named_parameters()}
    mine = {names[id(p)]: tuple(s) for unit in engine.units for p, s in zip(unit.params, unit.shapes)}
    compare_shapes("trainable parameter", mine, shapes, path)
    if inner is not None:
        if meta["optimizer"] is None:
            raise CheckpointError(f"{path} holds no optimizer state; load it with optimizer=None")
        cls = f"{type(inner).__module__}.{type(inner).__qualname__}"
        if meta["optimizer"]["cls"] != cls:
            raise CheckpointError(f"{path} holds the state of {meta['optimizer']['cls']}, not of {cls}; "
                                  "parallelize with that optimizer_cls, or load with optimizer=None")
    try:
        replicated = torch.load(path / REPLICATED, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to parse is a damaged file
        raise CheckpointError(f"cannot read {path / REPLICATED}: truncated or corrupt ({e})") from e
    if inner is not None and len(replicated["param_groups"]) != len(inner.param_groups):
        raise CheckpointError(f"{path / REPLICATED}: the saved optimizer has {len(replicated['param_groups'])} "
                              f"param groups, this one {len(inner.param_groups)}")
    own = {name: tuple(t.shape) for name, t in _replicated(model, engine).items()}
    compare_shapes("frozen parameter or buffer", own, {k: tuple(t.shape) for k, t in replicated["tensors"].items()}, path)

    reader, units = ShardReader(path, meta), []
    for unit in engine.units:
        pnames = [names[id(p)] for p in unit.params]
        lo, hi = _master_range(engine, unit)
        weights = read_range(reader, where, pnames, unit, "weights", lo, hi, unit.master.dtype)
        states = [None] * len(pnames)  # per parameter: its piece's optimizer state, None if never stepped
        if inner is not None:
            stepped = [n if scalars[n] is not None else None for n in pnames]
            keys = {k: t for n in stepped if n is not None for k, t in where[n][0]["state_tensors"].items()}
            flats = {k: unit.pieces(read_range(reader, where, stepped, unit, k, lo, hi, getattr(torch, t)))
                     for k, t in keys.items()}
            for i, (n, (a, b)) in enumerate(zip(stepped, unit.ranges(weights))):
                if n is not None and b > a:  # (an empty piece is never stepped)
                    states[i] = {k: pieces[i].clone() for k, pieces in flats.items()} | scalars[n]
        units.append((weights, states))
    return meta, replicated, units


@torch.no_grad()
def _apply(model, engine, opt, holds_full, meta, replicated, units) -> None:
    for i, (unit, full_params, (weights, states)) in enumerate(zip(engine.units, holds_full, units)):
        device = unit.master.device
        weights = weights.to(device)
        if full_params:  # gather the new shards, one unit at a time, into the full (maybe bf16) params
            if weights.numel() != unit.padded_numel:
                shards, weights = weights, torch.empty(unit.padded_numel, dtype=weights.dtype, device=device)
                comm.all_gather(weights, shards, unit=unit.name, owner=unit)
            unit.load(unit.views(weights))
        else:
            unit.master.copy_(weights)
        if opt is not None:
            group = opt.inner.param_groups[0]
            scalar_device = device if group.get("capturable") or group.get("fused") else "cpu"
            for piece, state in zip(opt.pieces[i], states):
                opt.inner.state.pop(piece, None)
                if state is not None:  # (None: this parameter had not stepped when it was saved)
                    opt.inner.state[piece] = {k: v.to(device) if torch.is_tensor(v) else decode_scalar(v, scalar_device)
                                              for k, v in state.items()}
    own = _replicated(model, engine)
    for name, t in replicated["tensors"].items():
        own[name].copy_(t)
    if opt is not None:
        for group, hyper in zip(opt.inner.param_groups, replicated["param_groups"]):
            for k, v in hyper.items():
                if torch.is_tensor(group.get(k)) and torch.is_tensor(v):
                    group[k].copy_(v)
                else:
                    group[k] = v
