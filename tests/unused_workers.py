"""Rank functions for issue 13: parameters that get no gradient on some ranks, or on all.

The net: input layer, three blocks (the middle one a mixture of experts), head. Which experts a
sample uses is given with the data (``choice``), so a test decides exactly which rank skips
what; a router still weighs each expert's output, so the router always gets a gradient.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from workers import OPTIMIZERS

import shardlab

N_EXPERTS, D, PER_RANK = 3, 6, 4


class Plain(nn.Module):
    def __init__(self, spare: bool):
        super().__init__()
        self.fc = nn.Linear(D, D)
        if spare:  # a parameter that forward never uses
            self.spare = nn.Parameter(torch.randn(D))

    def forward(self, h, choice):
        return h + torch.tanh(self.fc(h))


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, N_EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(N_EXPERTS))  # each one a unit

    def forward(self, h, choice):
        gate = self.router(h).softmax(-1).gather(1, choice[:, None])
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(1)
            if rows.numel():  # an expert no sample chose does not run
                out = out.index_add(0, rows, expert(h[rows]) * gate[rows])
        return h + out


class Net(nn.Module):
    def __init__(self, spare: bool = False):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.ModuleList([Plain(spare), MoEBlock(), Plain(spare)])
        self.head = nn.Linear(D, 3)

    def forward(self, x, choice, skip_last=False):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if not (skip_last and i == 2):
                h = block(h, choice)
        return self.head(h)


CASES = {
    "odd": "the last block runs on odd steps only (every rank alike)",
    "spare": "a parameter inside each plain block that forward never uses",
    "moe": "each expert unused on one rank (expert r skipped by rank r)",
    "moe-random": "experts chosen at random per sample: the unused set changes every step",
    "moe-unit": "as 'moe', with the whole MoE block one unit (units=MoEBlock)",
    "moe-unit-random": "as 'moe-random', with the whole MoE block one unit",
    "no-sync-skip": "two micro-batches under no_sync; rank 1 skips the last block in both, rank 0 in the first",
}


def micro_batches(case: str, step: int, rank: int, world_size: int) -> list[tuple]:
    """Rank ``rank``'s micro-batches of step ``step``: (x, y, choice, skip_last)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    n_micro = 2 if case == "no-sync-skip" else 1
    out = []
    for micro in range(n_micro):
        x, y = torch.randn(PER_RANK, 5, generator=g), torch.randn(PER_RANK, 3, generator=g)
        if case.endswith("random"):
            choice = torch.randint(0, N_EXPERTS, (PER_RANK,), generator=g)
        elif case.endswith("late"):  # expert 0 unused by every rank at step 0 only
            choice = torch.arange(PER_RANK) % N_EXPERTS if step else torch.tensor([1, 2] * (PER_RANK // 2))
        elif case in ("moe", "moe-unit"):
            used = [e for e in range(N_EXPERTS) if e != rank % N_EXPERTS]
            choice = torch.tensor([used[i % len(used)] for i in range(PER_RANK)])
        else:
            choice = torch.arange(PER_RANK) % N_EXPERTS
        skip = (case == "odd" and step % 2 == 0) or (case == "no-sync-skip" and (rank == 1 or micro == 0 and rank == 0))
        out.append((x, y, choice, skip))
    return out


def make_net(case: str, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(spare=case == "spare")


def loss_of(model, x, y, choice, skip):
    return nn.functional.mse_loss(model(x, choice, skip), y)


def reference(case: str, optimizer: str, world_size: int, steps: int = 4) -> list[dict]:
    """One process on every rank's data: the state dict after each step."""
    model = make_net(case)
    cls, kw = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kw)
    states = []
    for step in range(steps):
        for rank in range(world_size):
            batches = micro_batches(case, step, rank, world_size)
            for batch in batches:
                (loss_of(model, *batch) / (len(batches) * world_size)).backward()
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def train(case: str, stage: int, optimizer: str, steps: int = 4, own_optimizer: bool = False) -> list[dict]:
    """Train with ``parallelize``; the full state dict after each step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cls, kw = OPTIMIZERS[optimizer]
    units = MoEBlock if case.startswith("moe-unit") else None
    model, opt = shardlab.parallelize(make_net(case), stage=stage, optimizer_cls=cls, units=units, **kw)
    if own_optimizer:  # the FSDP2 habit: a plain torch optimizer on model.parameters()
        opt = cls(model.parameters(), **kw)
    states = []
    for step in range(steps):
        batches = micro_batches(case, step, rank, world_size)
        for i, batch in enumerate(batches):
            with model.no_sync() if i < len(batches) - 1 else nullcontext():
                (loss_of(model, *batch) / len(batches)).backward()
        opt.step()
        opt.zero_grad()
        states.append(shardlab.full_state_dict(model))
    return states


def train_many(configs: list[dict]) -> list[list[dict]]:
    return [train(**cfg) for cfg in configs]


def train_warned(configs: list[dict]) -> list[tuple[list[dict], list[str]]]:
    """``train`` for each config, with the messages of the RuntimeWarnings it raised."""
    out = []
    for cfg in configs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            states = train(**cfg)
        out.append((states, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]))
    return out


def train_ddp(configs: list[dict]) -> list[tuple[list[dict], list[str]]]:
    """PyTorch's DDP (``find_unused_parameters``) with ``ZeroRedundancyOptimizer`` or
    ``shardlab.ShardedOptimizer``: the state dict after each step, and the RuntimeWarnings."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for cfg in configs:
        cls, kw = OPTIMIZERS[cfg["optimizer"]]
        net = make_net(cfg["case"])
        model = DistributedDataParallel(net, find_unused_parameters=True)
        if cfg["system"] == "zero_redundancy":
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kw)
        else:
            opt = shardlab.ShardedOptimizer(model.parameters(), cls, **kw)
        states = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(4):
                (batch,) = micro_batches(cfg["case"], step, rank, world_size)
                loss_of(model, *batch).backward()
                opt.step()
                opt.zero_grad()
                states.append({k: v.detach().clone() for k, v in net.state_dict().items()})
        out.append((states, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]))
    return out


def spare_after_one_step() -> list[tuple[bool, bool]]:
    """Per stage: (``spare.grad`` is None after backward, ``spare`` unchanged after a step)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for stage in range(4):
        model, opt = shardlab.parallelize(make_net("spare"), stage=stage, optimizer_cls=torch.optim.AdamW,
                                          lr=1e-2, weight_decay=0.1)
        before = shardlab.full_state_dict(model)["blocks.0.spare"]
        loss_of(model, *micro_batches("spare", 0, rank, world_size)[0]).backward()
        grad_is_none = model.blocks[0].spare.grad is None
        opt.step()
        out.append((grad_is_none, torch.equal(shardlab.full_state_dict(model)["blocks.0.spare"], before)))
    return out


# -- a gradient so small that rounding makes it -0.0 (round 3, M1) ----------------------------
# case: (the model's dtype, mixed_precision, the gradient rank 0 alone gives ``p``, and why it
# reaches the reduced gradient as -0.0 unless the engine keeps "-0.0 only if no rank sent one")
TINY = {
    "cast": (torch.float32, shardlab.MixedPrecision(torch.float32, torch.float16), -1e-8),  # fp16 pack rounds it
    "divide": (torch.float32, None, -(2.0**-149)),  # fp32's smallest: the sum / N rounds it
    "divide-fp16": (torch.float32, shardlab.MixedPrecision(torch.bfloat16, torch.float16), -(2.0**-24)),
    "bf16-master": (torch.bfloat16, shardlab.MixedPrecision(torch.bfloat16, torch.float32), -(2.0**-133)),
    "accumulate": (torch.float32, None, -(2.0**-149)),  # two synced backwards, p used in the second only
    "accumulate-first": (torch.float32, None, -(2.0**-149)),  # ... in the first only
}
PASSES = {"accumulate": ["none", "tiny"], "accumulate-first": ["tiny", "none"]}  # else one backward


class Probe(nn.Module):
    """One unit (the root) of two params: ``p`` has 5 elements, so at stage 3 each of 2 or 3
    ranks holds a piece of it; ``q`` is used by every rank, so no rank skips the unit."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.p = nn.Parameter(torch.randn(5, dtype=dtype))
        self.q = nn.Parameter(torch.randn(1, dtype=dtype))

    def forward(self, c):
        out = (self.q * self.q).sum()
        return out if c is None else out + (self.p * c).sum()  # p's gradient is exactly c


def train_tiny(case: str, stage: int) -> tuple[bool, dict, dict]:
    """One step where rank 0 alone gives ``p`` the case's tiny gradient: (this rank says p was
    used, the full state dict before the step, after it). AdamW's weight decay moves every
    element of a param that is stepped, even with a zero gradient."""
    dtype, precision, tiny = TINY[case]
    model, opt = shardlab.parallelize(Probe(dtype), stage=stage, mixed_precision=precision,
                                      optimizer_cls=torch.optim.AdamW, lr=0.1, weight_decay=0.5)
    before = shardlab.full_state_dict(model)
    for use in PASSES.get(case, ["tiny"]):
        model(torch.full((5,), tiny, dtype=dtype) if use == "tiny" and dist.get_rank() == 0 else None).backward()
    unit = next(u for u in shardlab.engine_of(model).units if any(x is model.p for x in u.params))
    used = [i for i, x in enumerate(unit.params) if x is model.p][0] not in unit.unused
    opt.step()
    return used, before, shardlab.full_state_dict(model)


def train_tiny_many(configs: list[dict]) -> list[tuple[bool, dict, dict]]:
    return [train_tiny(**cfg) for cfg in configs]
