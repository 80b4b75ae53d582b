"""The course's models: a small GPT whose blocks are the natural FSDP units, and a toy MLP.

Sizes are named so that notebooks, tests and the benchmark talk about the same thing:

========  ======  ====  =====  =====  ==========
name      blocks  d     heads  vocab  parameters
========  ======  ====  =====  =====  ==========
tiny      2       32    2      128    ~0.03 M
small     4       128   4      1024   ~1.1 M
gpt-13m   6       384   6      4096   ~13.8 M  (the benchmark's model)
gpt-1b    18      2048  16     32000  ~1.04 B  (GPUs only: fits on one 80 GB GPU at stage 0)
gpt-7b    32      4096  32     32000  ~6.71 B  (GPUs only: 8 x 80 GB fit it at stage 1-3, not 0)
========  ======  ====  =====  =====  ==========

The two large sizes make the reference example real: 7 B parameters need 16 bytes each at
stage 0 (112 GB, 126 GB with this engine's fp32 gradients), more than an 80 GB GPU; sharded
over 8 GPUs at stage 3 they need 14 (16) GB. Their sequences are 1024 tokens long, so that
activations matter too (``--checkpoint`` in ``python -m shardlab train``).

And :class:`MoE`, a tiny mixture of experts whose expert choice depends on the data, so that a
rank can skip an expert (notebook 05).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 4096
    d: int = 384
    n_layer: int = 6
    n_head: int = 6
    seq: int = 64
    tie_weights: bool = False
    checkpoint: bool = False  # recompute each block in backward instead of saving its activations


SIZES = {
    "tiny": GPTConfig(vocab=128, d=32, n_layer=2, n_head=2, seq=16),
    "small": GPTConfig(vocab=1024, d=128, n_layer=4, n_head=4, seq=32),
    "gpt-13m": GPTConfig(vocab=4096, d=384, n_layer=6, n_head=6, seq=64),
    "gpt-1b": GPTConfig(vocab=32000, d=2048, n_layer=18, n_head=16, seq=1024),
    "gpt-7b": GPTConfig(vocab=32000, d=4096, n_layer=32, n_head=32, seq=1024),
}


class Block(nn.Module):
    """One transformer block: the default FSDP unit (gathered, run, freed as one)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.out = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A nanoGPT-shaped language model. Embeddings, final norm and head belong to the root unit."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.cfg.checkpoint and self.training else block(x)
        return self.head(self.ln_f(x))


def gpt(size: str = "gpt-13m", **overrides) -> GPT:
    """Build the GPT of a named size (see the module docstring)."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    cfg = SIZES[size]
    return GPT(GPTConfig(**{**cfg.__dict__, **overrides}))


def batch(cfg: GPTConfig, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1):
    """This rank's slice of a deterministic global batch of token ids and next-token targets.

    Every rank can rebuild the whole global batch from ``seed``; rank r takes rows
    ``r::world_size``, so the union over ranks is the batch a single process would use.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size * world_size, cfg.seq + 1), generator=g)
    mine = tokens[rank::world_size]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def counting_batch(cfg: GPTConfig, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1):
    """Like :func:`batch`, but text a small model learns in a few dozen steps: each row counts
    up from a random token by a stride of 1, 2 or 3 (mod vocab), e.g. ``5 7 9 11 ...``.

    The next token follows from the previous two, so the loss falls from ln(vocab) (~4.85 for
    the tiny GPT) towards 0 as the model learns to read the stride from its context:
    ``torchrun ... -m shardlab.train`` shows learning, not noise. Generated, not downloaded.
    """
    g = torch.Generator().manual_seed(seed)
    rows = batch_size * world_size
    start = torch.randint(0, cfg.vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    mine = tokens[rank::world_size]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MLP(nn.Module):
    """A toy model with odd sizes (not multiples of 2, 3 or 4) to exercise padding."""

    def __init__(self, sizes=(7, 13, 5), units: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(sizes[0] if i == 0 else sizes[1], sizes[1]), nn.Tanh()) for i in range(units)
        )
        self.head = nn.Linear(sizes[1], sizes[2])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class MoE(nn.Module):
    """A tiny mixture-of-experts regressor: token ``t`` goes to expert ``t % n_experts``.

    Hash routing (as in "Hash Layers", Roller et al. 2021) makes the choice a function of the
    data alone, so a rank whose tokens never hash to an expert skips it, whatever the weights.
    The router still weighs each token's expert output, so the router always gets a gradient.
    Each expert is a child of an ``nn.ModuleList``, so each is its own unit (the default rule);
    an expert no token chose does not run, and its parameters get no gradient on that rank.
    """

    def __init__(self, vocab: int = 12, d: int = 8, n_experts: int = 3):
        super().__init__()
        self.n_experts = n_experts
        self.embed = nn.Embedding(vocab, d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_experts))
        self.head = nn.Linear(d, 1)

    def route(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens % self.n_experts

    def experts_used(self, tokens: torch.Tensor) -> list[int]:
        return sorted(set(self.route(tokens).tolist()))

    def forward(self, tokens):
        h = self.embed(tokens)
        choice = self.route(tokens)
        gate = self.router(h).softmax(-1).gather(1, choice[:, None])
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(1)
            if rows.numel():  # an expert no token chose does not run
                out = out.index_add(0, rows, expert(h[rows]) * gate[rows])
        return self.head(h + out).squeeze(-1)


def moe_batch(model: MoE, experts, batch_size: int, *, seed: int):
    """Tokens that go to exactly ``experts`` (each one at least once), and random targets.

    Token ``i`` goes to ``experts[i % len(experts)]``; which of that expert's tokens it is, and
    the targets, come from ``seed``. So a rank given ``experts=[0]`` never runs experts 1 and 2.
    """
    experts = sorted(set(experts))
    if not experts or not all(0 <= e < model.n_experts for e in experts):
        raise ValueError(f"experts must be a non-empty subset of range({model.n_experts}); got {experts}")
    if batch_size < len(experts):
        raise ValueError(f"batch_size={batch_size} cannot reach {len(experts)} experts; use at least that many")
    g = torch.Generator().manual_seed(seed)
    expert = torch.tensor(experts)[torch.arange(batch_size) % len(experts)]
    per_expert = model.embed.num_embeddings // model.n_experts
    tokens = expert + model.n_experts * torch.randint(0, per_expert, (batch_size,), generator=g)
    return tokens, torch.randn(batch_size, generator=g)
