"""The on-disk layout of a sharded checkpoint, and reading any element range back from it.

A checkpoint is a directory (see ``docs/checkpoints.md``)::

    ckpt/
      metadata.json               world size, stage, units (names, shapes, offsets, padding), step,
                                  optimizer class and hyper-parameters, versions, file sizes,
                                  each parameter's optimizer scalars (its own ``step``)
      shard-00000-of-00004.pt     rank 0's shard of every unit: fp32 master weights + optimizer state
      ...                         (one file per rank)
      replicated.pt               written once, by rank 0: frozen parameters, buffers, param_groups

Shard file ``r`` of ``N`` holds elements ``[r * shard_numel, (r+1) * shard_numel)`` of each unit's
padded flat buffer, at every stage. A parameter is found by name: ``offset`` is where it starts
in its unit's flat buffer, so any element of it lives in exactly one shard file. That is all a
new world size, stage or unit split needs to read its own range.

Version 2 keeps the optimizer's scalars (Adam's ``step``) per parameter, as the optimizer does
(``per_param.py``); version 1 kept one set per unit, and still loads: each parameter takes its
unit's (:func:`upgrade_v1`). The shard files are the same in both.
"""

from __future__ import annotations

import glob
import json
import re
from itertools import accumulate
from pathlib import Path

import torch
import torch.nn as nn

FORMAT = "shardlab-sharded-checkpoint"
VERSION = 2  # 1: scalars such as step per unit; 2: per parameter
READABLE = (1, 2)
METADATA = "metadata.json"
REPLICATED = "replicated.pt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded. Raised on every rank, naming the file or parameter."""


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def split_state(where: str, piece: torch.Tensor, state: dict) -> tuple[dict, dict]:
    """One parameter's optimizer state as (tensors shaped like its piece, scalars such as ``step``).

    Elementwise optimizers (SGD, Adam, AdamW, ...) keep one number per weight, so their state
    shards exactly like the weights. Anything else cannot be resharded: say so.
    """
    tensors, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == piece.shape:
            tensors[key] = value
        elif (torch.is_tensor(value) and value.dim() == 0) or isinstance(value, (bool, int, float)):
            scalars[key] = value
        else:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise CheckpointError(
                f"optimizer state {key!r} of {where} is {shape}, neither shaped like its piece "
                f"{tuple(piece.shape)} nor a scalar: only elementwise optimizers can be sharded")
    return tensors, scalars


def local_state(model: nn.Module, engine, optimizer) -> tuple[dict, dict]:
    """What this rank's optimizer holds: ``({unit: {tensor key: dtype}}, {param name: {scalar key:
    encoded}})``, the second for the parameters it has stepped. Ranks are merged with :func:`merge_states`."""
    names = {id(p): name for name, p in model.named_parameters()}
    kinds, scalars = {}, {}
    for unit, states in zip(engine.units, optimizer.piece_state() if optimizer is not None else ()):
        kinds[unit.name] = {}
        for p, piece, state in zip(unit.params, unit.pieces(unit.master), states):
            if state:
                tensors, values = split_state(f"parameter {names[id(p)]!r}", piece, state)
                kinds[unit.name] |= {k: dtype_name(v.dtype) for k, v in tensors.items()}
                scalars[names[id(p)]] = {k: encode_scalar(v) for k, v in values.items()}
    return kinds, scalars


def merge_states(per_rank: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Every rank's :func:`local_state` as one: tensor keys per unit, scalars per parameter
    (every rank holding a piece of a parameter stepped it equally often)."""
    kinds, scalars = {}, {}
    for rank_kinds, rank_scalars in per_rank:
        for unit, keys in rank_kinds.items():
            kinds.setdefault(unit, {}).update(keys)
        for name, values in rank_scalars.items():
            scalars.setdefault(name, values)
    return kinds, scalars


def flat_state(unit, states: list[dict], key: str, dtype: str) -> torch.Tensor:
    """State ``key`` of the unit's pieces as one tensor shaped like its master (zero where none)."""
    flat = torch.zeros(unit.master.numel(), dtype=getattr(torch, dtype), device=unit.master.device)
    for piece, state in zip(unit.pieces(flat), states):
        if key in state and piece.numel():
            piece.copy_(state[key])
    return flat


def encode_scalar(value) -> dict:
    """``step`` and friends, exactly, in JSON (a float32 or int64 value is exact as a JSON number)."""
    if torch.is_tensor(value):
        return {"value": value.item(), "dtype": dtype_name(value.dtype)}
    return {"value": value, "dtype": None}


def decode_scalar(entry: dict, device):
    if entry["dtype"] is None:
        return entry["value"]
    return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]), device=device)


def last_step(units: list[dict]):
    """The checkpoint's ``step``: the most any parameter was stepped (None without a step count)."""
    steps = [p["state"]["step"]["value"] for u in units for p in u["params"] if p["state"] and "step" in p["state"]]
    return max(steps, default=None)


def jsonable(value):
    """Hyper-parameters for a human reader (the exact values travel in ``replicated.pt``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if torch.is_tensor(value):
        return value.tolist()
    return repr(value)


def dumps(meta: dict, width: int = 240) -> str:
    """JSON to read with ``cat``: each object or list that fits in ``width`` characters (a
    parameter with its state, a param group, the files) on one line."""
    short: list[str] = []

    def fold(value):
        if isinstance(value, (dict, list)) and value is not meta:
            flat = json.dumps(value)
            if len(flat) <= width:
                short.append(flat)
                return f"\0{len(short) - 1}"  # a placeholder, replaced below
        if isinstance(value, dict):
            return {k: fold(v) for k, v in value.items()}
        return [fold(v) for v in value] if isinstance(value, list) else value

    text = re.sub(r'"\\u0000(\d+)"', lambda m: short[int(m[1])], json.dumps(fold(meta), indent=1))
    return text if json.loads(text) == meta else json.dumps(meta, indent=1)  # (a "\0" in a string)


def describe_units(model: nn.Module, engine, kinds: dict, scalars: dict) -> list[dict]:
    """Each unit's layout (parameter names, shapes, offsets, padding) and what state it carries:
    the tensor keys per unit, the scalars per parameter (None: never stepped)."""
    names = {id(p): name for name, p in model.named_parameters()}
    units = []
    for unit in engine.units:
        offsets = [0, *accumulate(unit.numels)][:-1]
        units.append(dict(
            name=unit.name, numel=unit.numel, padded_numel=unit.padded_numel, shard_numel=unit.shard_numel,
            padding=unit.padded_numel - unit.numel, dtype=dtype_name(unit.master.dtype),
            state_tensors=dict(sorted(kinds.get(unit.name, {}).items())),
            params=[dict(name=names[id(p)], shape=list(shape), dtype=dtype_name(p.dtype), offset=offset, numel=numel,
                         state=scalars.get(names[id(p)]))
                    for p, shape, offset, numel in zip(unit.params, unit.shapes, offsets, unit.numels)]))
    return units


def upgrade_v1(meta: dict) -> dict:
    """Version 1 kept the scalars (``step``) per unit, beside the tensors: each parameter takes its unit's."""
    for unit in meta["units"]:
        scalars = unit.pop("state_scalars")
        stepped = bool(unit["state_tensors"] or scalars)
        for p in unit["params"]:
            p["state"] = dict(scalars) if stepped else None
    return meta


def read_metadata(path: Path) -> dict:
    """The checkpoint's metadata, after checking that every file it names is there, whole."""
    if not path.exists():
        leftovers = sorted(p.name for p in path.parent.glob(f".{glob.escape(path.name)}.old-*")) if path.parent.exists() else []
        hint = f"; an interrupted save left the previous checkpoint at {leftovers} beside it" if leftovers else ""
        raise CheckpointError(f"checkpoint {path} does not exist{hint}")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a sharded checkpoint directory (a full state dict from torch.save? "
            "load it with shardlab.load_full_state_dict(model, torch.load(path)))")
    file = path / METADATA
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a ShardLab checkpoint, or it is incomplete")
    try:
        meta = json.loads(file.read_text())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{file} cannot be read ({e}): the file is truncated or corrupt") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in READABLE:
        raise CheckpointError(f"{file} does not describe a ShardLab checkpoint of format version "
                              f"{' or '.join(map(str, READABLE))}")
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}: it is incomplete; "
                                  "restore the file or load an earlier checkpoint")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, the metadata says {size}: "
                                  "the file is truncated or was replaced")
    return upgrade_v1(meta) if meta["version"] == 1 else meta


def _few(names: list[str]) -> str:
    return f"{names[:4]}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def compare_shapes(what: str, mine: dict, saved: dict, path: Path) -> None:
    """The model's and the checkpoint's ``{name: shape}`` must agree; else name the difference."""
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise CheckpointError(f"{path} is a checkpoint of a different model: {what}s not in it {_few(missing)}, "
                              f"in it but not in the model {_few(unexpected)}; build the model it was saved from")
    for name, shape in mine.items():
        if saved[name] != shape:
            raise CheckpointError(f"{path}: {what} {name!r} has shape {saved[name]} in the checkpoint, "
                                  f"{shape} in the model; build the model it was saved from")


class ShardReader:
    """Reads element ranges of the saved units' flat buffers, opening only the shard files it needs.

    Files are memory-mapped, so a rank reads from disk only the pages of the ranges it asks for.
    """

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta
        self.world_size = meta["world_size"]
        self.files: dict[int, dict] = {}

    def _tensor(self, rank: int, unit: dict, key: str) -> torch.Tensor:
        if rank not in self.files:
            file = self.path / shard_file(rank, self.world_size)
            try:
                self.files[rank] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001 - any failure to parse is a damaged file
                raise CheckpointError(f"cannot read {file}: truncated or corrupt ({e})") from e
        try:
            saved = self.files[rank]["units"][unit["name"]]
            t = saved["weights"] if key == "weights" else saved["state"][key]
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{self.path / shard_file(rank, self.world_size)} lacks {key!r} of unit "
                                  f"{unit['name']!r}: the file does not match metadata.json") from e
        if t.shape != (unit["shard_numel"],):
            raise CheckpointError(f"{self.path / shard_file(rank, self.world_size)}: {key!r} of unit "
                                  f"{unit['name']!r} has shape {tuple(t.shape)}, expected ({unit['shard_numel']},)")
        return t

    def read(self, unit: dict, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, stop)`` of saved ``unit``'s flat ``key`` into ``out``."""
        s, done = unit["shard_numel"], 0
        while start < stop:
            rank = start // s
            end = min(stop, (rank + 1) * s)
            out[done : done + end - start].copy_(self._tensor(rank, unit, key)[start - rank * s : end - rank * s])
            done, start = done + end - start, end


def read_range(reader: ShardReader, where: dict, names: list[str], unit, key: str,
               lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the *new* ``unit``'s padded flat ``key``, parameter by parameter.

    ``where[name] = (saved unit, offset)``. Padding (past the unit's real elements), and a
    parameter whose name is None, stay zero.
    """
    out = torch.zeros(hi - lo, dtype=dtype)
    for name, offset, numel in zip(names, accumulate([0, *unit.numels]), unit.numels):
        a, b = max(lo, offset), min(hi, offset + numel)  # the part of this parameter inside [lo, hi)
        if a < b and name is not None:
            saved, saved_offset = where[name]
            reader.read(saved, key, saved_offset + a - offset, saved_offset + b - offset, out[a - lo : b - lo])
    return out
