"""What both benchmarks share: the same batches, interleaved timed rounds, the slowest rank, JSON.

``python -m shardlab bench`` (:mod:`shardlab.bench.run`) and ``python -m shardlab slow-link``
(:mod:`shardlab.bench.slow_link`) measure different things the same way, so the way lives here:
every configuration sees the same data, configurations run interleaved in rotated rounds (so
whatever else the machine does hits them all alike), and a step takes as long as its slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.instruments.measured import Measured


def add_common_args(ap: argparse.ArgumentParser, *, model: str, steps_per: str, timeout: float) -> None:
    """The options both benchmarks take, with each one's defaults."""
    ap.add_argument("--model", default=model, choices=sorted(models.SIZES), help=f"model size (default {model})")
    ap.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--steps", type=int, default=10, help=f"timed steps per {steps_per} (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8; × seq tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU (default 1)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON ('-' for stdout)")
    ap.add_argument("--timeout", type=float, default=timeout, help="give up after this many seconds")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")


def batch_at(opts: dict, step: int, device: torch.device | None = None):
    """This rank's rows of step ``step``'s global batch: every configuration sees the same data."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = models.batch(models.SIZES[opts["model"]], opts["batch"], seed=opts["seed"] * 100_000 + step,
                        rank=rank, world_size=world_size)
    return (x, y) if device is None else (x.to(device), y.to(device))


def timed_rounds(items: list, step_fn, warmup: int, steps: int, sync, desc: str = "", show: bool = False):
    """Run ``step_fn(item, step)`` for every item in ``warmup + steps`` interleaved rounds.

    Each round runs the items in a rotated order (A B C, B C A, ...), each step after ``sync()``
    (a barrier: all ranks start together). Returns ``(times, outs)``: per item, the seconds of
    each timed step (warm-up rounds left out; ``Measured``) and ``step_fn``'s return value of every round.
    """
    from tqdm.auto import tqdm

    times = {item: [] for item in items}
    outs = {item: [] for item in items}
    for step in tqdm(range(warmup + steps), desc=desc, disable=not show):
        shift = step % len(items)
        for item in items[shift:] + items[:shift]:  # interleaved, rotated rounds
            sync()
            t0 = time.perf_counter()
            out = step_fn(item, step)
            elapsed = Measured(time.perf_counter() - t0, by="timed_rounds")
            if step >= warmup:
                times[item].append(elapsed)
            outs[item].append(out)
    return times, outs


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's value: a step ends when its last rank does."""
    return [max(step) for step in zip(*per_rank, strict=True)]


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over steps of the slowest rank's value."""
    return statistics.median(slowest(per_rank))


def machine_info(load_before=None) -> dict:
    """Where the numbers were measured: cores, versions, load average before and after."""
    return dict(cores=os.cpu_count(), torch=torch.__version__, python=sys.version.split()[0],
                load_before=load_before, load_after=os.getloadavg())


def write_json(result: dict, path: str | None) -> None:
    """Write ``result`` as JSON to ``path`` ('-': stdout; None: nowhere)."""
    if not path:
        return
    text = json.dumps(result, indent=1, default=str)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
