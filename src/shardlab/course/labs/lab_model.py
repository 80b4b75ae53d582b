"""The lab model of labs 3-5: a stack of blocks, its units, its data, and the references the checks compare with.

The lab model is a stack of small blocks with no parameters outside them, so every parameter
belongs to a unit and "at most two units gathered" means exactly that. Units are the engine's
own :class:`~shardlab.engine.flat.FlatUnit` (what ShardLab's stages use): ``unit.params``,
``unit.module``, ``unit.full`` (the padded flat weights the parameters view), ``unit.master``
(this rank's shard, at stage 3), ``unit.gather()``, ``unit.free()``, ``unit.holds_full``.
Lab 3's answers (:func:`reduce_grads`, :func:`on_grads_ready`) live here too: lab 4 hands them
to the learner.

The d = 50 blocks hold 20,350 elements each: not a multiple of 4, so every unit is padded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # ranks and sizes only: collectives go through comm
import torch.nn as nn
import torch.nn.functional as F

from shardlab.engine import comm
from shardlab.engine.flat import FlatUnit, padded_numel

D, BLOCKS, ROWS = 50, 4, 16


class Block(nn.Module):
    """LayerNorm, an MLP and a residual: one unit."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class Stack(nn.Module):
    """Blocks one after another; every parameter lives in a block (no root unit)."""

    def __init__(self, d: int = D, blocks: int = BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def make_model(d: int = D, blocks: int = BLOCKS, seed: int = 0) -> Stack:
    """The same model on every rank (same seed)."""
    torch.manual_seed(seed)
    return Stack(d, blocks)


def batch(rank: int, step: int, d: int = D, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the data for ``step``: different on every rank, the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def flat_units(model: Stack, *, sharded: bool) -> list[FlatUnit]:
    """One FlatUnit per block. ``sharded``: keep only this rank's shard (``unit.master``), freed."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    units = []
    for i, block in enumerate(model.blocks):
        unit = FlatUnit(f"blocks.{i}", list(block.parameters()), rank=rank, world_size=world_size)
        unit.module = block
        if sharded:
            unit.master = nn.Parameter(unit.my_shard(unit.full).clone())
            unit.free()
        units.append(unit)
    return units


def padded_flat(tensors, world_size: int) -> torch.Tensor:
    """``tensors`` flattened into one buffer, zero padded to a multiple of ``world_size``."""
    numel = sum(t.numel() for t in tensors)
    flat = torch.zeros(padded_numel(numel, world_size))
    flat[:numel] = torch.cat([t.reshape(-1) for t in tensors])
    return flat


def reference_grad_shards(steps: int = 1, d: int = D, blocks: int = BLOCKS) -> list[torch.Tensor]:
    """This rank's shard of each unit's mean gradient, summed over ``steps`` micro-batches.

    The plain way: a whole model per rank, every full gradient kept, one all-reduce, a slice.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(d, blocks)
    for step in range(steps):
        x, y = batch(rank, step, d)
        loss_fn(model(x), y).backward()
    shards = []
    for block in model.blocks:
        flat = padded_flat([p.grad for p in block.parameters()], world_size)
        comm.all_reduce(flat)  # SUM
        flat /= world_size
        shard = flat.numel() // world_size
        shards.append(flat[rank * shard : (rank + 1) * shard].clone())
    return shards


def reduce_grads(unit: FlatUnit) -> torch.Tensor:
    """Lab 3's answer: reduce-scatter the unit's gradients, free the full ones, keep the mean shard.

    The shard is added to ``unit.master.grad`` when the unit has a master (stage 3), and returned.
    """
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)  # the full per-parameter gradients are freed
    shard = torch.empty(unit.shard_numel)
    comm.reduce_scatter(shard, full, unit=unit.name)
    shard /= unit.world_size
    if unit.master is not None:
        unit.master.grad = shard if unit.master.grad is None else unit.master.grad + shard
    return shard


def on_grads_ready(unit: FlatUnit, fn) -> None:
    """Call ``fn()`` once, when every parameter of ``unit`` has its gradient for this backward.

    Lab 3's countdown, one-shot: the hooks remove themselves once ``fn`` has run.
    """
    left = [len(unit.params)]
    handles = []

    def ready(p):
        left[0] -= 1
        if left[0] == 0:
            for h in handles:
                h.remove()
            fn()

    handles += [p.register_post_accumulate_grad_hook(ready) for p in unit.params]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-6)
