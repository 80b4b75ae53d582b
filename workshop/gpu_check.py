"""Run this first on the workshop machines: can every GPU talk to every other, and how fast?

    torchrun --standalone --nproc-per-node $(nvidia-smi -L | wc -l) workshop/gpu_check.py
    srun --ntasks-per-node 1 torchrun ... workshop/gpu_check.py      # across nodes (see train.sbatch)

It prints, from rank 0, one line per rank (host, GPU, memory total and free), then the time
of NCCL all-gather, reduce-scatter and all-reduce for 1 MB to 256 MB buffers, through the same
``shardlab.engine.comm`` the engine uses. ``busbw`` is the number nccl-tests reports (algorithm
bandwidth x (N-1)/N, x 2(N-1)/N for all-reduce), comparable across world sizes; expect a good
fraction of the link's speed (NVLink: hundreds of GB/s; PCIe: ~10-25 GB/s; between nodes: the
network's). Then the α-β fit of each collective (``shardlab.instruments.link.fit_link``): the
latency and bandwidth notebook 06 feeds into the ring model.

``--record`` writes all of it to workshop/recorded/gpu_results.json (hardware, date, command),
which notebook 06 shows as "recorded". Without GPUs it runs on gloo over CPU, as a dry run of
the script itself, and records nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.course import gpu_results, measure
from shardlab.instruments.link import fit_link

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="NCCL all-reduce bandwidth and GPU memory per rank")
    p.add_argument("--sizes-mb", default="1,16,64,256", help="full buffer sizes in MB (default 1,16,64,256)")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size (default 10)")
    p.add_argument("--timeout", type=float, default=120, help="seconds before a stuck collective fails")
    p.add_argument("--record", nargs="?", const="", default=None, metavar="PATH",
                   help="write the results to workshop/recorded/gpu_results.json (or PATH) on a GPU run")
    args = p.parse_args(argv)

    if "RANK" not in os.environ:
        print("run me under torchrun: torchrun --standalone --nproc-per-node N workshop/gpu_check.py")
        return 2
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        if local_rank >= torch.cuda.device_count():
            print(f"error: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs on "
                  f"{socket.gethostname()}: use --nproc-per-node <= GPUs per node", file=sys.stderr)
            return 1
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout),
                            **({"device_id": device} if cuda else {}))
    rank, world = dist.get_rank(), dist.get_world_size()

    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        me = f"{torch.cuda.get_device_name(device)}, {total / 2**30:.1f} GiB total, {free / 2**30:.1f} GiB free"
    else:
        me = "CPU (no CUDA: a dry run on gloo)"
    rows = [None] * world
    dist.all_gather_object(rows, f"rank {rank:>3} on {socket.gethostname()} {device}: {me}")
    if rank == 0:
        print(f"{world} ranks, backend {dist.get_backend()}, torch {torch.__version__}"
              + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if cuda else ""))
        print("\n".join(rows))

    sizes = [int(mb) for mb in args.sizes_mb.split(",")]
    rows = measure.collective_times(sizes, iters=args.iters, device=device)
    fits = {}
    for row in rows:
        algbw = row["size_bytes"] / row["seconds"] / 1e9
        row["busbw_gbs"] = algbw * (world - 1) / world * (2 if row["kind"] == "all_reduce" else 1)
    if world > 1:
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            mine = [r for r in rows if r["kind"] == kind]
            try:
                fit = fit_link(kind, [r["size_bytes"] for r in mine], [r["seconds"] for r in mine], world)
            except ValueError as e:  # times that do not grow with size: too noisy to fit
                if rank == 0:
                    print(f"no α-β fit for {kind}: {e}")
                continue
            fits[kind] = {"bandwidth_gbps": fit.bandwidth_gbps, "latency_us": fit.latency_us}
    if rank == 0:
        print(f"\n{'collective':16}{'size':>8}  {'time':>9}  {'busbw':>10}")
        for r in rows:
            print(f"{r['kind']:16}{r['size_bytes'] // 2**20:>6}MB  {r['seconds'] * 1e3:>7.2f}ms  {r['busbw_gbs']:>6.2f} GB/s")
        for kind, fit in fits.items():
            print(f"α-β fit, {kind}: β = {fit['bandwidth_gbps']:.1f} Gbit/s, α = {fit['latency_us']:.1f} µs")
        if args.record is not None:
            if cuda:
                where = gpu_results.record("bandwidth", rows, command=" ".join(["torchrun ...", *sys.argv]),
                                           path=args.record or HERE / "recorded" / "gpu_results.json",
                                           fit=fits, world_size=world)
                print(f"recorded in {where}")
            else:
                print("--record: nothing recorded, this was a CPU dry run (only GPU runs are recorded)")

    ok = torch.tensor([1.0], device=device)
    dist.all_reduce(ok)  # sum of ones: every rank answered
    if rank == 0:
        good = int(ok.item()) == world
        print(f"\n{'OK' if good else 'FAILED'}: {int(ok.item())} of {world} ranks answered an all-reduce")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
