"""Results recorded on a real GPU node, kept as data: notebook 06 shows them when they exist.

The course never types a GPU number into markdown. When a GPU run happens,
``workshop/gpu_check.py --record`` and notebook 06's own cells call :func:`record`, which
writes ``workshop/recorded/gpu_results.json``: one entry per kind of run (``node``: devices,
topology, P2P; ``bandwidth``: bus bandwidth in GB/s and the α-β fit; ``stages``: the training
script at stages 0-3; ``notebooks``; ``memory``: notebook 06's table), each with the hardware it
ran on, the date and the command. Without that file, :func:`text` and :func:`banner` say
plainly that no GPU run has been recorded yet. ``gpu_check.py --dry-run`` writes the same
entries from CPU ranks, marked ``dry_run``, to a file of its own: never shown as a GPU result.

File format::

    {"runs": [{"kind": "bandwidth", "date": "2026-...Z", "command": "torchrun ... gpu_check.py --record",
               "hardware": {"gpu": "...", "gpus": 8, "hosts": 1, "torch": "...", "nccl": "...", ...},
               "rows": [{...}, ...], "fit": {...}}]}
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

KINDS = ("node", "bandwidth", "stages", "notebooks", "memory")
RELATIVE = Path("workshop") / "recorded" / "gpu_results.json"
NOT_YET = ("No GPU run has been recorded yet. Run `python workshop/gpu_check.py --record` on a GPU node "
           "(it starts torchrun itself), and notebook 06 there, to record one (workshop/README.md, step 1).")

# Published figures, quoted from their sources with the conditions they state: what a recorded
# run will look like. Never measured here; published_text() labels every line "published".
PUBLISHED = [
    {"what": "all-reduce bus bandwidth, 8 x H100 in one node (NVLink SHARP), at sizes above 256 MB",
     "value": "~480 GB/s busbw (algbw ~275 GB/s)",
     "source": "S. Jeaugey (NCCL team), github.com/NVIDIA/nccl-tests/issues/212, 2024-05-06"},
    {"what": "effective NVLink bandwidth on H100 (450 GB/s line rate, ~20% protocol overhead): the busbw of "
             "all-gather / reduce-scatter, or all-reduce with NCCL_ALGO=RING",
     "value": "~370 GB/s busbw",
     "source": "S. Jeaugey (NCCL team), github.com/NVIDIA/nccl-tests/issues/212, 2024-05-06"},
    {"what": "all-reduce bus bandwidth against message size, 8 x H200 in one node (NVLink 4), nccl-tests "
             "built on NCCL 2.30.7; above NVLink's 450 GB/s line rate at the large end, which the source "
             "puts down to NVLink SHARP",
     "value": "1 MiB ~72, 16 MiB ~242, 64 MiB ~370, 256 MiB ~442, 1 GiB ~464, 16 GiB ~481 GB/s busbw",
     "source": "S. Bekman, Machine Learning Engineering, network/benchmarks/README.md "
               "(github.com/stas00/ml-engineering)"},
    {"what": "all-reduce bus bandwidth, 24 x A100-SXM4-40GB on 3 nodes (4 x HDR 200 Gb/s InfiniBand a node), "
             "sizes 8 B to 128 MB",
     "value": "~84.8 GB/s busbw on average over the sizes, ~96 GB/s at its peak, against the 100 GB/s "
              "its poster works out from the NICs",
     "source": "nccl-tests issue 119, github.com/NVIDIA/nccl-tests/issues/119, 2022-11-17"},
    {"what": "Llama 3.1 8B, FSDP, 8 x H100 (96 GB), local batch 2, selective activation checkpointing",
     "value": "5,762 tokens/s per GPU, 82.4 GiB memory",
     "source": "torchtitan docs/performance.md, Table 1 (github.com/pytorch/torchtitan)"},
    {"what": "the same, + torch.compile", "value": "6,667 tokens/s per GPU, 77.0 GiB memory",
     "source": "torchtitan docs/performance.md, Table 1"},
    {"what": "the same, + torch.compile + Float8", "value": "8,532 tokens/s per GPU, 76.8 GiB memory",
     "source": "torchtitan docs/performance.md, Table 1"},
]


def published_text() -> str:
    """The published figures, each marked published with its source: none is a ShardLab measurement."""
    lines = ["Published by others (not measured by ShardLab): what a recorded GPU run is compared with."]
    for row in PUBLISHED:
        lines.append(f"  published: {row['what']}: {row['value']}  [{row['source']}]")
    return "\n".join(lines)


def default_path() -> Path:
    """``$SHARDLAB_GPU_RESULTS``, else workshop/recorded/gpu_results.json in the repository
    that contains the working directory (notebooks run from notebooks/)."""
    if os.environ.get("SHARDLAB_GPU_RESULTS"):
        return Path(os.environ["SHARDLAB_GPU_RESULTS"])
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "workshop").is_dir():
            return folder / RELATIVE
    return here / RELATIVE


def hardware() -> dict:
    """What this process runs on: GPU model, count, memory, host, torch and NCCL versions."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: only runs on a GPU are recorded")
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpus_per_host": torch.cuda.device_count(),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1), "host": socket.gethostname(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def gpu_runs(path=None) -> list[dict]:
    """The recorded runs that ran on a GPU (a dry run's entries are not)."""
    data = load(path)
    return [r for r in (data or {"runs": []})["runs"] if not r["hardware"].get("dry_run")]


def banner(path=None) -> str:
    """Notebook 06's first line: whether a GPU run has ever been recorded, and if so where."""
    runs = gpu_runs(path)
    if not runs:
        return ("NO GPU RUN HAS BEEN RECORDED YET. The GPU cells of this notebook have not run on a GPU; "
                "on a laptop they run on CPU ranks and say what a GPU would show. The first GPU node "
                "runs `python workshop/gpu_check.py --record` (workshop/README.md, step 1).")
    hw = runs[0]["hardware"]
    return (f"Recorded on a GPU: {hw.get('gpu', '?')} x{hw.get('gpus_per_host', '?')}, "
            f"{min(r['date'] for r in runs)[:10]}, torch {hw.get('torch', '?')}, NCCL {hw.get('nccl', '?')} "
            f"({', '.join(r['kind'] for r in runs)}).")


def load(path=None) -> dict | None:
    """The recorded runs, or None when nothing was recorded. A malformed file is an error."""
    path = Path(path) if path is not None else default_path()
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        raise ValueError(f"{path}: expected {{'runs': [...]}}; delete the file or fix it")
    for run in runs:
        missing = {"kind", "date", "command", "hardware", "rows"} - set(run)
        if missing or run["kind"] not in KINDS:
            raise ValueError(f"{path}: a run lacks {sorted(missing)} or has an unknown kind; expected kinds {KINDS}")
    return data


def record(kind: str, rows: list[dict], *, command: str, hardware_info: dict | None = None, path=None,
           **extra) -> Path:
    """Write (or replace) the ``kind`` entry with measured ``rows``; returns the file's path.

    ``hardware_info`` defaults to :func:`hardware`, which refuses to run without a GPU: a CPU
    dry run must never end up in a file of GPU results.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    if not rows:
        raise ValueError("nothing to record: rows is empty")
    path = Path(path) if path is not None else default_path()
    data = load(path) or {"runs": []}
    entry = {"kind": kind, "command": command, "hardware": hardware_info or hardware(), "rows": rows,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}
    data["runs"] = [r for r in data["runs"] if r["kind"] != kind] + [entry]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _bandwidth_table(run: dict) -> list[str]:
    lines = [f"{'collective':16}{'ranks':>6}{'size (MB)':>11}{'time (ms)':>11}{'busbw (GB/s)':>14}",
             "(busbw: the nccl-tests bus bandwidth, bytes / time x (N-1)/N, x 2(N-1)/N for all-reduce)"]
    for r in run["rows"]:
        lines.append(f"{r['kind']:16}{r['world_size']:>6}{r['size_bytes'] / 2**20:>11.0f}"
                     f"{r['seconds'] * 1e3:>11.3f}{r.get('busbw_gbs', 0):>14.1f}")
    for kind, fit in run.get("fit", {}).items():
        gbs = fit["bandwidth_gbs"] if "bandwidth_gbs" in fit else fit["bandwidth_gbps"] / 8
        lines.append(f"α-β fit, {kind}: β = {gbs:.1f} GB/s, α = {fit['latency_us']:.1f} µs")
    return lines


def _node_table(run: dict) -> list[str]:
    n = run["rows"][0]
    lines = [f"cuda:{g['index']}: {g['name']}, {g['memory_gib']} GiB, sm {g['capability']}" for g in n["gpus"]]
    lines += n["topology"].splitlines()
    if n["p2p"]:
        lines.append("P2P access: " + " ".join("".join("y" if ok else "." for ok in row) for row in n["p2p"]))
    return lines


def _rows_table(run: dict) -> list[str]:
    """Any other kind: one line per row, its fields as name=value."""
    return ["  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
            for r in run["rows"]]


def _memory_table(run: dict) -> list[str]:
    """Per stage and rank: CUDA's bytes at rest beside the tensor tally and the formula, and
    CUDA's peak beside the tally's peak, each with the ratio."""
    lines = [f"{'stage':>5}{'rank':>5}{'cuda rest':>11}{'tally':>8}{'formula':>9}{'ratio':>7}"
             f"{'cuda peak':>11}{'tally':>8}{'ratio':>7}   (MB)"]
    for r in run["rows"]:
        lines.append(f"{r['stage']:>5}{r['rank']:>5}{r['cuda_rest'] / 1e6:>11.2f}{r['tally_rest'] / 1e6:>8.2f}"
                     f"{r['formula_rest'] / 1e6:>9.2f}{r['cuda_rest'] / r['formula_rest']:>7.2f}"
                     f"{r['cuda_peak'] / 1e6:>11.2f}{r['tally_peak'] / 1e6:>8.2f}{r['cuda_peak'] / r['tally_peak']:>7.2f}")
    return lines


def text(path=None) -> str:
    """The recorded runs as text, each marked "recorded" with its hardware, date and command."""
    data = load(path)
    if not data or not data["runs"]:
        return NOT_YET
    out = []
    for run in data["runs"]:
        hw = run["hardware"]
        if hw.get("dry_run"):
            out.append(f"DRY RUN on CPU ranks, not a GPU result: {run['kind']}, {run['date']} on {hw.get('host', '?')}")
        else:
            out.append(f"recorded {run['kind']}: {run['date']} on {hw.get('gpu', '?')} "
                       f"(x{hw.get('gpus_per_host', '?')} per host, {hw.get('host', '?')}; torch {hw.get('torch', '?')}, "
                       f"NCCL {hw.get('nccl', '?')})")
        out.append(f"command: {run['command']}")
        table = {"bandwidth": _bandwidth_table, "memory": _memory_table, "node": _node_table}.get(run["kind"], _rows_table)
        out += table(run)
        out.append("")
    return "\n".join(out).rstrip()


def show(path=None) -> None:
    print(text(path))
