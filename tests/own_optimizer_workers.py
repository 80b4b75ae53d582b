"""Rank functions for bring-your-own-optimizer (issue 8 §3): torch.optim.X(model.parameters())."""

from __future__ import annotations

import torch
import torch.distributed as dist
from workers import OPTIMIZERS, loss_of, make_batch, make_model

import shardlab
from shardlab.engine.api import engine_of
from shardlab.instruments.memory import memory_report


def fsdp2_loop_vs_returned(configs: list[dict], steps: int = 3) -> list[tuple[dict, dict]]:
    """Per config: the full state after ``steps`` with the returned optimizer, and with the user's own."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for cfg in configs:
        cls, kw = OPTIMIZERS[cfg.get("optimizer", "adamw")]
        states = []
        for own in (False, True):
            model, opt = shardlab.parallelize(make_model("gpt", 0), stage=3, optimizer_cls=cls,
                                              mixed_precision=cfg.get("mixed_precision"), **kw)
            if own:
                opt = cls(model.parameters(), **kw)
            for step in range(steps):
                loss_of("gpt", model, *make_batch("gpt", step, rank, world_size)).backward()
                shardlab.clip_grad_norm_(model, cfg.get("clip", float("inf")))
                opt.step()
                opt.zero_grad()
            states.append(shardlab.full_state_dict(model))
        out.append(tuple(states))
    return out


def grads_after_backward(mixed_precision=None) -> dict:
    """Stage 3's p.grad (shape, dtype, value) beside stage 0's full mean gradient, same data."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batch = make_batch("gpt", 0, rank, world_size)
    full, _ = shardlab.parallelize(make_model("gpt", 0), stage=0)
    loss_of("gpt", full, *batch).backward()
    mean = {n: p.grad.clone() for n, p in full.named_parameters()}
    model, _ = shardlab.parallelize(make_model("gpt", 0), stage=3, mixed_precision=mixed_precision)
    loss_of("gpt", model, *batch).backward()
    engine = engine_of(model)
    where = {id(p): (u, i) for u in engine.units for i, p in enumerate(u.params)}
    rows = {}
    for name, p in model.named_parameters():
        unit, i = where[id(p)]
        a, b = unit.ranges(unit.master)[i]
        start = unit.rank * unit.shard_numel + a - sum(unit.numels[:i])  # piece's offset in the param
        expected = mean[name].reshape(-1)[start : start + (b - a)]
        rows[name] = dict(param_shape=tuple(p.shape), grad=None if p.grad is None else p.grad.clone(),
                          param_dtype=p.dtype, expected=expected, full_numel=mean[name].numel())
    return rows


def user_optimizer_errors() -> dict:
    """The message (or 'no error') of a user optimizer's first step() per configuration."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for label, kw in {"stage 0": dict(stage=0), "stage 1": dict(stage=1), "stage 2": dict(stage=2),
                      "stage 0 bf16": dict(stage=0, mixed_precision=torch.bfloat16), "stage 3": dict(stage=3)}.items():
        model, _ = shardlab.parallelize(make_model("gpt", 0), **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = shardlab.full_state_dict(model)
        loss_of("gpt", model, *make_batch("gpt", 0, rank, world_size)).backward()
        try:
            opt.step()
            after = shardlab.full_state_dict(model)
            out[label] = ("no error", all(not torch.equal(before[k], after[k]) for k in ("tok.weight", "head.weight")))
        except RuntimeError as e:
            out[label] = (str(e), False)
    return out


def memory_with_each_optimizer() -> tuple[dict, dict, dict]:
    """memory_report at rest after one step, with the returned optimizer and with the user's own."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reports = []
    for own in (False, True):
        model, opt = shardlab.parallelize(make_model("gpt", 0), stage=3, optimizer_cls=torch.optim.AdamW)
        if own:
            opt = torch.optim.AdamW(model.parameters())
        loss_of("gpt", model, *make_batch("gpt", 0, rank, world_size)).backward()
        opt.step()
        reports.append(dict(memory_report(model, opt)))
    units = engine_of(model).units
    layout = dict(real=sum(b - a for u in units for a, b in u.ranges(u.master)),
                  shard=sum(u.shard_numel for u in units), units=len(units),
                  pieces=sum(b > a for u in units for a, b in u.ranges(u.master)),
                  params=sum(len(u.params) for u in units))
    return reports[0], reports[1], layout
