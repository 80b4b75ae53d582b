"""Run this first on the workshop machines: can every GPU talk to every other, and how fast?

    torchrun --standalone --nproc-per-node $(nvidia-smi -L | wc -l) workshop/gpu_check.py
    srun --ntasks-per-node 1 torchrun ... workshop/gpu_check.py      # across nodes (see train.sbatch)

It prints, from rank 0, one line per rank (host, GPU, memory total and free), then NCCL
all-reduce bandwidth for 1 MB to 256 MB messages. ``busbw`` is the number nccl-tests reports:
algorithm bandwidth x 2(N-1)/N, comparable across world sizes; expect a good fraction of the
link's speed (NVLink: hundreds of GB/s; PCIe: ~10-25 GB/s; between nodes: the network's).
Without GPUs it runs on gloo over CPU, as a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="NCCL all-reduce bandwidth and GPU memory per rank")
    p.add_argument("--sizes-mb", default="1,16,64,256", help="message sizes in MB (default 1,16,64,256)")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size (default 10)")
    p.add_argument("--timeout", type=float, default=120, help="seconds before a stuck collective fails")
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
        print(f"\n{'size':>8}  {'time':>9}  {'algbw':>10}  {'busbw':>10}")

    for mb in (int(s) for s in args.sizes_mb.split(",")):
        x = torch.ones(mb * 2**20 // 4, device=device)  # fp32
        for _ in range(2):  # warm up: connections, buffers
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.iters
        worst = torch.tensor([seconds], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        algbw = x.numel() * 4 / worst.item() / 1e9
        if rank == 0:
            print(f"{mb:>6}MB  {worst.item() * 1e3:>7.2f}ms  {algbw:>6.2f} GB/s  "
                  f"{algbw * 2 * (world - 1) / world:>6.2f} GB/s")
        del x

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
