"""The loops PyTorch users write, run on live ranks and in one process (issue 16's matrix).

Each *shape* is one training step written as a user writes it: several micro-batches with or
without ``no_sync``, two forwards and one backward, a validation forward in between, and so on.
The same function runs in the single-process reference on the global batch (micro-batch ``i``
of the global batch is every rank's micro-batch ``i``, concatenated), so each cell of the matrix
compares one loop with itself, sharded and not.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import shardlab

WIDTH, OUT, PER_RANK, STEPS = 16, 4, 2, 3
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


class Net(nn.Module):
    """Issue 16's model (3 blocks of Linear + Tanh, a Linear head) with an input layer in the root,
    and the variants the matrix needs: a block called twice, blocks under activation
    checkpointing, and two experts chosen per sample (a rank whose samples all pick one expert
    skips the other)."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.variant = variant
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3))
        if variant == "moe":
            self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        route = x[:, 0] > 0  # decided by the input, before any layer (so every process agrees)
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if self.variant.startswith("checkpoint"):
                h = checkpoint(block, h, use_reentrant=self.variant == "checkpoint-reentrant")
            else:
                h = block(h)
            if self.variant == "twice" and i == 0:
                h = block(h)  # the same unit again, in the same forward
        if self.variant == "moe":
            out = torch.zeros_like(h)
            for e, expert in enumerate(self.experts):
                mask = route == bool(e)
                if mask.any():  # no sample chose it: the expert does not run here
                    out = out.index_put((mask,), expert(h[mask]))
            h = h + out
        return self.head(h)


def variant_of(shape: str) -> str:
    return {"checkpoint": "checkpoint", "checkpoint_reentrant": "checkpoint-reentrant",
            "unit_twice": "twice", "moe_skip": "moe"}.get(shape, "plain")


def micro_batches(shape: str) -> int:
    return {"accum4": 4, "accum3_no_sync": 3, "accum3_no_sync_middle": 3}.get(shape, 2)


def shape_at(shape: str, step: int) -> str:
    """The step with no backward is the middle one; the steps around it train."""
    return "accum2" if shape == "no_backward" and step != 1 else shape


def data(step: int, world_size: int, n_micro: int, moe: bool):
    """``(x, y)`` of shape (micro-batch, rank, row, feature). For the MoE shape each rank's rows of
    micro-batch m all pick expert (rank + m) % 2, so every rank skips an expert in every micro-batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n_micro, world_size, PER_RANK, WIDTH, generator=g)
    y = torch.randn(n_micro, world_size, PER_RANK, OUT, generator=g)
    if moe:
        for m in range(n_micro):
            for r in range(world_size):
                x[m, r, :, 0] = x[m, r, :, 0].abs() * (1 if (r + m) % 2 else -1)
    return x, y


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x).float(), y)


def one_step(shape: str, model, opt, batches, no_sync, zero_grad_to_none: bool, clip: float | None):
    """One optimizer step of ``shape`` on ``batches`` (a list of micro-batches). ``no_sync`` is the
    model's context manager on ranks, a null one in the reference; ``clip`` clips the global norm."""
    n = len(batches)
    if shape == "two_forwards_one_backward":
        (sum(loss_fn(model, x, y) for x, y in batches) / n).backward()
    elif shape == "retain_graph_twice":  # one forward, backward twice: the gradients add up
        loss = sum(loss_fn(model, x, y) for x, y in batches) / n
        loss.backward(retain_graph=True)
        loss.backward()
    elif shape == "no_backward":
        with torch.no_grad():
            loss_fn(model, *batches[0])  # a forward, then a step with no backward at all
    else:
        for i, (x, y) in enumerate(batches):
            local = {"accum3_no_sync": i < n - 1, "accum3_no_sync_middle": i == 1}.get(shape, False)
            with no_sync() if local else nullcontext():
                (loss_fn(model, x, y) / n).backward()
            if i == 0 and shape.startswith("validate_"):  # a validation forward between micro-batches
                how = shape.removeprefix("validate_")
                if how == "eval":  # eval() alone keeps autograd on: a graph is built and dropped
                    model.eval()
                    loss_fn(model, x, y)
                    model.train()
                else:
                    with torch.no_grad() if how == "no_grad" else torch.inference_mode():
                        loss_fn(model, x, y)
    if clip is not None:
        clip(model)
    opt.step()
    opt.zero_grad(set_to_none=zero_grad_to_none)


def reference(shape: str, optimizer: str, world_size: int, zero_grad_to_none=True, clip=False):
    """One process on the global batch: the state dict after each of ``STEPS`` steps."""
    torch.manual_seed(0)
    model = Net(variant_of(shape))
    cls, kw = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kw)
    clipper = (lambda m: nn.utils.clip_grad_norm_(m.parameters(), 0.05)) if clip else None
    states = []
    for step in range(STEPS):
        x, y = data(step, world_size, micro_batches(shape), shape == "moe_skip")
        batches = [(x[m].reshape(-1, WIDTH), y[m].reshape(-1, OUT)) for m in range(len(x))]
        one_step(shape_at(shape, step), model, opt, batches, nullcontext, zero_grad_to_none, clipper)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def train(shape: str, stage: int, optimizer: str = "adamw", own_optimizer=False, mixed=False,
          zero_grad_to_none=True, clip=False, **stage3):
    """This rank's run of one cell: per step the full state dict, or ``("error", type, message)``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cls, kw = OPTIMIZERS[optimizer]
    model, opt = shardlab.parallelize(Net(variant_of(shape)), stage=stage, optimizer_cls=cls,
                                      mixed_precision=torch.bfloat16 if mixed else None, **stage3, **kw)
    if own_optimizer:
        opt = cls(model.parameters(), **kw)
    clipper = (lambda m: shardlab.clip_grad_norm_(m, 0.05)) if clip else None
    states = []
    try:
        for step in range(STEPS):
            x, y = data(step, world_size, micro_batches(shape), shape == "moe_skip")
            batches = [(x[m, rank], y[m, rank]) for m in range(len(x))]
            one_step(shape_at(shape, step), model, opt, batches, model.no_sync, zero_grad_to_none, clipper)
            states.append(shardlab.full_state_dict(model))
    except Exception as e:  # noqa: BLE001 - a documented error is a cell's expected outcome
        return ("error", type(e).__name__, str(e))
    return states


def train_many(cells: list[dict]) -> list:
    """Every cell in one process group (starting ranks is the slow part)."""
    return [train(**cell) for cell in cells]


class IssueNet(nn.Module):
    """The model of the report that found the stage-3 accumulation bug: 3 blocks, a head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def issue_report_run(configs=None, world_size=None):
    """SGD lr 0.1, 3 steps of 2 micro-batches (forward, backward, forward, backward, step).
    On ranks: per config the final full state; in one process (``configs`` None): the reference."""
    ranked = configs is not None
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if ranked else (0, world_size)
    out = []
    for cfg in configs if ranked else [None]:
        torch.manual_seed(0)
        model = IssueNet()
        if ranked:
            model, opt = shardlab.parallelize(model, optimizer_cls=torch.optim.SGD, lr=0.1, **cfg)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(2, world_size, 4, 16, generator=g), torch.randn(2, world_size, 4, 4, generator=g)
            for m in range(2):
                xm, ym = (x[m, rank], y[m, rank]) if ranked else (x[m].reshape(-1, 16), y[m].reshape(-1, 4))
                (nn.functional.mse_loss(model(xm), ym) / 2).backward()
            opt.step()
            opt.zero_grad()
        out.append(shardlab.full_state_dict(model) if ranked else model.state_dict())
    return out if ranked else out[0]
