"""Run a function on N local ranks, in fresh processes, and get one result per rank back.

This is the batch-mode launcher used by the tests, the benchmark and scripts (the notebook
path uses persistent ipyparallel engines instead, see :mod:`shardlab.cluster`). It is built
so that it never hangs and never leaves processes behind:

* the parent owns the rendezvous ``TCPStore`` on a free port picked by the OS, so there is no
  port race and nothing to clean up;
* every process group gets a timeout, so a mismatched collective raises instead of hanging;
* the parent waits at most ``timeout`` seconds, then kills every child and raises;
* an exception on any rank comes back as :class:`RankError` naming the rank and its traceback.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import queue
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """One or more ranks failed; ``.failures`` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in self.failures.items())
        super().__init__(f"rank(s) {ranks} failed:\n{detail}")


#: With a GPU per rank, one process group carries both kinds of tensor: CPU tensors over gloo
#: (every notebook's ``torch.arange``), CUDA tensors over NCCL (the GPU cells).
GPU_BACKEND = "cpu:gloo,cuda:nccl"
_DEVICES, _BACKENDS = ("cpu", "cuda"), ("gloo", "nccl")


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def carriers(backend: str) -> dict[str, str]:
    """Which backend carries which tensors: ``"cpu:gloo,cuda:nccl"`` -> {"cpu": "gloo", "cuda": "nccl"}.

    A plain name carries what it can: gloo CPU tensors, NCCL only CUDA tensors (it refuses CPU
    tensors: "No backend type associated with device type cpu").
    """
    if backend == "gloo":
        return {"cpu": "gloo"}
    if backend == "nccl":
        return {"cuda": "nccl"}
    pairs = [part.split(":") for part in backend.split(",")]
    if not all(len(p) == 2 and p[0] in _DEVICES and p[1] in _BACKENDS for p in pairs):
        raise ValueError(f"backend must be 'auto', 'gloo', 'nccl' or a map such as {GPU_BACKEND!r}, "
                         f"got {backend!r}")
    return dict(pairs)


def pick_backend(backend: str, ranks: int, gpus: int | None = None) -> str:
    """The process group's backend for ``ranks`` processes on a machine with ``gpus`` GPUs.

    ``"auto"``: with a GPU for every rank, :data:`GPU_BACKEND` (CPU tensors over gloo, CUDA
    tensors over NCCL), so that notebooks written for CPU ranks run unchanged on a GPU node;
    otherwise gloo, every rank on CPU. Anything that asks for NCCL without a GPU per rank is
    refused here, with the fix, rather than failing later inside NCCL.
    """
    gpus = gpu_count() if gpus is None else gpus
    if backend == "auto":
        return GPU_BACKEND if gpus >= ranks else "gloo"
    if "nccl" in carriers(backend).values() and gpus < ranks:
        raise RuntimeError(
            f"backend={backend!r} needs one GPU per rank: {ranks} rank(s) on this machine but {gpus} "
            f"CUDA device(s) are visible. Use at most {gpus} rank(s) per machine, or backend='gloo' "
            f"(or 'auto') for CPU ranks.")
    return backend


def device_for(backend: str, local_rank: int) -> torch.device:
    """``cuda:local_rank`` when the group carries CUDA tensors over NCCL, else the CPU."""
    return torch.device("cuda", local_rank) if carriers(backend).get("cuda") == "nccl" else torch.device("cpu")


def describe(rank: int, device, backend: str) -> str:
    """One rank's start-up line: ``[rank 0] cuda:0, gloo for CPU tensors, nccl for CUDA tensors``."""
    what = ", ".join(f"{name} for {kind.upper()} tensors" for kind, name in carriers(backend).items())
    return f"[rank {rank}] {device}, {what}"


def init_rank(rank: int, world_size: int, store=None, backend: str = "gloo", timeout: float = 60.0,
              threads: int | None = 1, local_rank: int | None = None) -> torch.device:
    """Join the process group as ``rank`` and return this rank's device.

    ``store=None`` meets the peers by env:// rendezvous (MASTER_ADDR / MASTER_PORT, as torchrun
    sets them). ``backend`` is a name or a device map (:func:`carriers`); when NCCL carries CUDA
    tensors the device is ``cuda:local_rank`` (default: $LOCAL_RANK, else ``rank``).
    ``threads=1`` keeps N ranks from fighting over the cores (and avoids the fork-after-threads
    hang); pass ``None`` to keep torch's default.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    # Import torch._dynamo before the group exists. Every torch optimizer imports it on first
    # use, and importing it takes references to the default group that destroy_process_group
    # does not drop: the group, and gloo's threads, then outlive it and are torn down only by
    # the C++ static destructors at exit, which can abort the process ("terminate called
    # without an active exception") after training has finished. Imported first, nothing holds
    # the group, and destroy_process_group stops its threads.
    importlib.import_module("torch._dynamo")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Bind the group to the GPU (eager NCCL set-up) only for NCCL alone. A cpu:gloo,cuda:nccl
    # group stays unbound: NCCL starts at the first CUDA collective, and barrier() and the
    # *_object helpers use gloo, so notebooks that never touch a GPU never depend on NCCL.
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
        **({"device_id": device} if backend == "nccl" else {}),
    )
    return device


def _worker(rank, world_size, port, backend, pg_timeout, threads, fn, args, kwargs, results):
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout))
        init_rank(rank, world_size, store, backend, pg_timeout, threads)
        out = fn(*args, **kwargs)
        # pickled here, by value: torch's queue would share tensors through this process's memory
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, labelled
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo",
              threads: int | None = 1, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return their results in rank order.

    ``fn`` must be importable (defined in a module, not in a notebook: use
    :func:`shardlab.start_cluster` there). Its return value must be picklable; return CPU tensors.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    results = ctx.Queue()
    # Collectives time out a little before the parent gives up, so ranks report their own error.
    pg_timeout = max(5.0, timeout * 0.8)
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(r, world_size, store.port, backend, pg_timeout, threads, fn, args, kwargs, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outputs, failures = {}, {}
    try:
        while len(outputs) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outputs) - set(failures))
                failures.update({r: f"no answer within {timeout:.0f} s (hung or killed)" for r in missing})
                break
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in outputs and r not in failures]
                for r in dead:
                    failures[r] = f"process died with exit code {procs[r].exitcode}"
                continue
            (outputs if ok else failures)[rank] = pickle.loads(out) if ok else out
            if failures:  # one rank failed: give the others a moment to report, then stop
                deadline = min(deadline, time.monotonic() + min(10.0, pg_timeout))
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        del store
    if failures:
        raise RankError(failures)
    return [outputs[r] for r in range(world_size)]
