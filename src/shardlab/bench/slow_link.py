"""``python -m shardlab slow-link``: stage 0 and stage 3 on emulated links, measured beside the ring model.

On one machine the ranks talk through loopback memory, so ZeRO-3's extra all-gathers look
free. This benchmark trains the course GPT at stage 0 (DDP: all-reduce, 2Ψ a step) and stage 3
(FSDP: all-gather twice and reduce-scatter, 3Ψ minus the root unit, which stays gathered) under
:func:`shardlab.emulate_link` for each link preset, and prints per link:

* the measured step time (median over steps of the slowest rank) and its increase over no link;
* the predicted increase: :func:`shardlab.instruments.link.link_delay` summed over the step's collectives,
  as :func:`shardlab.count_comm` booked them. That is the non-overlapped bound: it assumes no
  transfer hides behind compute;
* the same step with ``overlap=False`` (every op sleeps its full link time, as if each
  collective blocked) and with overlap (the emulator's default: a transfer runs while the rank
  computes), where ``hidden`` is the share of the link time that overlapped compute (DDP's
  all-reduces during backward, FSDP's prefetched gathers and async reduce-scatters).

Without overlap, stage 3 pays for its extra bytes: 1.5x stage 0's at 3Ψ, a little less here
because the root unit stays gathered from forward to backward. With overlap, prefetch hides
much of it: that is why FSDP prefetches.

The link charges the ring's bytes (the ledger's ``ring_bytes``), as NCCL's rings would send
them on GPUs, not the bytes gloo writes on loopback, which for a reduce-scatter are twice the
ring's (:mod:`shardlab.instruments.wire`). So stage 3's predicted and emulated costs are those of
a GPU cluster's ring, and the MB per rank it prints are the ring formula, not a measurement.

Configurations run interleaved in rotated rounds, as ``python -m shardlab bench`` does, so that
whatever else the machine does hits every (stage, link) pair alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.bench.harness import (
    add_common_args,
    batch_at,
    machine_info,
    slowest_median,
    timed_rounds,
    write_json,
)
from shardlab.bench.report import SHORT
from shardlab.engine.comm import barrier
from shardlab.instruments.link import LINKS, find_link, link_delay
from shardlab.instruments.traffic import ring_bytes, volume

STAGES = (0, 3)
DEFAULT_LINKS = ("none", "NVLink", "InfiniBand", "10GbE", "1GbE")


def parse_link(spec: str) -> dict:
    """'none', a network name (:func:`find_link`: '10GbE', 'ib-ndr', ...), or a custom 'GBPS:US' (e.g. '0.1:100')."""
    if spec == "none":
        return dict(name=spec, bandwidth_gbps=None, latency_us=None)
    if ":" not in spec:
        link = find_link(spec)
        return dict(name=spec, bandwidth_gbps=link.bandwidth_gbps, latency_us=link.latency_us)
    try:
        bw, lat = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"unknown link {spec!r}: use none, {', '.join(LINKS)} or GBPS:US like 0.1:100") from None
    if not bw > 0 or lat < 0:
        raise ValueError(f"link {spec!r}: bandwidth must be > 0 Gbit/s and latency >= 0 µs")
    return dict(name=spec, bandwidth_gbps=bw, latency_us=lat)


def predicted_delay(records: list[dict], world_size: int, link: dict) -> float:
    """Seconds the step's collectives cost on ``link`` by the ring model, none of it hidden."""
    if link["bandwidth_gbps"] is None:
        return 0.0
    return sum(link_delay(r["kind"], r["numel"], r["itemsize"], world_size, link["bandwidth_gbps"],
                          link["latency_us"]) for r in records)


def _emulated(link: dict, overlap: bool):
    """The link's emulator as a context manager; no link yields zeros, so rows read alike."""
    if link["bandwidth_gbps"] is None:
        return contextlib.nullcontext(SimpleNamespace(link_time_s=0.0, slept_s=0.0))
    from shardlab.instruments.link import emulate_link

    return emulate_link(bandwidth_gbps=link["bandwidth_gbps"], latency_us=link["latency_us"], overlap=overlap)


def _modes(opts: dict, link: dict) -> list[str]:
    """Overlap modes to time on ``link``: none for no link (nothing to hide), else on and/or off."""
    if link["bandwidth_gbps"] is None:
        return ["-"]
    return {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[opts["overlap"]]


def _key(stage, link_name, overlap) -> str:
    return f"{stage}/{link_name}/{overlap}"


def _rank_main(opts: dict) -> dict:
    """Runs on every rank: book each stage's collectives once, then time every (stage, link) pair."""
    from shardlab.engine.api import parallelize
    from shardlab.instruments.traffic import count_comm

    def build(stage):
        torch.manual_seed(opts["seed"])
        return parallelize(models.gpt(opts["model"]), stage=stage, optimizer_cls=torch.optim.AdamW, lr=1e-3)

    def train_step(stage, x, y):
        model, optimizer = runs[stage]
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    runs = {s: build(s) for s in STAGES}
    records = {}
    x, y = batch_at(opts, 0)
    for s in STAGES:
        train_step(s, x, y)  # warm-up: optimizer state exists, stage 3 knows its forward order
        with count_comm(wire=False) as ledger:
            train_step(s, x, y)
        records[s] = [dict(kind=r["kind"], numel=r["numel"], itemsize=r["dtype"].itemsize) for r in ledger.records]

    pairs = [(s, link["name"], ov) for s in STAGES for link in opts["links"] for ov in _modes(opts, link)]
    by_name = {link["name"]: link for link in opts["links"]}
    batches = [batch_at(opts, i + 1) for i in range(opts["warmup"] + opts["steps"])]

    def step(pair, i):
        s, name, ov = pair
        with _emulated(by_name[name], ov != "off") as em:
            train_step(s, *batches[i])
        return em.link_time_s, em.slept_s  # this step's emulated link time, and the part it slept

    times, links = timed_rounds(pairs, step, opts["warmup"], opts["steps"], barrier,
                                desc=f"time {len(pairs)} (stage, link, overlap)",
                                show=dist.get_rank() == 0 and not opts["quiet"])
    out = {}
    for pair in pairs:
        link_time, slept = zip(*links[pair][opts["warmup"]:], strict=True)
        out[_key(*pair)] = dict(step_s=times[pair], link_time_s=list(link_time), slept_s=list(slept))
    params = sum(p.numel() for p in models.gpt(opts["model"]).parameters())
    return dict(rows=out, records=records, params=params)


def summarize(opts: dict, per_rank: list[dict], wall: float) -> dict:
    """Per (stage, link, overlap): medians over steps of the slowest rank, the increase, the prediction."""
    n, params = opts["world_size"], per_rank[0]["params"]
    records = per_rank[0]["records"]
    stages = {}
    for s in STAGES:
        recs = records[s]
        elements = sum(volume(r["kind"], r["numel"]) for r in recs)
        ring = sum(ring_bytes(r["kind"], r["numel"], n, r["itemsize"]) for r in recs)
        calls = {}
        for r in recs:
            calls[r["kind"]] = calls.get(r["kind"], 0) + 1
        stages[s] = dict(elements=elements, psi=elements / params, ring_bytes_per_rank=ring, calls=calls)
    rows = []
    for s in STAGES:
        for link, ov in ((x, ov) for x in opts["links"] for ov in _modes(opts, x)):
            key = _key(s, link["name"], ov)

            def med(field, key=key):
                return slowest_median([r["rows"][key][field] for r in per_rank])

            rows.append(dict(stage=s, link=link["name"], overlap=ov, step_s=med("step_s"), link_time_s=med("link_time_s"),
                             slept_s=med("slept_s"), predicted_s=predicted_delay(records[s], n, link)))
    base = {r["stage"]: r["step_s"] for r in rows if r["link"] == "none"}
    for r in rows:
        r["increase_s"] = r["step_s"] - base[r["stage"]]
        r["hidden"] = 1 - r["slept_s"] / r["link_time_s"] if r["link_time_s"] > 0 else None
    return dict(options=dict(opts), params=params, stages=stages, rows=rows, wall_s=wall,
                bytes_ratio=stages[3]["ring_bytes_per_rank"] / stages[0]["ring_bytes_per_rank"],
                machine=machine_info(opts.get("load_before")))


def _find(result, stage, link, overlap):
    return next((r for r in result["rows"] if (r["stage"], r["link"], r["overlap"]) == (stage, link, overlap)), None)


def table(result: dict) -> str:
    """The result as Markdown: per link and stage, the ring model beside both overlap modes."""
    o, st = result["options"], result["stages"]
    def comm(s):
        calls = " + ".join(f"{c} {SHORT[k]}" for k, c in st[s]["calls"].items())
        return f"{st[s]['psi']:.2f}Ψ ({calls}), {st[s]['ring_bytes_per_rank'] / 1e6:.2f} MB per rank by the ring formula"

    def cells(row, base, hidden=False):
        if row is None:
            return ["–"] * (3 if hidden else 2)
        out = [f"{row['step_s'] * 1e3:.1f}", f"{(row['step_s'] - base) * 1e3:+.1f}"]
        if hidden:
            out.append("–" if row["hidden"] is None else f"{row['hidden']:.0%}")
        return out

    lines = [
        f"model {o['model']} ({result['params'] / 1e6:.2f}M params), {o['world_size']} ranks, batch {o['batch']} per "
        f"rank, median of {o['steps']} steps (slowest rank) after {o['warmup']} warm-up",
        f"stage 0 (DDP) moves {comm(0)}",
        f"stage 3 (FSDP) moves {comm(3)}: {result['bytes_ratio']:.2f}× stage 0's bytes",
        "",
        "| link | stage | + predicted (ms) | no overlap: step (ms) | + measured | overlap: step (ms) | + measured | hidden |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for link in o["links"]:
        for s in STAGES:
            base = _find(result, s, "none", "-")["step_s"]
            rows = [_find(result, s, link["name"], ov) for ov in ("off", "on")]
            if link["name"] == "none":
                rows = [_find(result, s, "none", "-")] * 2
            pred = next(r["predicted_s"] for r in rows if r is not None)
            lines.append("| " + " | ".join([link["name"], str(s), f"{pred * 1e3:.2f}", *cells(rows[0], base),
                                            *cells(rows[1], base, hidden=True)]) + " |")
    lines.append("")
    slowest = max(result["rows"], key=lambda r: r["predicted_s"])["link"]
    for ov, how in (("off", "Nothing hidden"), ("on", "With overlap")):
        s0, s3 = (_find(result, s, slowest, ov) for s in STAGES)
        if s0 is not None and s3 is not None:
            lines.append(f"{how}, on {slowest} stage 3 pays {s3['increase_s'] * 1e3:+.1f} ms a step against "
                         f"stage 0's {s0['increase_s'] * 1e3:+.1f} ms (ring model: {s3['predicted_s'] * 1e3:.1f} "
                         f"vs {s0['predicted_s'] * 1e3:.1f} ms).")
    m = result["machine"]
    load = "/".join(f"{x:.2f}" for x in m["load_before"] or ())
    lines += ["", "+ predicted = ring α-β model (link_delay) summed over the step's collectives as count_comm "
              "booked them, none hidden; + measured = step time minus the same stage's time with no link; "
              "hidden = share of the emulated link time that overlapped compute (1 − slept / link time).",
              f"Machine: {m['cores']} cores, torch {m['torch']}, load {load} before; wall {result['wall_s']:.0f} s."]
    return "\n".join(lines)


def run(opts: dict) -> dict:
    """Launch the ranks and summarize their timings."""
    from shardlab.launch import run_ranks

    t0 = time.perf_counter()
    per_rank = run_ranks(_rank_main, opts["world_size"], opts, timeout=opts["timeout"], threads=opts["threads"])
    return summarize(opts, per_rank, time.perf_counter() - t0)


def parse(argv) -> dict:
    ap = argparse.ArgumentParser(prog="python -m shardlab slow-link", description=__doc__.split("\n\n")[0])
    add_common_args(ap, model="small", steps_per="(stage, link)", timeout=900)
    ap.add_argument("--links", default=",".join(DEFAULT_LINKS),
                    help="comma-separated: none, " + ", ".join(LINKS) + " or GBPS:US (default: all presets)")
    ap.add_argument("--overlap", default="both", choices=("both", "on", "off"),
                    help="emulate with transfers overlapping compute (on), each op sleeping its full link time "
                         "(off, the pessimistic bound), or both (default)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.world_size < 2 or args.batch < 1:
        ap.error("--steps and --batch must be >= 1, --warmup >= 0 and --world-size >= 2 (one rank sends nothing)")
    try:
        links = [parse_link(s.strip()) for s in args.links.split(",") if s.strip()]
    except ValueError as e:
        ap.error(str(e))
    if "none" not in [x["name"] for x in links]:
        links.insert(0, parse_link("none"))  # the baseline every increase is measured from
    return vars(args) | dict(links=links, load_before=os.getloadavg())


def main(argv=None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    result = run(opts)
    print(table(result))
    write_json(result, opts["json"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
