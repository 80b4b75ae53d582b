"""Train the course's demo GPT at any ZeRO stage: the same engine code, outside the notebook.

::

    python -m shardlab train --stage 3 --steps 20 --size small                       # 1 process
    torchrun --standalone --nproc-per-node 4 -m shardlab.train --stage 3 --size small  # 4 CPU ranks
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint $HEAD:29500 -m shardlab.train --stage 3 --size gpt-13m  # 16 GPUs
    torchrun --standalone --nproc-per-node 8 -m shardlab.train --model gpt-7b --stage 0 --bf16
        # -> "stage 0 (DDP) ran out of memory ... by the formula ... stage 1 (ZeRO-1) would fit"

Under torchrun each process reads RANK / WORLD_SIZE / LOCAL_RANK from the environment; with a
GPU per process it uses ``cuda:LOCAL_RANK`` (CUDA tensors over NCCL), on CPU gloo. It prints
the loss, tokens/s and model TFLOPS per GPU, and each rank's peak CUDA memory beside the
formula's model states + activations. A stage that does not fit ends in one line that names
the stage, its bytes by the formula and the stage that would fit (:func:`oom_lesson`). Every rank builds the same model from
``--seed`` and takes rows ``rank::world_size`` of the same global batch, so the run is the same
computation whatever the layout: 1 node x 4 processes and 2 nodes x 2 give the same weights.
``--save`` writes rank 0's ``full_state_dict`` to compare them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.engine import api, comm
from shardlab.instruments import memory_math
from shardlab.launch import GPU_BACKEND, describe, device_for, init_rank, pick_backend


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardlab train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3],
                   help="0 = DDP, 1 = ZeRO-1, 2 = ZeRO-2, 3 = ZeRO-3 / FSDP (default 3)")
    p.add_argument("--size", "--model", dest="size", default="tiny", choices=list(models.SIZES),
                   help="GPT size (default tiny); gpt-1b and gpt-7b are for GPUs: on 8 x 80 GB, "
                        "gpt-7b does not fit at stage 0 and fits at stage 3")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing: each block keeps only its input, recomputed in backward")
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
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", GPU_BACKEND],
                   help=f"auto: {GPU_BACKEND} with a GPU per process on this node, else gloo on CPU")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any collective may wait before failing instead of hanging (default 300)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: cores / local processes)")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves the final full_state_dict here (torch.save)")
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps (default: ~10 lines)")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the run's summary here (workshop/gpu_check.py reads it)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory per device for the out-of-memory lesson (default: the GPU's own)")
    return p.parse_args(argv)


def setup(args) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment (or a group of one)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    try:  # a GPU for each of this node's processes, or a clear error / gloo on CPU
        backend = pick_backend(args.backend, local_world)
    except RuntimeError as e:
        raise SystemExit(f"error: {e} (torchrun: --nproc-per-node <= GPUs per node)") from None
    if device_for(backend, local_rank).type == "cuda":
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


def recipe(args) -> memory_math.Recipe:
    """This engine's bytes per parameter: bf16 weights, fp32 gradients (reduced in fp32, as
    FSDP2's reduce_dtype), fp32 master + Adam moments = 2 + 4 + 12; in fp32, 4 + 4 + 8."""
    return memory_math.Recipe("bf16, fp32 grads", 2, 4, 12) if args.bf16 else memory_math.RECIPES["fp32-adam"]


def formula(args, world_size: int) -> dict:
    """Bytes per rank by the formula: model states at this stage, and the activations kept for backward."""
    cfg = models.SIZES[args.size]
    psi = memory_math.gpt_param_count(cfg)
    states = memory_math.model_state_bytes(psi, world_size, recipe(args))
    acts = memory_math.activation_bytes(cfg, args.batch_size, 2 if args.bf16 else 4,
                                        checkpoint=args.checkpoint)["total"]
    return {"params": psi, "states": states[memory_math.stage_name(args.stage)], "activations": acts,
            "states_by_stage": states}


def oom_lesson(args, world_size: int, device_bytes: float | None) -> str:
    """The one line a stage that does not fit ends with: the stage, its bytes by the formula,
    and the least sharded stage that would fit (or what else to change)."""
    f = formula(args, world_size)
    name = memory_math.STAGE_LABELS[memory_math.stage_name(args.stage)]
    need = f"{f['states'] / 1e9:.1f} GB of model states ({recipe(args).bytes_per_param} bytes x " \
           f"{f['params'] / 1e9:.2f} B params, stage {args.stage} over {world_size} rank(s)) + " \
           f"{f['activations'] / 1e9:.1f} GB of activations per rank"
    have = f" on a {device_bytes / 1e9:.0f} GB device" if device_bytes else ""
    fits = None
    if device_bytes:
        fits = memory_math.first_fitting_stage(f["params"], world_size, device_bytes, recipe(args),
                                               reserve_bytes=f["activations"])
    if fits is not None and memory_math.STAGES.index(fits) > args.stage:
        stage = memory_math.STAGES.index(fits)
        hint = (f"stage {stage} ({memory_math.STAGE_LABELS[fits]}) would fit: "
                f"{f['states_by_stage'][fits] / 1e9:.1f} GB of states; run --stage {stage}")
    else:
        hint = ("no stage fits by the formula: more GPUs, --checkpoint, a smaller --batch-size "
                "or a smaller --model")
    return f"out of memory at stage {args.stage} ({name}){have}: by the formula it needs {need}; {hint}"


def flops_per_token(cfg, params: int) -> float:
    """Model FLOPs per trained token: 6 per parameter (forward 2, backward 4) plus attention's
    12·L·T·d. Recompute under --checkpoint is not counted (the MFU convention)."""
    return 6 * params + 12 * cfg.n_layer * cfg.seq * cfg.d


def train(args) -> dict:
    rank, world_size, device = setup(args)
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.global_batch is not None:
        if args.global_batch % world_size:
            raise SystemExit(f"error: --global-batch {args.global_batch} does not split over "
                             f"{world_size} ranks; use a multiple of {world_size}")
        args.batch_size = args.global_batch // world_size
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)  # same initial weights on every rank (parallelize also syncs them)
    cfg = models.SIZES[args.size]
    # Small models are built on CPU and moved, so a GPU run starts from the CPU run's weights;
    # a billion-parameter model is built on its device (8 ranks x 27 GB of host memory is not).
    build_on = device if memory_math.gpt_param_count(cfg) > 2e8 else torch.device("cpu")
    with build_on:
        model = models.gpt(args.size, checkpoint=args.checkpoint).to(device)
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = api.parallelize(
        model, stage=args.stage, optimizer_cls=torch.optim.AdamW, lr=args.lr,
        mixed_precision=torch.bfloat16 if args.bf16 else None)
    say(f"shardlab train: GPT {args.size} ({n_params / 1e6:.2f} M params), stage {args.stage}, "
        f"{world_size} rank(s) on {dist.get_backend()} ({device.type}), "
        f"{args.batch_size} x {cfg.seq} tokens per rank ({args.data} data), {args.steps} steps, seed {args.seed}"
        + (", activation checkpointing" if args.checkpoint else ""))
    say(describe(rank, device, dist.get_backend()))
    log_every = args.log_every or max(1, args.steps // 10)
    t0 = time.perf_counter()
    t_first = None  # the first step warms up (allocator, kernels): tokens/s count from step 2
    loss_sum = torch.zeros((), device=device)
    losses = []
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
            losses.append(loss_sum.item() / world_size)
            say(f"step {step:>5}/{args.steps}  loss {losses[-1]:.4f}  "
                f"{(time.perf_counter() - t0) / step:.3f} s/step")
        if step == 1:
            if cuda:
                torch.cuda.synchronize(device)
            t_first = time.perf_counter()
    if cuda:
        torch.cuda.synchronize(device)
    timed = max(1, args.steps - 1)
    step_s = (time.perf_counter() - (t_first if args.steps > 1 else t0)) / timed
    tokens = args.batch_size * cfg.seq * world_size  # per step, all ranks
    tflops = flops_per_token(cfg, n_params) * tokens / step_s / world_size / 1e12
    say(f"{step_s:.3f} s/step after the first, {tokens / step_s:,.0f} tokens/s, "
        f"{tflops:.2f} model TFLOPS per {'GPU' if cuda else 'rank'} (6 x params + attention per token)")
    f = formula(args, world_size)
    peaks = comm.gather_lists([torch.cuda.max_memory_allocated(device) if cuda else None])
    expected = f["states"] + f["activations"]
    if cuda:
        say(f"peak CUDA memory per rank: {', '.join(f'{p / 1e9:.2f}' for p in peaks)} GB; formula "
            f"{f['states'] / 1e9:.2f} GB model states + {f['activations'] / 1e9:.2f} GB activations = "
            f"{expected / 1e9:.2f} GB (peak / formula, rank 0: {peaks[0] / expected:.2f})")
    else:
        say(f"formula per rank: {f['states'] / 1e9:.3f} GB model states + {f['activations'] / 1e9:.3f} GB "
            f"activations (CPU ranks: no CUDA peak to set beside it)")
    state = api.full_state_dict(model)  # a collective: every rank takes part
    digest = checksum(state)
    say(f"done in {time.perf_counter() - t0:.1f} s; weights checksum {digest}")
    if rank == 0 and args.save:
        torch.save({name: t.cpu() for name, t in state.items()}, args.save)
        say(f"saved the full state dict to {args.save}")
    summary = {"model": args.size, "params": n_params, "stage": args.stage, "world_size": world_size,
               "backend": dist.get_backend(), "device": device.type, "bf16": args.bf16,
               "checkpoint": args.checkpoint, "batch_size": args.batch_size, "seq": cfg.seq,
               "checksum": digest, "losses": losses, "loss": losses[-1], "step_s": step_s,
               "tokens_per_s": tokens / step_s, "tflops_per_gpu": tflops, "peak_bytes": peaks,
               "formula_states": f["states"], "formula_activations": f["activations"]}
    if rank == 0 and args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=1)
    return summary


def _device_bytes(args) -> float | None:
    if args.gpu_memory_gb:
        return args.gpu_memory_gb * 1e9
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        train(args)
        # Leave together: a rank that tears down its gloo pairs while a peer still uses them can
        # make that peer abort ("terminate called without an active exception").
        comm.barrier()
    except torch.OutOfMemoryError:
        # A lesson, not a crash: one line, and the group is aborted (no peer waits on this rank).
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        lesson = oom_lesson(args, world_size, _device_bytes(args))
        print(f"[rank {os.environ.get('RANK', 0)}] {lesson}", file=sys.stderr, flush=True)
        if args.json and int(os.environ.get("RANK", 0)) == 0:
            with open(args.json, "w") as out:
                json.dump({"stage": args.stage, "model": args.size, "oom": lesson}, out)
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
