"""The code that runs inside each rank: join the process group, run a function or a cell, pull.

The kernel sends these functions to the engines with ipyparallel, which re-imports this module
on the engine and runs them against its globals: so everything they use must be importable
from here, and this file must stay cheap to import (torch is imported inside the functions).

Nothing raised here reaches ipyparallel: :func:`run_on_rank` returns an exception as plain data,
after leaving the process group, so that the kernel can explain the failure rank by rank and
peers blocked in a collective with the failed rank are released at once.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import importlib
import io
import itertools
import linecache
import os
import sys
import traceback

from shardlab.cluster.shipping import ClassSpec

_cell_numbers = itertools.count(1)  # names %%ranks cells in tracebacks, on each rank


def _user_ns() -> dict:
    """The rank's interactive namespace: where %%ranks cells and notebook functions live."""
    shell = ipython_shell()
    return shell.user_ns if shell is not None else sys.modules["__main__"].__dict__


def ipython_shell():
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - ipyparallel depends on IPython
        return None
    return get_ipython()


def gpu_index(rank: int, gpus: int, placed: bool, environ) -> int:
    """Which of the ``gpus`` GPUs this process sees rank ``rank`` drives: one GPU per engine.

    Engines this kernel started take ``cuda:rank``. Engines placed by SLURM (``placed``) take
    their node-local id, ``SLURM_LOCALID``, modulo the GPUs they see (1 with --gpus-per-task=1).
    Only those: a kernel inside a SLURM job (``sbatch workshop/jupyter.sbatch``) has the batch
    step's ``SLURM_LOCALID=0`` in its environment, and its engines inherit it, so reading it
    there would put every rank on cuda:0, which NCCL refuses.
    """
    local = int(environ.get("SLURM_LOCALID", rank)) if placed else rank
    return local % gpus


def init_rank(rank: int, world_size: int, host: str, port: int, backend: str, timeout: float,
               threads: int | None, placed: bool = False) -> dict:
    """(Re)join the process group as ``rank``; put ``rank``, ``world_size``, ``torch``, ``dist``
    and ``device`` in the rank's namespace so cells can use them directly. ``placed``: the engine
    was started by a launcher that places it on a node (SLURM's srun), not by this kernel."""
    import torch
    import torch.distributed as dist

    from shardlab.launch import carriers, describe, init_rank

    if dist.is_initialized():
        dist.destroy_process_group()
    local = rank
    if carriers(backend).get("cuda") == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise RuntimeError(f"backend={backend!r} needs a GPU on every rank, but rank {rank} sees none "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                               "use backend='gloo', or ask SLURM for a GPU per task")
        local = gpu_index(rank, gpus, placed, os.environ)
    # Joining may take long on a busy laptop, a collective should not: join with a generous
    # timeout, then set the collectives' one.
    join = max(timeout, 120.0)
    store = dist.TCPStore(host, port, world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=join))
    device = init_rank(rank, world_size, store, backend, join, threads, local_rank=local)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    _user_ns().update(rank=rank, world_size=world_size, torch=torch, dist=dist, device=device)
    return {"pid": os.getpid(), "device": str(device), "line": describe(rank, device, backend)}


def _drop_process_group() -> None:
    """Leave the process group so peers blocked on this rank fail now instead of at the timeout."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if "nccl" in dist.get_backend():  # destroying with NCCL work in flight can block
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
                return
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort; the kernel rebuilds the group anyway
        pass


def _failure(exc: BaseException) -> dict:
    """Describe an exception as plain data: the kernel formats it (it has the cells' source).

    Every frame travels, each marked hidden or not: the runtime's own (``shardlab/cluster/``)
    and torch's insides are hidden unless the kernel asks for debugging.
    """
    import torch

    hidden = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
              os.path.dirname(torch.__file__) + os.sep)
    frames = traceback.extract_tb(exc.__traceback__)
    text = f"{type(exc).__name__}: {exc}"
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "frames": [(f.filename, f.lineno, f.name, f.line,
                    os.path.abspath(f.filename).startswith(hidden)) for f in frames],
        "timeout": "timed out" in text.lower(),
        "peer": any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                        "Broken pipe", "DistBackendError")),
        "interrupted": isinstance(exc, KeyboardInterrupt),
    }


def run_on_rank(kind: str, payload, args=(), kwargs=None, imports=None, defs=None) -> dict:
    """Run a function (``kind="call"``) or a cell's source (``kind="cell"``) on this rank.

    ``imports`` and ``defs`` are what the function needs from the notebook (see
    ``shipping._references``). Output is captured and returned with the result, so the kernel
    can print it labelled by rank, in rank order. Any exception is returned as data, after
    leaving the process group.
    """
    ns = _user_ns()
    for alias, module in (imports or {}).items():
        if alias not in ns:
            ns[alias] = importlib.import_module(module)
    for name, value in (defs or {}).items():
        ns[name] = value.build(ns) if isinstance(value, ClassSpec) else value
    out, err = io.StringIO(), io.StringIO()
    result = {"ok": True, "value": None, "has_value": False}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if kind == "call":
                result["value"], result["has_value"] = payload(*args, **(kwargs or {})), True
            else:
                result["has_value"], result["value"] = _exec_cell(payload, ns)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the kernel, labelled
        _drop_process_group()
        result = {"ok": False, "error": _failure(exc)}
    result["stdout"], result["stderr"] = out.getvalue(), err.getvalue()
    return result


def remember_lines(filename: str, lines: list[str]) -> None:
    """Keep a notebook cell's lines in this rank's linecache, as IPython does in the kernel, so
    that tracebacks (and lab checks that read the failing line) on this rank can show them."""
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _exec_cell(cell, ns: dict) -> tuple[bool, object]:
    """Run a cell like IPython does: statements, then the value of a final expression, if any.

    ``cell`` is the source, or ``(source, name, first_line)``: %%ranks sends the notebook's
    name for the cell (``Cell In[10]``) and the line its body starts on (2, after the magic),
    so that tracebacks point at the lines the learner sees.
    """
    source, name, first_line = cell if isinstance(cell, tuple) else (cell, None, 1)
    shell = ipython_shell()
    if shell is not None:
        source = shell.transform_cell(source)  # %magics and !shell lines work in %%ranks cells
    source = "\n" * (first_line - 1) + source
    filename = name or f"<%%ranks cell {next(_cell_numbers)}>"
    remember_lines(filename, source.splitlines(True))
    tree = ast.parse(source, filename=filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), ns)
    if last is None:
        return False, None
    value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
    return value is not None, value


def pull_value(name: str):
    """The value of ``name`` on this rank (run through :func:`run_on_rank`, so errors come back too)."""
    ns = _user_ns()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    return ns[name]
