"""Functions that run on every rank in the multi-process tests (they must be importable)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardlab
from shardlab.models import MLP, batch, gpt, lm_loss

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def make_model(kind: str, seed: int):
    torch.manual_seed(seed)
    return gpt("tiny") if kind == "gpt" else MLP()


def make_batch(kind: str, step: int, rank: int, world_size: int, per_rank: int = 2):
    """Rank ``rank``'s slice of step ``step``'s global batch (world_size * per_rank rows)."""
    if kind == "gpt":
        return batch(gpt("tiny").cfg, per_rank, seed=100 + step, rank=rank, world_size=world_size)
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(per_rank * world_size, 7, generator=g), torch.randn(per_rank * world_size, 5, generator=g)
    return x[rank::world_size], y[rank::world_size]


def loss_of(kind, model, x, y):
    out = model(x)
    return lm_loss(out, y) if kind == "gpt" else torch.nn.functional.mse_loss(out.float(), y)


def reference(kind: str, optimizer: str, world_size: int, steps: int, seed: int = 0):
    """One process training on the concatenated global batch: what every stage must equal."""
    model = make_model(kind, seed)
    cls, kw = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kw)
    for step in range(steps):
        xs, ys = zip(*(make_batch(kind, step, r, world_size) for r in range(world_size)))
        # mean over ranks of per-rank mean losses == mean over the global batch (equal slices)
        loss = sum(loss_of(kind, model, x, y) for x, y in zip(xs, ys)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_stages(kind: str, configs: list[dict], steps: int):
    """Train one fresh model per config on this rank; return each final full state dict."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        cfg = dict(cfg)
        optimizer = cfg.pop("optimizer")
        seed = cfg.pop("seed", 0) + (rank if cfg.pop("different_init", False) else 0)
        model = make_model(kind, seed)
        cls, kw = OPTIMIZERS[optimizer]
        model, opt = shardlab.parallelize(model, optimizer_cls=cls, **kw, **cfg)
        for step in range(steps):
            x, y = make_batch(kind, step, rank, world_size)
            loss_of(kind, model, x, y).backward()
            opt.step()
            opt.zero_grad()
        results.append(shardlab.full_state_dict(model))
    return results
