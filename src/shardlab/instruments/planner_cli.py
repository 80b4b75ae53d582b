"""``python -m shardlab plan``: memory per GPU and step time of a plan, and which plan to pick.

    python -m shardlab plan --model 70b --gpus 256 --gpu h100 --plan zero3 --checkpointing full
    python -m shardlab plan --model 8b --gpus 64 --network 100gbe --json

Prints the plan's memory per GPU against the card and its step time (compute, exposed
communication), then every stage with the same batch side by side, the first that fits and
the fastest of those that fit. ``--json`` prints the same numbers for programs.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardlab.instruments import planner as P
from shardlab.instruments import planner_presets as pp

GIB = 2**30


def text(pred: P.Prediction, comparison: dict) -> str:
    """The plan's breakdown and the comparison, as plain text."""
    m, c, plan, mem, t = pred.model, pred.cluster, pred.plan, pred.memory, pred.timing
    lines = [f"{m.name} ({m.params / 1e9:.3g}B params, seq {m.seq}) on {c.describe()}",
             f"plan: {plan.label}, micro-batch {plan.micro_batch} × {plan.grad_accum} accumulation, "
             f"prefetch {'on' if plan.prefetch else 'off'}, {plan.recipe}",
             "", "memory per GPU"]
    for name, value in mem.parts().items():
        lines.append(f"  {name:<16}{value / GIB:>9.2f} GiB")
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    lines += [f"  {'total':<16}{mem.total / GIB:>9.2f} GiB of {c.gpu.memory_bytes / GIB:.0f} GiB: {verdict}",
              "", "step time per GPU",
              f"  {'compute':<16}{t.compute_s:>9.3f} s  ({P.ACHIEVABLE_FRACTION:.0%} of {c.gpu.peak_flops / 1e12:.0f} TFLOPS peak)",
              f"  {'exposed comm':<16}{t.exposed_comm_s:>9.3f} s  (of {t.link_s:.3f} s the links were busy)",
              f"  {'step':<16}{t.step_s:>9.3f} s",
              f"  {t.tokens_per_s:,.0f} tokens/s/GPU, {t.tflops_per_gpu:.0f} TFLOPS/GPU (recompute counted), "
              f"MFU {t.mfu:.0%}", "", f"{'plan':<30}{'GiB/GPU':>9}  {'fits':<5}{'step s':>9}{'TFLOPS':>8}"]
    for p in comparison["predictions"]:
        lines.append(f"{p.plan.label:<30}{p.memory.total / GIB:>9.1f}  {'yes' if p.memory.fits else 'no':<5}"
                     f"{p.timing.step_s:>9.3f}{p.timing.tflops_per_gpu:>8.0f}")
    first, fastest = comparison["first_fit"], comparison["fastest"]
    if first is None:
        lines.append("Nothing fits: add GPUs, checkpoint activations, or shrink the micro-batch.")
    else:
        lines.append(f"First plan that fits: {first.plan.label}. Fastest that fits: {fastest.plan.label}.")
    lines.append("Model only: no optimizer step, no stragglers; see notebook 08 for what it gets right and wrong.")
    return "\n".join(lines)


def as_dict(pred: P.Prediction) -> dict:
    t, mem = pred.timing, pred.memory
    return {"plan": pred.plan.label, "stage": pred.plan.stage,
            "memory_bytes": {**{k.replace(" ", "_"): v for k, v in mem.parts().items()}, "total": mem.total,
                             "card": mem.card}, "fits": mem.fits,
            "step_s": t.step_s, "compute_s": t.compute_s, "exposed_comm_s": t.exposed_comm_s, "link_s": t.link_s,
            "tokens_per_s_per_gpu": t.tokens_per_s, "tflops_per_gpu": t.tflops_per_gpu, "mfu": t.mfu}


def parse(argv) -> tuple[pp.Transformer, pp.Cluster, P.Plan, bool]:
    ap = argparse.ArgumentParser(prog="python -m shardlab plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b", help=f"one of {', '.join(pp.ALIASES)} (default 8b)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    ap.add_argument("--gpu", default="h100", help=f"one of {', '.join(pp.GPUS)} (default h100)")
    ap.add_argument("--network", default="ib-ndr", help="between nodes: ib-ndr, ib-hdr, 100gbe, 25gbe (default ib-ndr)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nics-per-node", type=int, help="default: one per GPU on InfiniBand, one per node on Ethernet")
    ap.add_argument("--plan", default="zero3", help="ddp, zero1, zero2, zero3 or hsdp (default zero3)")
    ap.add_argument("--shard-group", type=int, help="HSDP's shard group (default: a node)")
    ap.add_argument("--checkpointing", default="none", choices=P.CHECKPOINTING)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--recipe", default="mixed-adam")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    model = pp.model(args.model)
    if args.seq is not None:
        model = model.with_(seq=args.seq)
    if args.gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {args.gpus}")
    cluster = pp.cluster(args.gpu, args.gpus, args.network, args.gpus_per_node, args.nics_per_node)
    plan = P.Plan(args.plan, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                  checkpointing=args.checkpointing, prefetch=not args.no_prefetch,
                  shard_group=args.shard_group or cluster.gpus_per_node, recipe=args.recipe)
    P.sharding_degree(plan, cluster.gpus)  # a bad HSDP group is refused here, with its fix
    return model, cluster, plan, args.json


def main(argv=None) -> int:
    try:
        model, cluster, plan, as_json = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pred = P.predict(model, cluster, plan)
    comparison = P.compare(model, cluster, plan)
    if as_json:
        first, fastest = comparison["first_fit"], comparison["fastest"]
        print(json.dumps({"model": model.name, "params": model.params, "cluster": cluster.describe(),
                          "fraction_of_peak": P.ACHIEVABLE_FRACTION, **as_dict(pred),
                          "compare": [as_dict(p) for p in comparison["predictions"]],
                          "first_fit": first and first.plan.label, "fastest": fastest and fastest.plan.label},
                         indent=1))
    else:
        print(text(pred, comparison))
    return 0


if __name__ == "__main__":
    sys.exit(main())
