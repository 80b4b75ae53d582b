"""Small helpers the notebooks call on the ranks: build a stage, run a step, time steps fairly.

They keep a notebook cell to a few lines without hiding anything the cell is about: the
training step is the plain PyTorch loop, and the timing is "interleave the runs, put every
rank at a barrier before each step, keep each step's seconds". A step lasts as long as its
slowest rank, so the notebook takes, per step, the maximum over ranks (:func:`slowest_median`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.engine.api import parallelize
from shardlab.engine.units import checkpoint_units
from shardlab.instruments.link import LINKS, emulate_link, link_delay


def build(size: str = "small", stage: int = 0, *, seed: int = 0, device=None, checkpoint: bool = False,
          **options):
    """The course GPT of ``size`` at ZeRO ``stage`` with AdamW: ``(model, optimizer)``.

    Every rank builds the same weights from ``seed``. ``checkpoint`` wraps each block in
    activation checkpointing; ``options`` go to :func:`shardlab.parallelize` (``prefetch``,
    ``reshard_after_forward``, ``mixed_precision``).
    """
    torch.manual_seed(seed)
    model = models.gpt(size)
    if device is not None:
        model = model.to(device)
    if checkpoint:
        checkpoint_units(model)
    return parallelize(model, stage=stage, optimizer_cls=torch.optim.AdamW, lr=1e-3, **options)


def data(model, batch_size: int = 8, steps: int = 4, *, seed: int = 0, device=None) -> list:
    """This rank's rows of ``steps`` global batches: every run sees the same data."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = []
    for i in range(steps):
        x, y = models.batch(model.cfg, batch_size, seed=seed * 100_003 + i, rank=rank, world_size=world)
        out.append((x.to(device), y.to(device)) if device is not None else (x, y))
    return out


def train_step(model, optimizer, x, y) -> float:
    """One plain training step; returns the loss."""
    loss = models.lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _link(link):
    """None, a preset name of :data:`LINKS`, or ``{"bandwidth_gbps": .., "latency_us": ..}``."""
    if link is None:
        return None
    if isinstance(link, str):
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; choose one of {list(LINKS)} or pass a dict")
        return {"preset": link}
    return dict(link)


def time_steps(runs: dict, batches: list, *, warmup: int = 1, link=None, overlap: bool = True) -> dict:
    """Seconds of each step of each run on this rank, runs interleaved in rotated rounds.

    ``runs`` maps a name to ``(model, optimizer)``; every round steps each of them once on the
    same batch, each step after a barrier. With ``link`` every step runs under
    :func:`shardlab.emulate_link`. Returns ``{name: {"step_s": [...], "link_s": [...]}}``
    (``link_s``: what the emulated link needed in that step), warm-up rounds left out.
    """
    names = list(runs)
    spec = _link(link)
    out = {n: {"step_s": [], "link_s": []} for n in names}
    for i, (x, y) in enumerate(batches):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            if spec is None:
                train_step(*runs[name], x, y)
                link_s = 0.0
            else:
                with emulate_link(**spec, overlap=overlap) as em:
                    train_step(*runs[name], x, y)
                link_s = em.link_time_s
            seconds = time.perf_counter() - t0
            if i >= warmup:
                out[name]["step_s"].append(seconds)
                out[name]["link_s"].append(link_s)
    return out


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over steps of the slowest rank's seconds (a step ends when its last rank does)."""
    return statistics.median(max(step) for step in zip(*per_rank, strict=True))


def predicted_link_s(records: list[dict], world_size: int, link) -> float:
    """Seconds the collectives of ``records`` (``count_comm().records``) need on ``link``.

    The ring α-β model of :func:`shardlab.instruments.link.link_delay`, summed with nothing
    hidden: the link carries one transfer at a time, so a step cannot be shorter than this.
    """
    spec = _link(link)
    if spec is None:
        return 0.0
    preset = LINKS.get(spec.get("preset"))
    bandwidth = spec.get("bandwidth_gbps", preset.bandwidth_gbps if preset else None)
    latency = spec.get("latency_us", preset.latency_us if preset else 0.0)
    return sum(link_delay(r["kind"], r["numel"], r["dtype"], world_size, bandwidth, latency) for r in records)
