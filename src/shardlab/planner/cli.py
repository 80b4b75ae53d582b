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

from shardlab import planner
from shardlab.planner import hardware, transformer
from shardlab.planner.report import as_dict, text


def parse(argv) -> tuple[planner.Transformer, planner.GPUCluster, planner.Plan, bool]:
    ap = argparse.ArgumentParser(prog="python -m shardlab plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b", help=f"one of {', '.join(transformer.ALIASES)} (default 8b)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    ap.add_argument("--gpu", default="h100", help=f"one of {', '.join(hardware.GPUS)} (default h100)")
    ap.add_argument("--network", default="ib-ndr", help="between nodes: ib-ndr, ib-hdr, 100gbe, 25gbe (default ib-ndr)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nics-per-node", type=int, help="default: one per GPU on InfiniBand, one per node on Ethernet")
    ap.add_argument("--plan", default="zero3", help="ddp, zero1, zero2, zero3 or hsdp (default zero3)")
    ap.add_argument("--shard-group", type=int, help="HSDP's shard group (default: a node)")
    ap.add_argument("--checkpointing", default="none", choices=planner.CHECKPOINTING)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--recipe", default="mixed-adam")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    model = planner.model(args.model)
    if args.seq is not None:
        model = model.with_(seq=args.seq)
    if args.gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {args.gpus}")
    cluster = planner.cluster(args.gpu, args.gpus, args.network, args.gpus_per_node, args.nics_per_node)
    plan = planner.Plan(args.plan, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                  checkpointing=args.checkpointing, prefetch=not args.no_prefetch,
                  shard_group=args.shard_group or cluster.gpus_per_node, recipe=args.recipe)
    planner.sharding_degree(plan, cluster.gpus)  # a bad HSDP group is refused here, with its fix
    return model, cluster, plan, args.json


def main(argv=None) -> int:
    try:
        model, cluster, plan, as_json = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pred = planner.predict(model, cluster, plan)
    comparison = planner.compare(model, cluster, plan)
    if as_json:
        first, fastest = comparison["first_fit"], comparison["fastest"]
        print(json.dumps({"model": model.name, "params": model.params, "cluster": cluster.describe(),
                          "fraction_of_peak": planner.ACHIEVABLE_FRACTION, **as_dict(pred),
                          "compare": [as_dict(p) for p in comparison["predictions"]],
                          "first_fit": first and first.plan.label, "fastest": fastest and fastest.plan.label},
                         indent=1))
    else:
        print(text(pred, comparison))
    return 0


if __name__ == "__main__":
    sys.exit(main())
