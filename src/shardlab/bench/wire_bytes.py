"""``python -m shardlab wire``: bytes on the wire per rank, measured, beside the ring formula.

Two measurements, each on live ranks over gloo:

* **one collective** of ``--mib`` MiB (float32) of each kind, at every world size in
  ``--world-sizes``: each rank's wire bytes (:mod:`shardlab.instruments.wire`), the ring
  formula, their ratio, and the same bytes counted a second way, from each TCP connection's
  own counters (:func:`shardlab.instruments.wire.tcp_bytes_written`);
* **one training step** of the course GPT (``--model``) at stages 0-3 on ``--step-ranks``
  ranks, after a warm-up step: each rank's wire bytes beside the ledger's ring bytes.

On gloo the reduce-scatter shows 2× the ring: torch runs it as an all-reduce of the full
buffer (see :mod:`shardlab.instruments.wire` for the source). That is why ZeRO-1/2 put more
than DDP's bytes on the wire here, though the paper (and NCCL's ring) say the same 2Ψ.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.bench.harness import batch_at, machine_info, write_json
from shardlab.engine import comm
from shardlab.instruments.traffic import KINDS, count_comm
from shardlab.instruments.wire import tcp_bytes_written

MIB = 2**20


def one_collective(kind: str, numel: int) -> None:
    """Run one engine collective of ``kind`` on a full buffer of ``numel`` float32 elements."""
    n = dist.get_world_size()
    full = torch.ones(numel)
    if kind == "all_gather":
        comm.all_gather(full, torch.ones(numel // n))
    elif kind == "reduce_scatter":
        comm.reduce_scatter(torch.empty(numel // n), full)
    elif kind == "all_reduce":
        comm.all_reduce(full)
    else:
        comm.broadcast(full, src=0)


def collectives_on_rank(numel: int) -> dict:
    """Per kind: this rank's wire bytes, ring formula and TCP-counter bytes around one call."""
    out = {}
    for kind in KINDS:
        one_collective(kind, numel)  # warm-up: gloo's first call of a kind sets up its buffers
        comm.barrier()
        tcp0 = tcp_bytes_written()
        with count_comm() as ledger:
            one_collective(kind, numel)
        tcp1 = tcp_bytes_written()
        out[kind] = dict(wire=ledger.wire_bytes(), ring=ledger.ring_bytes(), tcp=tcp1 - tcp0)
    comm.barrier()  # no rank leaves (closing its connections, and their counters) before all have read
    return out


def step_on_rank(opts: dict) -> dict:
    """Per stage: this rank's wire bytes and the ledger's ring bytes for one training step."""
    from shardlab.engine.api import parallelize

    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        model, opt = parallelize(models.gpt(opts["model"]), stage=stage, optimizer_cls=torch.optim.AdamW, lr=1e-3)
        for i in range(2):  # a warm-up step (optimizer state, forward order), then the measured one
            x, y = batch_at(opts, i)
            comm.barrier()
            with count_comm() as ledger:
                models.lm_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        out[stage] = dict(wire=ledger.wire_bytes(), ring=ledger.ring_bytes(), elements=ledger.elements(),
                          by_kind={k: (ledger.wire_bytes(kind=k), ledger.ring_bytes(kind=k))
                                   for k in KINDS if ledger.calls(kind=k)},
                          shared=sum(ledger.shared.values()), outside=ledger.outside, table=ledger.table())
    return out


def collectives_table(results: dict, mib: float) -> str:
    lines = [f"One collective of {mib:g} MiB (float32, full buffer), bytes each rank wrote to the wire (MiB)",
             "| ranks | collective | wire per rank (measured) | ring (formula) | wire / ring | TCP counters agree |",
             "|---:|---|---|---:|---:|---:|"]
    for n, per_rank in results.items():
        for kind in KINDS:
            rows = [r[kind] for r in per_rank]
            wires = [r["wire"] for r in rows]
            ring = rows[0]["ring"]
            worst = max(abs(r["wire"] - r["tcp"]) / max(r["tcp"], 1) for r in rows)
            lines.append(f"| {n} | {kind} | {' / '.join(f'{w / MIB:.2f}' for w in wires)} | {ring / MIB:.2f} | "
                         f"{sum(wires) / len(wires) / ring:.2f} | within {worst:.3%} |")
    return "\n".join(lines)


def step_table(per_rank: list[dict], opts: dict) -> str:
    lines = [f"One training step of the {opts['model']} GPT on {len(per_rank)} ranks (after a warm-up step)",
             "| stage | wire per rank (measured, MiB) | ring bytes per rank (ledger formula, MiB) | wire / ring |",
             "|---:|---|---:|---:|"]
    for s in range(4):
        wires = [r[s]["wire"] for r in per_rank]
        ring = per_rank[0][s]["ring"]
        lines.append(f"| {s} | {' / '.join(f'{w / MIB:.2f}' for w in wires)} | {ring / MIB:.2f} | "
                     f"{sum(wires) / len(wires) / ring:.2f} |")
    return "\n".join(lines)


def run(opts: dict) -> dict:
    from shardlab.launch import run_ranks

    t0 = time.perf_counter()
    coll = {}
    for n in opts["world_sizes"]:
        numel = n * math.ceil(opts["mib"] * MIB / 4 / n)  # divisible by n: shards of equal size
        coll[n] = run_ranks(collectives_on_rank, n, numel, timeout=opts["timeout"])
    steps = run_ranks(step_on_rank, opts["step_ranks"], opts, timeout=opts["timeout"]) if opts["step_ranks"] else []
    return dict(options=opts, collectives=coll, steps=steps, wall_s=time.perf_counter() - t0, machine=machine_info())


def parse(argv) -> dict:
    ap = argparse.ArgumentParser(prog="python -m shardlab wire", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=16.0, help="size of each collective's full buffer (default 16)")
    ap.add_argument("--world-sizes", default="2,3,4", help="ranks for the collectives (default 2,3,4)")
    ap.add_argument("--model", default="small", choices=sorted(models.SIZES), help="GPT for the step (default small)")
    ap.add_argument("--step-ranks", type=int, default=4, help="ranks for the step (default 4; 0 skips it)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank in the step (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds per launch")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON ('-' for stdout)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--world-sizes takes numbers like 2,3,4, got {args.world_sizes!r}")
    if not sizes or min(sizes) < 2 or args.step_ranks == 1 or args.step_ranks < 0 or not args.mib > 0:
        ap.error("world sizes must be >= 2 (one rank sends nothing), --step-ranks 0 or >= 2, --mib > 0")
    return vars(args) | dict(world_sizes=sizes)


def main(argv=None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    result = run(opts)
    print(collectives_table(result["collectives"], opts["mib"]))
    if result["steps"]:
        print()
        print(step_table(result["steps"], opts))
        print("\nRank 0's ledger at stage 3:\n" + result["steps"][0][3]["table"])
    m = result["machine"]
    print(f"\nMachine: {m['cores']} cores, torch {m['torch']}; wall {result['wall_s']:.0f} s.")
    write_json(result, opts["json"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
