"""The pieces the checks of labs 3-5 hand to a learner's functions, and the references they compare with.

The lab model is a stack of small blocks with no parameters outside them, so every parameter
belongs to a unit and "at most two units gathered" means exactly that. Units are the engine's
own :class:`~shardlab.engine.flat.FlatUnit` (what ShardLab's stages use): ``unit.params``,
``unit.module``, ``unit.full`` (the padded flat weights the parameters view), ``unit.master``
(this rank's shard, at stage 3), ``unit.gather()``, ``unit.free()``, ``unit.is_gathered``.

The d = 50 blocks hold 20,350 elements each: not a multiple of 4, so every unit is padded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.engine import comm, events
from shardlab.engine.flat import FlatUnit

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


def padded_flat(tensors, padded_numel: int) -> torch.Tensor:
    flat = torch.zeros(padded_numel)
    flat[: sum(t.numel() for t in tensors)] = torch.cat([t.reshape(-1) for t in tensors])
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
        params = list(block.parameters())
        numel = sum(p.numel() for p in params)
        padded = -(-numel // world_size) * world_size
        flat = padded_flat([p.grad for p in params], padded)
        dist.all_reduce(flat)  # SUM
        flat /= world_size
        shard = padded // world_size
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


def gathered(units) -> int:
    """How many units hold their full weights now (a gather in flight counts: its memory exists)."""
    return sum(u.is_gathered for u in units)


class Trace:
    """What happened to each unit, in order: gather, free, forward, backward, all_gather, reduce_scatter...

    ``watch(unit)`` wraps the unit's ``gather``/``free`` and hooks its module; communication is
    recorded from the engine's events (``comm`` when issued, ``comm_done`` when waited for).
    ``most_gathered`` is the largest number of units holding full weights at any recorded moment.
    """

    def __init__(self, units):
        self.units = list(units)
        self.log: list[tuple[str, str]] = []
        self.most_gathered = gathered(self.units)
        self._handles = []

    def add(self, what: str, unit_name: str | None) -> None:
        self.log.append((what, unit_name))
        self.most_gathered = max(self.most_gathered, gathered(self.units))

    def watch(self, unit: FlatUnit, *, forward_check=None) -> None:
        gather, free = unit.gather, unit.free

        def traced_gather(*, async_op: bool = False):
            gather(async_op=async_op)
            self.add("prefetch" if async_op else "gather", unit.name)

        def traced_free():
            free()
            self.add("free", unit.name)

        unit.gather, unit.free = traced_gather, traced_free

        def pre(module, args):
            if forward_check is not None:
                forward_check(unit)
            self.add("forward", unit.name)

        self._handles += [unit.module.register_forward_pre_hook(pre),
                          unit.module.register_forward_hook(lambda m, a, o: self.add("forward_done", unit.name))]

    def on_event(self, name: str, fields: dict) -> None:
        if name in ("comm", "comm_done"):
            self.add(fields["kind"] + ("" if name == "comm" else "_done"), fields.get("unit"))

    def listen(self):
        return events.listen(self.on_event)

    def of(self, unit_name: str, kinds=None) -> list[str]:
        return [w for w, u in self.log if u == unit_name and (kinds is None or w in kinds)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-6)
