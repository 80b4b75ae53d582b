"""Functions that run on every rank in the engine's multi-process tests (importable by spawn)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import shardlab
from shardlab.models import MLP, batch, gpt, lm_loss

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def make_model(kind: str, seed: int, freeze=()):
    """The tiny GPT ('gpt'), with its head tied to the embedding ('gpt-tied'), with activation
    checkpointing ('gpt-checkpointed'), or the MLP with odd sizes that need padding ('mlp')."""
    torch.manual_seed(seed)
    model = {
        "gpt": lambda: gpt("tiny"),
        "gpt-tied": lambda: gpt("tiny", tie_weights=True),
        "gpt-checkpointed": lambda: gpt("tiny", checkpoint=True),
        "mlp": MLP,
    }[kind]()
    for name, p in model.named_parameters():
        if name.startswith(tuple(freeze)):
            p.requires_grad_(False)
    return model


def make_batch(kind: str, step: int, rank: int, world_size: int, per_rank: int = 2):
    """Rank ``rank``'s slice of step ``step``'s global batch (world_size * per_rank rows)."""
    if kind.startswith("gpt"):
        return batch(gpt("tiny").cfg, per_rank, seed=100 + step, rank=rank, world_size=world_size)
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(per_rank * world_size, 7, generator=g), torch.randn(per_rank * world_size, 5, generator=g)
    return x[rank::world_size], y[rank::world_size]


def loss_of(kind, model, x, y):
    out = model(x)
    return lm_loss(out, y) if kind.startswith("gpt") else nn.functional.mse_loss(out.float(), y)


def reference(kind: str, optimizer: str, world_size: int, steps: int, seed: int = 0, freeze=(), clip=None):
    """One process training on the concatenated global batch: what every stage must equal.

    Returns the final state dict and, per step, the gradient norm before clipping.
    """
    model = make_model(kind, seed, freeze)
    cls, kw = OPTIMIZERS[optimizer]
    opt = cls([p for p in model.parameters() if p.requires_grad], **kw)
    norms = []
    for step in range(steps):
        xs, ys = zip(*(make_batch(kind, step, r, world_size) for r in range(world_size)))
        # the mean of equal-sized per-rank mean losses is the mean over the global batch
        loss = sum(loss_of(kind, model, x, y) for x, y in zip(xs, ys)) / world_size
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train(kind="gpt", optimizer="adamw", steps=3, seed=0, different_init=False, freeze=(),
          clip=None, accumulate=False, **parallel):
    """Train one fresh model with ``parallelize(**parallel)`` on this rank's slice of the data."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(kind, seed + (rank + 1 if different_init else 0), freeze)
    cls, kw = OPTIMIZERS[optimizer]
    model, opt = shardlab.parallelize(model, optimizer_cls=cls, **kw, **parallel)
    norms = []
    for step in range(steps):
        if accumulate:  # two half micro-batches, communicating only after the second
            x, y = make_batch(kind, step, rank, world_size)
            with model.no_sync():
                (loss_of(kind, model, x[:1], y[:1]) / 2).backward()
            (loss_of(kind, model, x[1:], y[1:]) / 2).backward()
        else:
            loss_of(kind, model, *make_batch(kind, step, rank, world_size)).backward()
        norms.append(float(shardlab.clip_grad_norm_(model, clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
    return shardlab.full_state_dict(model), norms


def train_many(configs: list[dict]):
    """Run :func:`train` once per config in one process group (launching ranks is the slow part)."""
    return [train(**cfg) for cfg in configs]


def no_units(module) -> bool:
    """A ``units`` predicate that picks nothing: the root unit holds the whole model."""
    return False


def error_of(fn) -> tuple[str, str]:
    """``(type name, message)`` of what ``fn()`` raises, or ``("no error", "")``: the tests compare them."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return type(e).__name__, str(e)
    return "no error", ""
