"""``python -m shardlab bench``: ShardLab's stages against PyTorch's DDP, ZeRO and fully_shard.

Every configuration (see :mod:`shardlab.bench.configs`) trains its own copy of one model, built
from one seed, on the same batches, inside one process group. Two phases per rank:

1. **Measure** each configuration alone: build it, run a step, then count the memory and the
   communication of a second step (profiling slows a step, so this phase is not timed).
2. **Time** all of them together in interleaved rounds, A B C ... A B C ..., each round in a
   rotated order. Whatever the machine does meanwhile (another job, thermal drift) then hits
   every configuration alike instead of whichever happened to run last. A barrier starts each
   step on all ranks at once; the step's time is the slowest rank's; the median of the timed
   steps (after warm-up) is reported.

The losses of all rows are compared at the end: equal losses (up to float rounding) prove
that every row did the same work, so the times are comparable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.bench import configs as bc
from shardlab.bench.harness import (
    add_common_args,
    batch_at,
    machine_info,
    slowest,
    timed_rounds,
    write_json,
)
from shardlab.engine.comm import barrier
from shardlab.instruments.traffic import volume


def _rank_main(opts: dict) -> dict:
    """Runs on every rank: measure each configuration, then time them all, interleaved."""
    from tqdm.auto import tqdm

    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    configs = [bc.BY_NAME[n] for n in opts["configs"]]

    def make_model():
        torch.manual_seed(opts["seed"])
        return models.gpt(opts["model"]).to(device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
        barrier()

    def step(name, i):
        model, optimizer = runs[name]
        loss = bc.train_step(model, optimizer, *batches[i])
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        return loss

    show = dist.get_rank() == 0 and not opts["quiet"]
    x, y = batch_at(opts, 0, device)
    measured = {}
    for c in tqdm(configs, desc="measure memory + comm", disable=not show):
        measured[c.name] = bc.measure(c, make_model, x, y, device)
        sync()

    runs = {c.name: bc.build(c, make_model(), device) for c in configs}
    batches = [batch_at(opts, i, device) for i in range(opts["warmup"] + opts["steps"])]
    times, losses = timed_rounds(opts["configs"], step, opts["warmup"], opts["steps"], sync,
                                 desc=f"time {len(configs)} configs", show=show)
    losses = {name: [loss.item() for loss in ls] for name, ls in losses.items()}
    params = sum(p.numel() for p in make_model().parameters())
    return dict(times=times, losses=losses, measured=measured, params=params)


def run(opts: dict) -> dict:
    """Launch the ranks and fold their answers into one result per configuration."""
    from shardlab.launch import run_ranks

    backend = "nccl" if opts["device"] == "cuda" else "gloo"
    t0 = time.perf_counter()
    per_rank = run_ranks(_rank_main, opts["world_size"], opts, timeout=opts["timeout"], backend=backend,
                         threads=opts["threads"])
    wall = time.perf_counter() - t0
    return summarize(opts, per_rank, wall)


def summarize(opts: dict, per_rank: list[dict], wall: float) -> dict:
    """Per configuration: median of the slowest rank's step times, memory, traffic, final loss."""
    params, n = per_rank[0]["params"], opts["world_size"]
    tokens = opts["batch"] * n * models.SIZES[opts["model"]].seq
    rows = {}
    for name in opts["configs"]:
        steps = slowest([r["times"][name] for r in per_rank])
        losses = [sum(r["losses"][name][i] for r in per_rank) / n for i in range(len(per_rank[0]["losses"][name]))]
        comm = per_rank[0]["measured"][name]["comm"]
        median = statistics.median(steps)
        rows[name] = dict(
            note=bc.BY_NAME[name].note,
            step_s=median, best_s=min(steps), steps_s=steps, tokens_per_s=tokens / median,
            states_bytes=max(r["measured"][name]["states"] for r in per_rank),
            peak_bytes=max(r["measured"][name]["peak"] for r in per_rank),
            formula_bytes=bc.model_states_formula(bc.BY_NAME[name], params, n),
            comm={k: v for k, v in comm.items() if not k.endswith("_bytes")},
            comm_volume_psi=bc.paper_volume(comm) / params,
            comm_bytes=sum(volume(k.removesuffix("_bytes"), v) for k, v in comm.items() if k.endswith("_bytes")),
            loss=losses[-1], losses=losses,
        )
    for base in (bc.DDP, bc.FSDP):
        for row in rows.values():
            row[f"vs_{base}"] = row["step_s"] / rows[base]["step_s"] if base in rows else None
    final = [r["loss"] for r in rows.values()]
    trajectory = [max(abs(a - b) / abs(b) for a, b in zip(r["losses"], rows[opts["configs"][0]]["losses"]))
                  for r in rows.values()]
    return dict(
        options=opts, params=params, tokens_per_step=tokens, wall_s=wall, rows=rows,
        loss_disagreement=(max(final) - min(final)) / abs(min(final)),
        loss_trajectory_disagreement=max(trajectory),
        machine=machine_info(opts.get("load_before")),
    )


def parse(argv) -> dict:
    ap = argparse.ArgumentParser(prog="python -m shardlab bench", description=__doc__.split("\n\n")[0])
    add_common_args(ap, model="gpt-13m", steps_per="configuration", timeout=1200)
    ap.add_argument("--configs", default=",".join(c.name for c in bc.CONFIGS),
                    help="comma-separated subset of: " + ", ".join(c.name for c in bc.CONFIGS))
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="cuda = NCCL, one GPU per rank (auto: cuda when there are enough GPUs)")
    ap.add_argument("--plot", metavar="PATH", help="save a step-time and memory figure (PNG)")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: tiny model, 2 steps, 1 warm-up")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.warmup, args.batch = "tiny", 2, 1, 2
    unknown = [n for n in args.configs.split(",") if n not in bc.BY_NAME]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {list(bc.BY_NAME)}")
    if args.steps < 1 or args.warmup < 0 or args.world_size < 1 or args.batch < 1:
        ap.error("--steps, --world-size and --batch must be >= 1 and --warmup >= 0")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "cpu"
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        ap.error(f"--device cuda needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
    opts = vars(args) | dict(configs=args.configs.split(","), load_before=os.getloadavg())
    return opts


def main(argv=None) -> int:
    from shardlab.bench import report as bench_report

    opts = parse(sys.argv[1:] if argv is None else argv)
    result = run(opts)
    print(bench_report.table(result))
    write_json(result, opts["json"])
    if opts["plot"]:
        bench_report.plot(result, opts["plot"])
        print(f"figure written to {opts['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
