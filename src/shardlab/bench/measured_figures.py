"""Figures measured on live ranks: the stage-3 timeline with and without prefetch, and memory over time.

These are the course's pictures of FSDP at work, so they must come from real ranks, never from
synthetic data. One launch of 2 ranks trains the course GPT at stage 3 and records one
steady-state step three ways: traced with prefetch, traced without, and with its memory
tracked (kept apart from the traces, because tallying memory at every event slows the step
it would be timing). ``python -m shardlab figures --measured`` draws them into figures/.

Their pixels change from run to run (timings), so ``figures --check`` and the byte-compare
test leave them out; ``tests/test_measured_figures.py`` checks that they draw.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from shardlab.bench import figures
from shardlab.instruments import plots
from shardlab.models import batch, gpt, lm_loss

MODEL = "small"  # 4 blocks + the root: enough units to see gather -> compute -> free repeat
WORLD_SIZE = 2
BATCH = 8  # sequences per rank; the small GPT's blocks then compute for a few ms each


def _record(size: str, per_rank: int) -> dict:
    """Runs on every rank: one traced step with prefetch, one without, one memory-tracked step."""
    from shardlab.engine.api import parallelize
    from shardlab.instruments.memory import track_memory
    from shardlab.instruments.timeline import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for prefetch in (True, False):
        torch.manual_seed(0)
        model, opt = parallelize(gpt(size), stage=3, optimizer_cls=torch.optim.AdamW, lr=1e-3,
                                          prefetch=prefetch)

        def step(i, model=model, opt=opt):
            x, y = batch(model.cfg, per_rank, seed=1000 + i, rank=rank, world_size=world_size)
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        for i in range(2):  # warm-up: optimizer state exists
            step(i)
        with trace() as tr:
            step(2)
        out["prefetch" if prefetch else "no_prefetch"] = tr.events
        if prefetch:
            with track_memory(model, opt) as mem:
                step(3)
            out["memory"] = mem.gather()
    return out


@functools.cache
def measure(size: str = MODEL, world_size: int = WORLD_SIZE, per_rank: int = BATCH) -> dict:
    """Launch the ranks once and return rank 0's copy of everything (cached per process)."""
    from shardlab.launch import run_ranks

    return run_ranks(_record, world_size, size, per_rank, timeout=180)[0]


def _short(unit):
    """'blocks.3' -> 'b3', so a block's label fits inside its few-ms bar."""
    return f"b{unit.rsplit('.', 1)[1]}" if unit and unit.startswith("blocks.") else unit


def timeline_figure(events: list[dict], prefetch: bool, size: str = MODEL):
    """The traced step as a Gantt chart, titled with what it shows."""
    how = "with prefetch" if prefetch else "without prefetch"
    # No step time in the title: one step on a shared CPU is noise, and on loopback gloo's
    # transfers use the same cores as compute, so prefetch need not shorten it (slow-link does).
    title = f"FSDP (stage 3), {size} GPT, {1 + max(e['rank'] for e in events)} ranks: one step {how}"
    why = ("the next unit's all-gather is\nissued before this unit computes,\nand runs under it" if prefetch
           else "compute waits for each\nunit's all-gather")
    note = (f"{why}\n\nb0-b3 = blocks.0-3\nroot = embeddings, final norm,\nhead (its bar contains the\nblocks')\n"
            "comm bars run from issue\nto wait")
    fig = plots.timeline([dict(e, name=_short(e.get("unit"))) for e in events], title=title, note=note)
    return fig


CATEGORY_NAMES = {"params": "params (this rank's shard)", "optimizer": "optimizer state (shard)",
                  "gathered": "gathered units (borrowed)", "grads": "grads (shard + in flight)",
                  "activations": "activations (saved for backward)"}


def memory_figure(samples: list[dict], size: str = MODEL):
    """Memory by category per rank over one stage-3 step, with forward, backward and step marked."""
    rows = [dict(s, bytes={CATEGORY_NAMES.get(k, k): v for k, v in s["bytes"].items() if v}) for s in samples]
    firsts = {}
    for s in sorted((s for s in samples if s["rank"] == 0), key=lambda s: s["time"]):
        label = {"model_forward": "forward", "step_start": "step"}.get(s["event"])
        if s["phase"] == "backward" and s["event"] != "model_forward_done":
            label = "backward"
        if label:
            firsts.setdefault(label, s["time"])
    marks = sorted((t, label) for label, t in firsts.items())
    return plots.memory_over_time(rows, unit="MB", marks=marks,
                                  title=f"FSDP (stage 3) memory over one step, {size} GPT, per rank\nthe shard at rest, "
                                        "gathered units borrowed (steps up) and freed (steps down)")


@figures.register("timeline_prefetch", measured=True)
def _timeline_prefetch():
    """Stage 3, 2 ranks, one traced step with prefetch: gathers overlap compute."""
    return timeline_figure(measure()["prefetch"], prefetch=True)


@figures.register("timeline_no_prefetch", measured=True)
def _timeline_no_prefetch():
    """Stage 3, 2 ranks, one traced step without prefetch: each gather before its compute."""
    return timeline_figure(measure()["no_prefetch"], prefetch=False)


@figures.register("memory_over_time", measured=True)
def _memory_over_time():
    """Stage 3, 2 ranks, memory by category over one step: shard, gathered spikes, frees."""
    return memory_figure(measure()["memory"])
