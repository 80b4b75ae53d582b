"""Rank functions for the engine's behaviour tests: state dicts, buffers, bad input."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from workers import error_of, loss_of, make_batch, make_model

import shardlab
from shardlab.models import MLP


def round_trip(configs: list[dict]):
    """full_state_dict -> load_full_state_dict into a different model -> full_state_dict."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for cfg in configs:
        model, opt = shardlab.parallelize(make_model("gpt", 0), **cfg)
        x, y = make_batch("gpt", 0, rank, world_size)
        loss_of("gpt", model, x, y).backward()
        opt.step()
        saved = shardlab.full_state_dict(model)
        other, _ = shardlab.parallelize(make_model("gpt", 7), **cfg)
        shardlab.load_full_state_dict(other, saved)
        with torch.no_grad():  # the loaded weights are the ones the model computes with
            same_output = torch.equal(model(x), other(x))
        out.append((saved, shardlab.full_state_dict(other), same_output))
    return out


class WithBuffer(MLP):
    def __init__(self, rank: int):
        super().__init__()
        self.register_buffer("scale", torch.full((3,), float(rank)))


def buffers_from_rank0():
    model, _ = shardlab.parallelize(WithBuffer(dist.get_rank()), stage=3)
    return model.scale.clone()


class SharedAcrossUnits(nn.Module):
    """The same Linear weight used by two blocks: two units would both own it."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))
        self.blocks[0][0].weight = shared.weight
        self.blocks[1][0].weight = shared.weight


class Reversed(nn.Module):
    """Runs its blocks in reverse registration order: stage 3's fixed walk cannot follow."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for block in reversed(self.blocks):
            x = torch.tanh(block(x))
        return x


def _reversed_backward():
    model, _ = shardlab.parallelize(Reversed(), stage=3)
    model(torch.randn(2, 4)).sum().backward()


def bad_inputs():
    """Each bad call's exception type and message (all ranks must raise, none may hang)."""
    rank = dist.get_rank()
    wrapped, _ = shardlab.parallelize(MLP(), stage=2)
    return {
        "stage 5": error_of(lambda: shardlab.parallelize(MLP(), stage=5)),
        "not a module": error_of(lambda: shardlab.parallelize(lambda x: x, stage=3)),
        "already wrapped": error_of(lambda: shardlab.parallelize(wrapped, stage=3)),
        "empty model": error_of(lambda: shardlab.parallelize(nn.Sequential(), stage=3)),
        "optimizer not a class": error_of(lambda: shardlab.parallelize(MLP(), optimizer_cls="adam")),
        "tied across units": error_of(lambda: shardlab.parallelize(SharedAcrossUnits(), stage=3)),
        "different models": error_of(lambda: shardlab.parallelize(MLP(units=2 + rank), stage=3)),
        "state dict of a plain model": error_of(lambda: shardlab.full_state_dict(MLP())),
        "missing key": error_of(lambda: shardlab.load_full_state_dict(
            wrapped, {k: v for k, v in shardlab.full_state_dict(wrapped).items() if k != "head.bias"})),
        "units of a wrong type": error_of(lambda: shardlab.parallelize(MLP(), units=3)),
        "stage-3 option at stage 1": error_of(lambda: shardlab.parallelize(MLP(), stage=1, prefetch=False)),
        "units out of order at stage 3": error_of(_reversed_backward),  # last: it leaves a broken model
    }


def _sgd_step(stage: int, twice: bool, **parallel):
    """One SGD step after backward twice on one graph, or once on the doubled loss."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, opt = shardlab.parallelize(make_model("gpt", 0), stage=stage, optimizer_cls=torch.optim.SGD,
                                      lr=0.1, **parallel)
    loss = loss_of("gpt", model, *make_batch("gpt", 0, rank, world_size))
    if twice:
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        (2 * loss).backward()
    opt.step()
    return shardlab.full_state_dict(model)


def second_backward_on_one_graph(stages):
    return [(_sgd_step(s, twice=True), _sgd_step(s, twice=False)) for s in stages]


def clipped_master_norms(configs):
    """After clip_grad_norm_(model, 1e-3): the norm of what the optimizer will step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for cfg in configs:
        model, _ = shardlab.parallelize(make_model("gpt", 0), **cfg)
        loss_of("gpt", model, *make_batch("gpt", 0, rank, world_size)).backward()
        before = float(shardlab.clip_grad_norm_(model, 1e-3))
        engine = shardlab.engine_of(model)
        squares = sum(u.master.grad.double().pow(2).sum() for u in engine.units)
        if engine.shards_optimizer_state:  # shards: add up the ranks' squares
            dist.all_reduce(squares)
        out.append((before, float(squares.sqrt())))
    return out
