"""``python -m shardlab plan``: memory per GPU and step time of a plan, and which plan to pick.

    python -m shardlab plan --model 70b --gpus 256 --gpu h100 --plan zero3 --checkpointing full
    python -m shardlab plan --model 8b --gpus 64 --network 100gbe --json
    python -m shardlab plan --model custom --layers 24 --hidden 2048 --heads 16 --vocab 32000 --seq 4096
    python -m shardlab plan --model path/to/config.json --gpus 16

Prints the plan's memory per GPU against the card and its step time (compute, exposed
communication), then every stage with the same batch side by side, the first that fits and
the fastest of those that fit, the knee (tokens per GPU below which communication cannot
hide), the assumptions that decide the answer with the flag that changes each, and the bytes
per parameter other material quotes, recomputed. ``--json`` prints the same for programs.
Every number is a formula's value, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardlab import planner
from shardlab.planner import hardware, network_model, transformer
from shardlab.planner.report import anchors_dict, as_dict, text


def parse(argv) -> tuple[planner.Transformer, planner.GPUCluster, planner.Plan, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m shardlab plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b", help=f"one of {', '.join(transformer.ALIASES)}, a preset name "
                    "(llama2-13b, gpt3-760m, ...) or the path of a Hugging Face config.json (default 8b)")
    shape = ap.add_argument_group("a shape of your own (with --model custom, or to change a preset's)")
    for name in transformer.SHAPE:
        shape.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    ap.add_argument("--gpu", default="h100", help=f"one of {', '.join(hardware.GPUS)} (default h100)")
    ap.add_argument("--network", default="ib-ndr", help="between nodes: ib-ndr, ib-hdr, 100gbe, 25gbe, 10GbE, 1GbE "
                    "(default ib-ndr)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nics-per-node", type=int, help="default: one per GPU on InfiniBand, one per node on Ethernet")
    ap.add_argument("--plan", default="zero3", help="ddp, zero1, zero2, zero3 or hsdp (default zero3)")
    ap.add_argument("--shard-group", type=int, help="HSDP's shard group (default: a node)")
    ap.add_argument("--checkpointing", default="none", choices=planner.CHECKPOINTING)
    ap.add_argument("--attention", default="fused", choices=("fused", "eager"),
                    help="fused (SDPA/FlashAttention, the default) keeps no s×s scores; eager keeps them")
    ap.add_argument("--reduce-dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of gradient reductions")
    ap.add_argument("--overlap-param-gather", action="store_true", help="ZeRO-1/2: hide the parameter all-gather "
                    "under the next forward (Megatron-LM's --overlap-param-gather)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--recipe", default="mixed-adam")
    ap.add_argument("--fraction", type=float, default=planner.ACHIEVABLE_FRACTION,
                    help=f"fraction of peak the matmuls reach (default {planner.ACHIEVABLE_FRACTION})")
    ap.add_argument("--compute", default="fraction", choices=("fraction", "roofline"),
                    help="fraction: FLOPs at --fraction of peak; roofline: each kernel against peak and memory "
                    "bandwidth (η fitted on torchtitan's A100 runs)")
    ap.add_argument("--network-model", default="ideal", choices=network_model.NETWORK_MODELS, dest="network_model",
                    help="ideal: line rates, perfect overlap (the default); nccl: NCCL's bus from published curves, "
                    "DDP's buckets, compute slowed beside a transfer (planner/network_model.py)")
    ap.add_argument("--bucket-mb", type=float, help="needs --network-model nccl: DDP's bucket in MiB, > 0 "
                    "(default 25, PyTorch's)")
    ap.add_argument("--overlap-efficiency", type=float, help="needs --network-model nccl: compute's speed beside a "
                    "transfer, in (0, 1] (default 0.9, an assumption)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    dims = {name: getattr(args, name) for name in transformer.SHAPE}
    if args.model == "custom":
        model = transformer.from_shape("custom", **dims)
    else:
        model = transformer.from_shape(base=planner.model(args.model), **dims)
    if args.gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {args.gpus}")
    if not 0 < args.fraction <= 1:
        raise ValueError(f"--fraction must be in (0, 1], got {args.fraction}")
    network_model.network_knobs(args.network_model, args.bucket_mb, args.overlap_efficiency, flags=True)
    cluster = planner.cluster(args.gpu, args.gpus, args.network, args.gpus_per_node, args.nics_per_node)
    plan = planner.Plan(args.plan, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                        checkpointing=args.checkpointing, prefetch=not args.no_prefetch,
                        shard_group=args.shard_group or cluster.gpus_per_node, recipe=args.recipe,
                        attention=args.attention, reduce_dtype=args.reduce_dtype,
                        overlap_param_gather=args.overlap_param_gather)
    planner.sharding_degree(plan, cluster.gpus)  # a bad HSDP group is refused here, with its fix
    return model, cluster, plan, args


def main(argv=None) -> int:
    try:
        model, cluster, plan, args = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    f, net = args.fraction, args.network_model
    knobs = dict(network=net, bucket_mb=args.bucket_mb, overlap_efficiency=args.overlap_efficiency)
    try:
        pred = planner.predict(model, cluster, plan, fraction=f, compute=args.compute, **knobs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    comparison = planner.compare(model, cluster, plan, fraction=f, compute=args.compute, **knobs)
    if args.json:
        first, fastest = comparison["first_fit"], comparison["fastest"]
        print(json.dumps({"model": model.name, "params": model.params, "shape": model.shape(),
                          "cluster": cluster.describe(), "fraction_of_peak": f, "compute": args.compute, "network_model": net,
                          "kind": "formula",
                          **as_dict(pred, fraction=f),
                          "compare": [as_dict(p, fraction=f) for p in comparison["predictions"]],
                          "first_fit": first and first.plan.label, "fastest": fastest and fastest.plan.label,
                          **anchors_dict(cluster.gpus, plan, f, **knobs)}, indent=1))
    else:
        print(text(pred, comparison, fraction=f, compute=args.compute, **knobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
