"""``python -m shardlab memory``: the ZeRO paper's per-stage table of model states and traffic.

    python -m shardlab memory --params 7.5e9 --gpus 64
    python -m shardlab memory --params 70B --gpus 512 --largest-layer 0.86B --json

Every number is a formula's value from :mod:`shardlab.instruments.memory_math`; this module only
reads the arguments and prints.
"""

from __future__ import annotations

from shardlab.instruments.memory_math import (
    COMM_COLLECTIVES,
    GB,
    GIB,
    RECIPES,
    STAGE_LABELS,
    STAGES,
    comm_elements,
    deepspeed_estimate,
    formula_text,
    gathered_unit_bytes,
    model_state_bytes,
    parse_count,
    recipe,
    ring_bytes_per_rank,
)


def _human(n) -> str:
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:g}{suffix}"
    return f"{n:g}"


def _exact(x):
    return int(x) if float(x).is_integer() else float(x)


def main(argv=None) -> int:
    """The per-stage table, or ``--json`` for programs."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m shardlab memory",
        description="Per-device model-state memory of DDP and ZeRO-1/2/3 (ZeRO paper formulas). "
        "GB = 10^9 bytes (the paper's unit), GiB = 2^30 bytes.",
    )
    ap.add_argument("--params", default="7.5e9", help="parameter count Ψ: 7.5e9, 7.5B, 13M, 1T (default 7.5e9)")
    ap.add_argument("--gpus", default="64", help="data-parallel devices Nd (default 64)")
    ap.add_argument("--recipe", default="mixed-adam", help=f"one of {', '.join(RECIPES)} (default mixed-adam)")
    ap.add_argument("--largest-layer", default=None, help="largest unit's params: adds stage-3 gather room and DeepSpeed's estimate")
    ap.add_argument("--json", action="store_true", help="print bytes per device as JSON")
    try:
        args = ap.parse_args(argv)
        params = parse_count(args.params)
        try:
            gpus = int(args.gpus)
        except ValueError:
            raise ValueError(f"--gpus must be a positive integer, got {args.gpus!r}") from None
        r = recipe(args.recipe)
        totals = model_state_bytes(params, gpus, r)
        largest = parse_count(args.largest_layer) if args.largest_layer is not None else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    comm = {s: _exact(ring_bytes_per_rank(s, params, gpus, r.param_bytes)) for s in STAGES}
    if args.json:
        out = {s: _exact(v) for s, v in totals.items()}
        out.update(
            unit="bytes per device", params=_exact(params), gpus=gpus, recipe=r.name,
            bytes_per_param=r.bytes_per_param, formula={s: formula_text(s, r) for s in STAGES},
            comm_elements={s: _exact(comm_elements(s, params)) for s in STAGES}, ring_bytes_per_rank=comm,
        )
        if largest is not None:
            out["zero3_gathered_bytes"] = _exact(gathered_unit_bytes(largest, r))
            out["deepspeed_zero3_bytes"] = _exact(deepspeed_estimate(params, gpus, 3, largest))
        print(json.dumps(out, indent=2))
        return 0
    print(f"Model states per device: Ψ = {_human(params)} params, Nd = {gpus} devices, recipe {r.name} "
          f"({r.param_bytes} + {r.grad_bytes} + {r.optim_bytes} = {r.bytes_per_param} bytes/param)")
    print(f"{'':<23} {'model states per device':>23}   {'communication per step':^37}".rstrip())
    print(f"{'stage':<7} {'formula':<15} {'GB':>11} {'GiB':>11}   {'volume (paper)':>19} {'ring GB per rank':>17}")
    for s in STAGES:
        k = sum(n for _, n in COMM_COLLECTIVES[s])
        volume = f"{k}Ψ = {comm_elements(s, params) * r.param_bytes / GB:.3f} GB"
        print(f"{STAGE_LABELS[s]:<7} {formula_text(s, r):<15} {totals[s] / GB:>11.3f} {totals[s] / GIB:>11.3f}"
              f"   {volume:>19} {comm[s] / GB:>17.3f}")
    if largest is not None:
        extra = gathered_unit_bytes(largest, r)
        ds = deepspeed_estimate(params, gpus, 3, largest)
        print(f"ZeRO-3 + two gathered units of {_human(largest)} params (prefetch): {(totals['zero3'] + extra) / GB:.3f} GB")
        print(f"DeepSpeed's ZeRO-3 estimate (4L + 18Ψ/Nd, prints GiB as 'GB'): {ds / GIB:.2f} GiB")
    print(f"Volume: the elements the paper counts, x {r.param_bytes} bytes. Ring GB per rank: a formula, what each rank "
          f"would send in ring collectives (NCCL's on GPUs), (N-1)/N x volume = {gpus - 1}/{gpus} x volume.")
    print("Model states only: activations, gathered units and buffers come on top.")
    return 0
