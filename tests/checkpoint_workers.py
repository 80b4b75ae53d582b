"""Rank functions for the checkpoint tests: save, load into another layout, keep training."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from workers import OPTIMIZERS, error_of, loss_of, make_batch, make_model

import shardlab
from shardlab.engine import comm
from shardlab.models import MLP

GLOBAL_BATCH = 12  # rows per step, split evenly over 2, 3 or 4 ranks: the same data at every world size


def _batch(step: int):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return make_batch("gpt", step, rank, world_size, per_rank=GLOBAL_BATCH // world_size)


def _build(optimizer="adamw", seed=0, freeze=(), **parallel):
    cls, kw = OPTIMIZERS[optimizer]
    return shardlab.parallelize(make_model("gpt", seed, freeze), optimizer_cls=cls, **kw, **parallel)


def _train(model, opt, first: int, last: int) -> None:
    for step in range(first, last):
        loss_of("gpt", model, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()


def save_and_resume(path: str, full_path: str, optimizer="adamw", freeze=(), **parallel):
    """Train 2 steps, save, train 2 more (the run that never stopped). Then a fresh model with
    other weights loads the checkpoint and trains the same 2 steps (the resumed run)."""
    model, opt = _build(optimizer, freeze=freeze, **parallel)
    _train(model, opt, 0, 2)
    shardlab.save_checkpoint(model, opt, path)
    full = shardlab.full_state_dict(model)
    if dist.get_rank() == 0:  # the full checkpoint, for inference in a plain model
        torch.save(full, full_path)
    with torch.no_grad():
        x = _batch(0)[0]
        logits = model(x)
    _train(model, opt, 2, 4)
    uninterrupted = shardlab.full_state_dict(model)
    fresh, fresh_opt = _build(optimizer, seed=5, freeze=freeze, **parallel)
    meta = shardlab.load_checkpoint(fresh, fresh_opt, path)
    loaded = shardlab.full_state_dict(fresh)
    _train(fresh, fresh_opt, 2, 4)
    return dict(uninterrupted=uninterrupted, resumed=shardlab.full_state_dict(fresh), loaded=loaded,
                meta=meta, x=x, logits=logits, files=sorted(os.listdir(path)))


def load_and_continue(path: str, full_path: str, configs: list[dict]):
    """For each layout: load the checkpoint, record the weights, train the last 2 steps.

    ``same_output``: the loaded model computes exactly what the same layout computes after
    ``load_full_state_dict`` of the full checkpoint (so the parameters forward uses were refreshed).
    """
    out = []
    x = _batch(0)[0]
    for cfg in configs:
        model, opt = _build(seed=5, **cfg)
        shardlab.load_checkpoint(model, opt, path)
        loaded = shardlab.full_state_dict(model)
        reference, _ = _build(seed=6, **cfg)
        shardlab.load_full_state_dict(reference, torch.load(full_path, weights_only=True))
        with torch.no_grad():
            same_output = torch.equal(model(x), reference(x))
        _train(model, opt, 2, 4)
        out.append(dict(loaded=loaded, same_output=same_output, resumed=shardlab.full_state_dict(model)))
    return out


def crash_mid_save(path: str, full_dir: str):
    """Save once, train a step, then save again; rank 1 dies while writing its shard file.

    Rank 0 keeps the full weights after steps 1 and 2 in ``full_dir``, to compare with later.
    """
    model, opt = _build(stage=3)
    for step in (1, 2):
        _train(model, opt, step - 1, step)
        if step == 1:
            shardlab.save_checkpoint(model, opt, path)
        full = shardlab.full_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(full, Path(full_dir) / f"step{step}.pt")
    if dist.get_rank() == 1:
        def dying_save(obj, f, *args, **kwargs):
            f.write(b"PK\x03\x04 half a shard")
            f.flush()
            os._exit(3)
        torch.save = dying_save
    shardlab.save_checkpoint(model, opt, path)


def load_then_save(path: str):
    """In a fresh process group: load the checkpoint a crashed save left intact, train the step
    that followed it, then save over it (replacing it)."""
    model, opt = _build(stage=3, seed=5)
    meta = shardlab.load_checkpoint(model, opt, path)
    loaded = shardlab.full_state_dict(model)
    _train(model, opt, 1, 2)
    trained = shardlab.full_state_dict(model)
    shardlab.save_checkpoint(model, opt, path)
    return loaded, trained, meta["step"]


def bad_inputs(root: str):
    """Each bad load's error, on every rank; and the model must be untouched by all of them."""
    rank, root = dist.get_rank(), Path(root)
    good = root / "good"
    model, opt = _build(stage=3)
    _train(model, opt, 0, 1)
    shardlab.save_checkpoint(model, opt, good)
    if rank == 0:  # damaged copies
        for name in ("missing", "truncated", "corrupt"):
            shutil.copytree(good, root / name)
        (root / "missing" / "shard-00001-of-00002.pt").unlink()
        with open(root / "truncated" / "shard-00000-of-00002.pt", "r+b") as f:
            f.truncate(100)
        with open(root / "corrupt" / "shard-00001-of-00002.pt", "r+b") as f:  # same size, no zip directory
            f.seek(-200, os.SEEK_END)
            f.write(bytes(200))
        (root / "not-a-checkpoint").mkdir()
    comm.all_reduce(torch.zeros(1))  # the copies exist before anyone reads them
    target, target_opt = _build(stage=2, seed=5)
    before = shardlab.full_state_dict(target)
    torch.manual_seed(0)
    other_model, other_opt = shardlab.parallelize(MLP(), stage=3)
    wider, wider_opt = shardlab.parallelize(make_model_wider(), stage=3)
    sgd_model, sgd_opt = _build("sgd", stage=2)
    errors = {
        "no such path": error_of(lambda: shardlab.load_checkpoint(target, target_opt, root / "nowhere")),
        "missing shard": error_of(lambda: shardlab.load_checkpoint(target, target_opt, root / "missing")),
        "truncated shard": error_of(lambda: shardlab.load_checkpoint(target, target_opt, root / "truncated")),
        # at stage 3 each rank reads only its own shard: rank 1 alone finds the damage
        "corrupt shard, one rank": error_of(lambda: shardlab.load_checkpoint(model, opt, root / "corrupt")),
        "not a checkpoint": error_of(lambda: shardlab.load_checkpoint(target, target_opt, root / "not-a-checkpoint")),
        "different model": error_of(lambda: shardlab.load_checkpoint(other_model, other_opt, good)),
        "different shape": error_of(lambda: shardlab.load_checkpoint(wider, wider_opt, good)),
        "other optimizer": error_of(lambda: shardlab.load_checkpoint(sgd_model, sgd_opt, good)),
        "torch optimizer": error_of(lambda: shardlab.load_checkpoint(
            target, torch.optim.SGD(target.parameters(), lr=0.1), good)),
        "plain model": error_of(lambda: shardlab.load_checkpoint(make_model("gpt", 0), None, good)),
        "replace a non-checkpoint": error_of(lambda: shardlab.save_checkpoint(
            target, target_opt, root / "not-a-checkpoint")),
    }
    after = shardlab.full_state_dict(target)
    untouched = all(torch.equal(before[k], after[k]) for k in before) and not target_opt.state
    # weights only: optimizer=None on both sides
    shardlab.save_checkpoint(model, None, root / "weights")
    errors["weights only, loaded with an optimizer"] = error_of(
        lambda: shardlab.load_checkpoint(target, target_opt, root / "weights"))
    shardlab.load_checkpoint(target, None, root / "weights")
    expected, got = shardlab.full_state_dict(model), shardlab.full_state_dict(target)
    weights_only = all(torch.equal(expected[k], got[k]) for k in expected)
    return errors, untouched, weights_only


def make_model_wider() -> nn.Module:
    """The tiny GPT with one block's MLP widened: same names, one shape differs."""
    model = make_model("gpt", 0)
    block = model.blocks[1]
    block.fc, block.out = nn.Linear(32, 130), nn.Linear(130, 32)
    return model


def _as_version_1(meta: dict) -> dict:
    """The metadata format version 1 wrote for the same shard files (they did not change): the
    scalars (``step``) once per unit, taken from its most-stepped parameter (version 1 stepped a
    unit's one flat shard whenever any of its parameters had a gradient), none per parameter."""
    for unit in meta["units"]:
        stepped = [s for s in (p.pop("state") for p in unit["params"]) if s is not None]
        unit["state_scalars"] = max(stepped, key=lambda s: s["step"]["value"]) if stepped else {}
    meta["version"] = 1
    return meta


def _steps(model, opt) -> dict[str, float]:
    """Each parameter's AdamW step count, for the pieces this rank holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: state["step"].item() for unit, states in zip(opt.units, opt.piece_state())
            for p, state in zip(unit.params, states) if state}


def moe_steps_survive(path: str, configs: list[dict]):
    """Expert 0 of a one-unit MoE block gets no gradient at step 0, so after 2 steps its AdamW step
    count is 1 and its unit-mates' 2. Save at stage 3; for each config load the checkpoint (and a
    version-1 copy of it) into a fresh model, record the step counts, train steps 2-3."""
    import json

    import unused_workers as uw

    rank, world_size = dist.get_rank(), dist.get_world_size()
    cls, kw = OPTIMIZERS["adamw"]

    def build(seed=0, stage=3, units=uw.MoEBlock):
        return shardlab.parallelize(uw.make_net("moe-unit-late", seed), stage=stage, optimizer_cls=cls, units=units, **kw)

    def train(model, opt, first, last):
        for step in range(first, last):
            (batch,) = uw.micro_batches("moe-unit-late", step, rank, world_size)
            uw.loss_of(model, *batch).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, 0, 2)
    shardlab.save_checkpoint(model, opt, path)
    v1 = Path(path + "-v1")
    if rank == 0:
        shutil.copytree(path, v1)
        (v1 / "metadata.json").write_text(json.dumps(_as_version_1(json.loads((v1 / "metadata.json").read_text()))))
    comm.all_reduce(torch.zeros(1))  # the copy exists before anyone reads it
    out = []
    for cfg in configs:
        for version, where in ((2, path), (1, str(v1))):
            fresh, fresh_opt = build(seed=5, **cfg)
            meta = shardlab.load_checkpoint(fresh, fresh_opt, where)
            loaded, steps = shardlab.full_state_dict(fresh), _steps(fresh, fresh_opt)
            train(fresh, fresh_opt, 2, 4)
            out.append(dict(cfg=cfg, version=version, meta=meta, steps=steps, loaded=loaded,
                            resumed=shardlab.full_state_dict(fresh)))
    return out
