"""The GPU check: one command on one node, before the workshop, that proves the GPU path.

    python workshop/gpu_check.py --record        # on a GPU node: every GPU it sees; its deadline stops it within ~11 minutes
    python workshop/gpu_check.py --dry-run       # anywhere: the same steps on CPU ranks (gloo)

Four steps, each printed as it runs and recorded (``--record``) to
workshop/recorded/gpu_results.json, which notebook 06 shows:

1. **node**: every GPU (name, memory), the topology (``nvidia-smi topo -m``), P2P access.
2. **bandwidth**: all-gather, reduce-scatter and all-reduce, 1 MiB to 256 MiB, through
   ``shardlab.engine.comm`` under torchrun, as bus bandwidth in GB/s (the nccl-tests
   convention: bytes / time x (N-1)/N, x 2(N-1)/N for all-reduce), and the α-β fit.
3. **stages**: ``python -m shardlab.train`` at stages 0-3 on every GPU: loss against stage 0's,
   peak CUDA memory against the formula, step time, tokens/s and TFLOPS per GPU.
4. **notebooks**: 00 and 04 headless under nbval, with the backend they get on this node.

On one GPU (the most common machine to try it on) step 2 is skipped (a collective needs two
ranks) and steps 3-4 show what one GPU can: CUDA memory against the formula, the CUDA code paths.
``--dry-run`` runs every step on CPU ranks over gloo, so the check's own bugs show before a GPU
is lent; it records to a file of its own, marked as a dry run, never as a GPU result.
Across nodes, measure bandwidth with ``--worker bandwidth`` under srun + torchrun (README).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
NOTEBOOK_RANKS = 4  # notebooks 00-05 start 4 ranks
DRY_RUN_FILE = Path(tempfile.gettempdir()) / "shardlab-gpu-check-dry-run.json"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", nargs="?", const="", default=None, metavar="PATH",
                   help="record the results (default workshop/recorded/gpu_results.json; a dry run: "
                        f"{DRY_RUN_FILE})")
    p.add_argument("--dry-run", action="store_true", help="every step on CPU ranks over gloo (no GPU needed)")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks for steps 2-3 (default: every GPU; a dry run: 2)")
    p.add_argument("--model", default=None, help="model for step 3 (default gpt-13m; a dry run: tiny)")
    p.add_argument("--steps", type=int, default=None, help="training steps per stage (default 20; a dry run: 3)")
    p.add_argument("--sizes-mb", default=None, help="buffer sizes in MiB, 2**20 bytes (default 1,16,64,256; a dry run: 1,4)")
    p.add_argument("--iters", type=int, default=None, help="timed collectives per size (default 10; a dry run: 2)")
    p.add_argument("--notebooks", default="00,04", help="notebooks to run headless (default 00,04; '' for none)")
    p.add_argument("--timeout", type=float, default=120, help="seconds before a stuck collective fails")
    p.add_argument("--worker", choices=["bandwidth"],
                   help="under torchrun: only the bandwidth step, printed (across nodes: README)")
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dry = args.dry_run
    args.model = args.model or ("tiny" if dry else "gpt-13m")
    args.steps = args.steps or (3 if dry else 20)
    args.sizes_mb = args.sizes_mb or ("1,4" if dry else "1,16,64,256")
    args.iters = args.iters or (2 if dry else 10)
    return args


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """One step's command, its output kept; a step that hangs is killed and reported, not waited on."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout:.0f} s")


# ---- step 1: the node -------------------------------------------------------------------------

def node(dry: bool) -> dict:
    """Devices, topology and P2P access, as data."""
    gpus = [] if dry else [
        {"index": i, "name": torch.cuda.get_device_name(i),
         "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
         "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
        for i in range(torch.cuda.device_count())]
    smi = shutil.which("nvidia-smi")
    topology = _run([smi, "topo", "-m"], 30).stdout.strip() if smi else "nvidia-smi not found"
    n = len(gpus)
    p2p = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    return {"host": socket.gethostname(), "gpus": gpus, "topology": topology, "p2p": p2p}


# ---- step 2: bandwidth (the worker runs under torchrun) ---------------------------------------

def bandwidth_worker(args) -> int:
    """On every rank: join (a GPU per rank: NCCL carries the CUDA buffers), time the
    collectives through comm, and rank 0 writes the rows to ``--out``."""
    import torch.distributed as dist

    from shardlab.course import measure
    from shardlab.engine import comm
    from shardlab.launch import describe, init_rank, pick_backend

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = "gloo" if args.dry_run else pick_backend("auto", local_world)
    device = init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, backend,
                       args.timeout, threads=None)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        lines = comm.gather_lists([f"{describe(rank, device, backend)} on {socket.gethostname()}"])
        rows = measure.collective_times([int(mb) for mb in args.sizes_mb.split(",")], iters=args.iters,
                                        device=device if device.type == "cuda" else None)
        for row in rows:  # the nccl-tests bus bandwidth, GB/s
            algbw = row["size_bytes"] / row["seconds"] / 1e9
            row["busbw_gbs"] = algbw * (world - 1) / world * (2 if row["kind"] == "all_reduce" else 1)
        ok = torch.ones(1, device=device)
        comm.all_reduce(ok)  # a sum of ones: every rank answered
        if rank == 0:
            result = {"ranks": lines, "rows": rows, "answered": int(ok.item()), "world_size": world}
            if args.out:
                Path(args.out).write_text(json.dumps(result))
            else:  # across nodes, by hand: the table
                _print_bandwidth(_fit(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def bandwidth(args, ranks: int, deadline: float) -> dict:
    if ranks < 2:
        return {"skipped": "one rank: a collective needs two; bandwidth is measured on 2+ GPUs"}
    out = Path(tempfile.mkdtemp(prefix="shardlab-check-")) / "bandwidth.json"
    cmd = [*TORCHRUN, f"--nproc-per-node={ranks}", str(Path(__file__).resolve()), "--worker", "bandwidth",
           "--out", str(out), "--sizes-mb", args.sizes_mb, "--iters", str(args.iters),
           "--timeout", str(args.timeout), *(["--dry-run"] if args.dry_run else [])]
    done = _run(cmd, max(30.0, deadline - time.monotonic()))
    if done.returncode or not out.exists():
        return {"failed": f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"}
    return _fit(json.loads(out.read_text()))


def _fit(result: dict) -> dict:
    """Add the α-β fit of each collective (in GB/s), or why there is none."""
    from shardlab.instruments.link import fit_link

    result["fit"], result["no_fit"] = {}, {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        mine = [r for r in result["rows"] if r["kind"] == kind]
        try:
            fit = fit_link(kind, [r["size_bytes"] for r in mine], [r["seconds"] for r in mine], result["world_size"])
        except ValueError as e:  # times that do not grow with size: too noisy to fit
            result["no_fit"][kind] = str(e)
            continue
        result["fit"][kind] = {"bandwidth_gbs": fit.bandwidth_gbps / 8, "latency_us": fit.latency_us}
    return result


# ---- step 3: the training script at stages 0-3 ------------------------------------------------

def stages(args, ranks: int, deadline: float) -> list[dict]:
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="shardlab-check-"))
    for stage in range(4):
        out = tmp / f"stage{stage}.json"
        train = ["-m", "shardlab.train", "--model", args.model, "--stage", str(stage), "--steps", str(args.steps),
                 "--data", "random", "--seed", "1", "--json", str(out), "--timeout", str(args.timeout),
                 *(["--backend", "gloo"] if args.dry_run else ["--bf16"])]
        cmd = [*TORCHRUN, f"--nproc-per-node={ranks}", *train] if ranks > 1 else [sys.executable, *train]
        done = _run(cmd, max(30.0, deadline - time.monotonic()))
        s = json.loads(out.read_text()) if out.exists() else {}
        if "oom" in s:
            rows.append({"stage": stage, "oom": s["oom"]})
            continue
        if done.returncode or not s:
            rows.append({"stage": stage, "failed": f"exit {done.returncode}: {(done.stderr or done.stdout)[-800:]}"})
            continue
        formula = s["formula_states"] + s["formula_activations"]
        peak = max(s["peak_bytes"]) if s["peak_bytes"][0] is not None else None
        rows.append({"stage": stage, "ranks": s["world_size"], "backend": s["backend"], "loss": s["loss"],
                     "step_s": s["step_s"], "tokens_per_s": s["tokens_per_s"], "tflops_per_gpu": s["tflops_per_gpu"],
                     "formula_gb": formula / 1e9, "peak_gb": peak / 1e9 if peak else None,
                     "peak_over_formula": peak / formula if peak else None, "checksum": s["checksum"]})
    base = next((r["loss"] for r in rows if r["stage"] == 0 and "loss" in r), None)
    for r in rows:  # same seed, same data: every stage computes the same step
        if "loss" in r and base is not None:
            r["loss_vs_stage0"] = abs(r["loss"] - base) / base
            r["parity"] = r["loss_vs_stage0"] <= (1e-5 if args.dry_run else 2e-2)  # bf16 on GPUs
    return rows


# ---- step 4: notebooks ------------------------------------------------------------------------

def notebooks(args, gpus: int, deadline: float) -> list[dict]:
    from shardlab.launch import pick_backend

    rows = []
    for prefix in filter(None, args.notebooks.split(",")):
        [path] = sorted((ROOT / "notebooks").glob(f"{prefix.strip()}_*.ipynb"))
        t0 = time.perf_counter()
        done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                     str(path.relative_to(ROOT))], max(30.0, deadline - time.monotonic()))
        rows.append({"notebook": path.name, "ok": done.returncode == 0, "seconds": round(time.perf_counter() - t0, 1),
                     "backend": "gloo" if args.dry_run else pick_backend("auto", NOTEBOOK_RANKS, gpus),
                     **({} if done.returncode == 0 else {"output": done.stdout[-1500:]})})
    return rows


# ---- the check --------------------------------------------------------------------------------

def _print_bandwidth(b: dict) -> None:
    if "rows" not in b:
        print(f"  {b.get('skipped') or b.get('failed')}")
        return
    print("\n".join(f"  {line}" for line in b["ranks"]))
    print(f"  {'collective':16}{'size':>8}  {'time':>9}  {'busbw (GB/s)':>12}")
    for r in b["rows"]:
        print(f"  {r['kind']:16}{r['size_bytes'] / 2**20:>6.0f}MiB {r['seconds'] * 1e3:>7.2f}ms  {r['busbw_gbs']:>12.2f}")
    for kind, fit in b["fit"].items():
        print(f"  α-β fit, {kind}: β = {fit['bandwidth_gbs']:.2f} GB/s, α = {fit['latency_us']:.1f} µs")
    for kind, why in b["no_fit"].items():
        print(f"  no α-β fit for {kind}: {why}")
    print(f"  {b['answered']} of {b['world_size']} ranks answered an all-reduce")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker == "bandwidth":
        return bandwidth_worker(args)
    from shardlab.course import gpu_results

    gpus = 0 if args.dry_run else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not args.dry_run and gpus == 0:
        print("error: no CUDA device here. Run this on a GPU node, or try it on CPU first with --dry-run.",
              file=sys.stderr)
        return 2
    ranks = args.ranks or (2 if args.dry_run else gpus)
    if not args.dry_run and ranks > gpus:
        print(f"error: --ranks {ranks} but {gpus} GPU(s): one GPU per rank", file=sys.stderr)
        return 2
    deadline = time.monotonic() + 8 * 60  # the whole check; each step gets what is left
    what = "DRY RUN on CPU ranks (gloo): every step but CUDA" if args.dry_run else f"{gpus} GPU(s)"
    print(f"ShardLab GPU check: {what}; torch {torch.__version__}, {ranks} rank(s), model {args.model}")

    print("\n1. node")
    n = node(args.dry_run)
    for g in n["gpus"]:
        print(f"  cuda:{g['index']}: {g['name']}, {g['memory_gib']} GiB, sm {g['capability']}")
    print("  " + n["topology"].replace("\n", "\n  "))
    if n["p2p"]:
        print("  P2P access: " + " ".join("".join("y" if ok else "." for ok in row) for row in n["p2p"]))

    print(f"\n2. bandwidth ({ranks} ranks, bus bandwidth in GB/s as nccl-tests reports it)")
    b = bandwidth(args, ranks, deadline)
    _print_bandwidth(b)

    print(f"\n3. the training script, stages 0-3 ({args.model}, {args.steps} steps, {ranks} rank(s))")
    st = stages(args, ranks, deadline)
    for r in st:
        if "loss" not in r:
            print(f"  stage {r['stage']}: {r.get('oom') or r.get('failed')}")
            continue
        peak = (f"peak {r['peak_gb']:.2f} GB vs formula {r['formula_gb']:.2f} GB ({r['peak_over_formula']:.2f})"
                if r["peak_gb"] else f"formula {r['formula_gb']:.3f} GB (no CUDA peak on CPU)")
        print(f"  stage {r['stage']}: loss {r['loss']:.4f} (vs stage 0: {r.get('loss_vs_stage0', 0):.1e}"
              f"{'' if r.get('parity') else ', NOT EQUAL'}), {r['step_s'] * 1e3:.1f} ms/step, "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_gpu']:.2f} TFLOPS/GPU; {peak}")

    print(f"\n4. notebooks, headless ({args.notebooks or 'none'})")
    nb = notebooks(args, gpus, deadline)
    for r in nb:
        print(f"  {r['notebook']}: {'passed' if r['ok'] else 'FAILED'} in {r['seconds']} s on {r['backend']}"
              + ("" if r["ok"] else "\n" + r["output"]))

    ok = ("rows" in b or "skipped" in b) and all(r.get("parity") for r in st) and all(r["ok"] for r in nb)
    if args.record is not None:
        path = Path(args.record) if args.record else (DRY_RUN_FILE if args.dry_run else gpu_results.default_path())
        hw = ({"gpu": "none (dry run on CPU)", "gpus_per_host": 0, "host": socket.gethostname(),
               "torch": torch.__version__, "dry_run": True} if args.dry_run else gpu_results.hardware())
        command = "python workshop/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
        gpu_results.record("node", [n], command=command, hardware_info=hw, path=path)
        if "rows" in b:
            gpu_results.record("bandwidth", b["rows"], command=command, hardware_info=hw, path=path, fit=b["fit"],
                               world_size=ranks)
        gpu_results.record("stages", st, command=command, hardware_info=hw, path=path, model=args.model)
        if nb:
            gpu_results.record("notebooks", nb, command=command, hardware_info=hw, path=path)
        print(f"\nrecorded in {path}" + (" (a dry run: not a GPU result)" if args.dry_run else ""))
    print(f"\n{'OK' if ok else 'FAILED'}: {'every step passed' if ok else 'see the steps above'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
