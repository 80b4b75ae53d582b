"""Train the course's demo GPT at any ZeRO stage: the same engine code, outside the notebook.

::

    python -m shardlab train --stage 3 --steps 20 --size small                       # 1 process
    torchrun --standalone --nproc-per-node 4 -m shardlab.train --stage 3 --size small  # 4 CPU ranks
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint $HEAD:29500 -m shardlab.train --stage 3 --size gpt-13m  # 16 GPUs

Under torchrun each process reads RANK / WORLD_SIZE / LOCAL_RANK from the environment; on GPUs
it uses NCCL and ``cuda:LOCAL_RANK``, on CPU gloo. Every rank builds the same model from
``--seed`` and takes rows ``rank::world_size`` of the same global batch, so the run is the same
computation whatever the layout: 1 node x 4 processes and 2 nodes x 2 give the same weights.
``--save`` writes rank 0's ``full_state_dict`` to compare them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.engine import api, comm
from shardlab.launch import init_rank


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardlab train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3],
                   help="0 = DDP, 1 = ZeRO-1, 2 = ZeRO-2, 3 = ZeRO-3 / FSDP (default 3)")
    p.add_argument("--size", default="tiny", choices=sorted(models.SIZES), help="demo GPT size (default tiny)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default 16)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    p.add_argument("--data", default="count", choices=["count", "random"],
                   help="count: rows that count up by 1, 2 or 3, which the model visibly learns "
                        "(default); random: random tokens, nothing to learn (a timing load)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the data (default 0)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="fix the global batch instead (sequences per step over all ranks); then "
                        "layouts with different world sizes see the same data")
    p.add_argument("--bf16", action="store_true", help="gather and compute weights in bfloat16")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: NCCL when CUDA is available, else gloo")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any collective may wait before failing instead of hanging (default 300)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: cores / local processes)")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves the final full_state_dict here (torch.save)")
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps (default: ~10 lines)")
    return p.parse_args(argv)


def setup(args) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment (or a group of one)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            raise SystemExit(f"error: backend nccl needs cuda:{local_rank}, but "
                             f"{torch.cuda.device_count()} GPU(s) are visible on this node. "
                             "Use --nproc-per-node <= GPUs per node, or --backend gloo.")
        threads = None
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = args.threads or max(1, cores // local_world)
    if "MASTER_ADDR" in os.environ:  # torchrun (or srun with the variables set): env:// rendezvous
        device = init_rank(rank, world_size, None, backend, args.timeout, threads, local_rank=local_rank)
    else:  # plain `python -m shardlab.train`: a group of one, so the same engine code runs
        device = init_rank(0, 1, dist.HashStore(), backend, args.timeout, threads, local_rank=local_rank)
    return rank, world_size, device


def checksum(state: dict[str, torch.Tensor]) -> str:
    """A short fingerprint of the weights: equal strings mean bit-identical tensors."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(args) -> dict:
    rank, world_size, device = setup(args)
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.global_batch is not None:
        if args.global_batch % world_size:
            raise SystemExit(f"error: --global-batch {args.global_batch} does not split over "
                             f"{world_size} ranks; use a multiple of {world_size}")
        args.batch_size = args.global_batch // world_size
    torch.manual_seed(args.seed)  # same initial weights on every rank (parallelize also syncs them)
    model = models.gpt(args.size).to(device)
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = api.parallelize(
        model, stage=args.stage, optimizer_cls=torch.optim.AdamW, lr=args.lr,
        mixed_precision=torch.bfloat16 if args.bf16 else None)
    say(f"shardlab train: GPT {args.size} ({n_params / 1e6:.2f} M params), stage {args.stage}, "
        f"{world_size} rank(s) on {dist.get_backend()} ({device.type}), "
        f"{args.batch_size} x {cfg.seq} tokens per rank ({args.data} data), {args.steps} steps, seed {args.seed}")
    log_every = args.log_every or max(1, args.steps // 10)
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    for step in range(1, args.steps + 1):
        make = models.counting_batch if args.data == "count" else models.batch
        x, y = make(cfg, args.batch_size, seed=args.seed * 1_000_003 + step, rank=rank, world_size=world_size)
        loss = models.lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % log_every == 0 or step == args.steps:
            loss_sum.copy_(loss.detach())
            comm.all_reduce(loss_sum)  # SUM, then divide: the mean loss of the global batch
            say(f"step {step:>5}/{args.steps}  loss {loss_sum.item() / world_size:.4f}  "
                f"{(time.perf_counter() - t0) / step:.3f} s/step")
    state = api.full_state_dict(model)  # a collective: every rank takes part
    digest = checksum(state)
    say(f"done in {time.perf_counter() - t0:.1f} s; weights checksum {digest}")
    if rank == 0 and args.save:
        torch.save({name: t.cpu() for name, t in state.items()}, args.save)
        say(f"saved the full state dict to {args.save}")
    return {"checksum": digest, "loss": loss_sum.item() / world_size}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        train(args)
        # Leave together: a rank that tears down its gloo pairs while a peer still uses them can
        # make that peer abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
