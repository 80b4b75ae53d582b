"""Ranks inside a notebook: one persistent ipyparallel engine per rank, joined in one process group.

::

    cluster = shardlab.start_cluster(world_size=4)      # ~10 s once, on a 2-core laptop
    cluster.run(fn, *args)                              # fn(*args) on every rank -> [result per rank]

    %%ranks                                             # this cell runs on every rank,
    x = torch.arange(4.) + rank                         # output labelled [rank r]
    x

    cluster.pull("x")[2]                                # what rank 2 holds now
    cluster.stop()                                      # or: with shardlab.start_cluster(4) as cluster:

Why persistent engines rather than ``mp.spawn``: spawn re-imports torch in every child on every
run (~15 s for 4 ranks on 2 cores) and cannot pickle functions defined in a notebook. Engines pay
the start once; after that a run costs ~0.02 s, functions travel with ipyparallel's pickling, and
variables stay on each rank between cells, which is what lets a learner look at rank 2's shard.

The runtime never hangs and never leaves processes behind:

* the notebook's kernel hosts the rendezvous store on a port the OS picks (no port races);
* every process group has a timeout, so a collective that some rank never joins raises
  :class:`CollectiveTimeout` on the waiting rank instead of hanging;
* a rank that raises drops its process group at once, so ranks blocked in a collective with it
  fail within milliseconds ("a peer failed") instead of waiting for the timeout; the group is
  rebuilt, cheaply and automatically, before the next run; variables on the ranks are kept;
* a rank that does not answer at all (an endless loop) is interrupted, and if that fails the
  engines are killed and restarted on the next run;
* engines and the controller watch the kernel: if it dies, even by SIGKILL, they kill
  themselves within a second; ``stop()``, the context manager and ``atexit`` stop them otherwise.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import datetime
import importlib
import io
import itertools
import linecache
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types
import weakref

from shardlab.launch import RankError

#: Ranks beyond this many per CPU core only queue for the CPU; start_cluster refuses them.
RANKS_PER_CORE = 2

#: Seconds to wait, after the run deadline, for an interrupted rank to give control back.
_INTERRUPT_GRACE = 3.0

_clusters: weakref.WeakSet = weakref.WeakSet()  # every live Cluster, stopped at exit
_current: Cluster | None = None  # the one %%ranks talks to (the last started)
_cell_numbers = itertools.count(1)  # names %%ranks cells in tracebacks, on each rank


class ClusterError(RankError):
    """One or more ranks failed in :meth:`Cluster.run`; ``.failures`` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str], message: str):
        self.failures = dict(sorted(failures.items()))
        RuntimeError.__init__(self, message)


class RankTimeout(ClusterError, TimeoutError):
    """A rank did not finish in time (it was interrupted, or killed if it ignored that)."""


class CollectiveTimeout(RankTimeout):
    """A collective did not complete in time: some rank never joined it."""


# --------------------------------------------------------------------------------------------
# Engine side: these functions run inside the rank processes.
# --------------------------------------------------------------------------------------------

def _user_ns() -> dict:
    """The rank's interactive namespace: where %%ranks cells and notebook functions live."""
    shell = _shell()
    return shell.user_ns if shell is not None else sys.modules["__main__"].__dict__


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - ipyparallel depends on IPython
        return None
    return get_ipython()


def _init_rank(rank: int, world_size: int, host: str, port: int, backend: str, timeout: float,
               threads: int | None) -> dict:
    """(Re)join the process group as ``rank``; put ``rank``, ``world_size``, ``torch``, ``dist``
    and ``device`` in the rank's namespace so cells can use them directly."""
    import torch
    import torch.distributed as dist

    from shardlab.launch import init_rank

    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "nccl":
        # One GPU per engine: local engines take cuda:rank; engines placed by SLURM take their
        # node-local id, modulo the GPUs they see (1 with --gpus-per-task=1).
        local = int(os.environ.get("SLURM_LOCALID", rank))
        os.environ["LOCAL_RANK"] = str(local % max(1, torch.cuda.device_count()))
    # Joining may take long on a busy laptop, a collective should not: join with a generous
    # timeout, then set the collectives' one.
    join = max(timeout, 120.0)
    store = dist.TCPStore(host, port, world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=join))
    device = init_rank(rank, world_size, store, backend, join, threads)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    _user_ns().update(rank=rank, world_size=world_size, torch=torch, dist=dist, device=device)
    return {"pid": os.getpid(), "device": str(device)}


def _drop_process_group() -> None:
    """Leave the process group so peers blocked on this rank fail now instead of at the timeout."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "nccl":  # destroying with NCCL work in flight can block
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
                return
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort; the kernel rebuilds the group anyway
        pass


def _failure(exc: BaseException) -> dict:
    """Describe an exception as plain data: the kernel formats it (it has the cells' source)."""
    import torch

    hidden = (__file__, os.path.dirname(torch.__file__) + os.sep)  # our wrapper, torch's insides
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename != hidden[0] and not f.filename.startswith(hidden[1])]
    text = f"{type(exc).__name__}: {exc}"
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "frames": [(f.filename, f.lineno, f.name, f.line) for f in frames],
        "timeout": "timed out" in text.lower(),
        "peer": any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                        "Broken pipe", "DistBackendError")),
        "interrupted": isinstance(exc, KeyboardInterrupt),
    }


def _on_rank(kind: str, payload, args=(), kwargs=None, imports=None, defs=None) -> dict:
    """Run a function (``kind="call"``) or a cell's source (``kind="cell"``) on this rank.

    Output is captured and returned with the result, so the kernel can print it labelled by
    rank, in rank order. Any exception is returned as data, after leaving the process group.
    """
    ns = _user_ns()
    for alias, module in (imports or {}).items():
        if alias not in ns:
            ns[alias] = importlib.import_module(module)
    for name, value in (defs or {}).items():
        ns[name] = value.build(ns) if isinstance(value, _ClassSpec) else value
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


def _exec_cell(source: str, ns: dict) -> tuple[bool, object]:
    """Run a cell like IPython does: statements, then the value of a final expression, if any."""
    shell = _shell()
    if shell is not None:
        source = shell.transform_cell(source)  # %magics and !shell lines work in %%ranks cells
    filename = f"<%%ranks cell {next(_cell_numbers)}>"
    # Keep the source so that tracebacks on this rank show the failing line.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename=filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), ns)
    if last is None:
        return False, None
    value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
    return value is not None, value


class _ClassSpec:
    """A class defined in the notebook, sent by value and rebuilt on each rank.

    ipyparallel's own pickling recurses forever on a method that calls ``super()`` (its
    ``__class__`` cell points back at the class), so we carry the pieces (bases, functions
    as code, other attributes) and rebuild the class in the rank's namespace.
    """

    def __init__(self, cls: type):
        self.name, self.qualname = cls.__name__, cls.__qualname__
        self.bases = tuple(_ClassSpec(b) if b.__module__ == cls.__module__ else b for b in cls.__bases__)
        attrs = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        self.attrs = {k: _pack(v) for k, v in attrs.items()}
        # Kept here only, to find the imports and helpers the methods use (not sent).
        self.methods = [f for v in attrs.values() for f in _functions_in(v)]

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "methods"}

    def build(self, ns: dict) -> type:
        bases = tuple(b.build(ns) if isinstance(b, _ClassSpec) else b for b in self.bases)
        holes: list = []  # __class__ cells, filled once the class exists
        attrs = {k: _unpack(v, ns, holes) for k, v in self.attrs.items()}
        cls = types.new_class(self.name, bases, exec_body=lambda body: body.update(attrs))
        for cell in holes:
            cell.cell_contents = cls
        return cls


def _pack(value):
    if isinstance(value, types.FunctionType):
        cells = tuple(None if name == "__class__" else c.cell_contents
                      for name, c in zip(value.__code__.co_freevars, value.__closure__ or ()))
        return ("fn", value.__code__, value.__defaults__, value.__kwdefaults__, value.__name__,
                value.__qualname__, value.__code__.co_freevars, cells)
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, _pack(value.__func__))
    if isinstance(value, property):
        return ("property", *(_pack(f) if f else None for f in (value.fget, value.fset, value.fdel)), value.__doc__)
    return ("value", value)


def _functions_in(value) -> list:
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, (staticmethod, classmethod)):
        return [value.__func__]
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f]
    return []


def _unpack(packed, ns, holes):
    kind = packed[0]
    if kind == "fn":
        _, code, defaults, kwdefaults, name, qualname, freevars, values = packed
        cells = []
        for var, value in zip(freevars, values):
            cells.append(types.CellType() if var == "__class__" else types.CellType(value))
            if var == "__class__":
                holes.append(cells[-1])
        fn = types.FunctionType(code, ns, name, defaults, tuple(cells) or None)
        fn.__kwdefaults__, fn.__qualname__ = kwdefaults, qualname
        return fn
    if kind in ("staticmethod", "classmethod"):
        return {"staticmethod": staticmethod, "classmethod": classmethod}[kind](_unpack(packed[1], ns, holes))
    if kind == "property":
        fget, fset, fdel = (_unpack(f, ns, holes) if f else None for f in packed[1:4])
        return property(fget, fset, fdel, packed[4])
    return packed[1]


def _pull(name: str):
    ns = _user_ns()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    return ns[name]


# A tiny prelude for the controller and engine processes: if the kernel that started them dies
# (even by SIGKILL, when no atexit handler runs), they kill their own process group within 0.5 s.
# Plain code, no shardlab import, so the controller does not pay for importing torch.
_GUARD = """\
import os, runpy, signal, sys, threading, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
_kernel = os.getppid()
def _watch():
    while os.getppid() == _kernel:
        time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=_watch, daemon=True, name="shardlab-orphan-guard").start()
if {preload}:
    threading.Thread(target=lambda: __import__("torch.distributed"), daemon=True).start()
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def _guarded(module: str, tag: str, preload: bool = False) -> list[str]:
    """The command line of a guarded process; ``tag`` makes its processes easy to find (ps)."""
    code = f"# shardlab cluster {tag}\n" + _GUARD.format(module=module, preload=preload)
    return [sys.executable, "-c", code]


# --------------------------------------------------------------------------------------------
# Kernel side.
# --------------------------------------------------------------------------------------------

def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def _pick_backend(backend: str, world_size: int) -> str:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise RuntimeError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} CUDA "
            f"device(s) are visible. Use world_size<={gpus}, or backend='gloo' for CPU ranks.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def _references(fn) -> tuple[dict, dict]:
    """Imports and notebook-defined functions/classes that ``fn`` uses, to send along with it.

    ipyparallel runs a notebook function against the rank's namespace, where the notebook's own
    helpers and ``import numpy as np`` do not exist. We send those (modules by name, functions
    and classes by value) but never data: a rank's variables are its own.
    """
    imports: dict[str, str] = {}
    defs: dict[str, object] = {}
    home = getattr(fn, "__module__", None)
    seen: set[int] = set()

    def names(code):
        yield from code.co_names
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from names(const)

    def visit(f):
        if id(f) in seen or not isinstance(f, types.FunctionType):
            return
        seen.add(id(f))
        for name in set(names(f.__code__)):
            if name not in f.__globals__:
                continue
            value = f.__globals__[name]
            if isinstance(value, types.ModuleType):
                imports[name] = value.__name__
            elif isinstance(value, types.FunctionType) and value.__module__ == home:
                defs[name] = value
                visit(value)
            elif isinstance(value, type) and value.__module__ == home and name not in defs:
                defs[name] = spec = _ClassSpec(value)
                for method in spec.methods:
                    visit(method)

    if home == "__main__" or (isinstance(home, str) and home.startswith("__")):
        visit(fn)
    return imports, defs


def _label(rank: int, text: str) -> str:
    return "\n".join(f"[rank {rank}] {line}" for line in text.rstrip("\n").splitlines())


class Cluster:
    """``world_size`` ranks, one ipyparallel engine each, in one torch.distributed process group.

    Build it with :func:`start_cluster`. ``timeout`` (seconds) bounds every collective; a run
    that gets no answer from a rank within ``timeout`` plus a margin interrupts that rank.
    """

    def __init__(self, world_size: int = 4, backend: str = "auto", timeout: float = 60.0, *,
                 threads: int | None = 1, max_ranks_per_core: int = RANKS_PER_CORE,
                 start_timeout: float = 120.0, engines: str = "local", host: str | None = None,
                 launcher_config: dict | None = None, quiet: bool = False):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        cores = _cores()
        if engines == "local" and world_size > max_ranks_per_core * cores:
            raise ValueError(
                f"world_size={world_size} is more than {max_ranks_per_core} ranks per core on this "
                f"{cores}-core machine: every rank is a process, and beyond that they only queue "
                f"for the CPU. Use world_size<={max_ranks_per_core * cores}, or override with "
                f"start_cluster({world_size}, max_ranks_per_core={-(-world_size // cores)}).")
        self.world_size = world_size
        self.backend = _pick_backend(backend, world_size)
        self.timeout = float(timeout)
        self.threads = threads
        self.start_timeout = float(start_timeout)
        self.engines = engines
        self.host = host or ("127.0.0.1" if engines == "local" else _routable_host())
        self.launcher_config = launcher_config or {}
        self.quiet = quiet
        self.start_seconds: float | None = None
        self.pids: list[int] = []
        self._ipp = None  # ipyparallel.Cluster
        self._client = None
        self._ids: list[int] = []  # engine id of each rank
        self._store = None  # the rendezvous TCPStore, hosted here
        self._profile_dir: str | None = None
        self._needs_restart = False
        self._group_dirty = False
        self._stopped = True

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start the engines and join them in a process group (progress bar, then its duration)."""
        import ipyparallel as ipp
        from tqdm.auto import tqdm
        from traitlets.config import Config

        t0 = time.perf_counter()
        self._stopped = False
        _clusters.add(self)
        self._profile_dir = tempfile.mkdtemp(prefix="shardlab-ipp-")
        config = Config()
        if self.engines == "local":
            config.LocalControllerLauncher.controller_cmd = _guarded("ipyparallel.controller", self._profile_dir)
            config.LocalEngineSetLauncher.engine_cmd = _guarded("ipyparallel.engine", self._profile_dir, preload=True)
            config.LocalEngineSetLauncher.delay = 0.0
            # Fewer processes start faster on a laptop: schedulers as threads, no nanny per
            # engine (we interrupt and watch local engines by pid ourselves).
            config.LocalControllerLauncher.controller_args = ["--IPController.use_threads=True"]
            config.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False"]
        config.merge(Config(self.launcher_config))  # e.g. {"SlurmEngineSetLauncher": {...}}
        bar = tqdm(total=2 * self.world_size, desc=f"starting {self.world_size} ranks",
                   disable=self.quiet, leave=False)
        try:
            self._ipp = ipp.Cluster(
                n=self.world_size, engines=self.engines, profile_dir=self._profile_dir,
                config=config, load_profile=False, log_level=logging.WARNING, delay=0.0,
                engine_timeout=int(self.start_timeout),
                **({"controller_ip": "*", "controller_location": self.host}
                   if self.engines != "local" else {}),
            )
            self._ipp.start_cluster_sync()
            self._client = self._ipp.connect_client_sync()
            deadline = time.monotonic() + self.start_timeout
            while len(self._client.ids) < self.world_size:
                if len(self._client.ids) != bar.n:
                    bar.update(len(self._client.ids) - bar.n)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"only {len(self._client.ids)} of {self.world_size} engines registered within "
                        f"{self.start_timeout:.0f} s; the machine may be overloaded. Retry with a "
                        f"smaller world_size or a larger start_timeout. Engine logs: {self._profile_dir}/log")
                time.sleep(0.05)
            bar.update(self.world_size - bar.n)
            self._ids = sorted(self._client.ids)[: self.world_size]
            self.pids = [info["pid"] for info in self._init_group(progress=bar)]
        except BaseException:
            bar.close()
            self.stop()
            raise
        bar.close()
        self._needs_restart = False
        self.start_seconds = time.perf_counter() - t0
        if not self.quiet:
            print(f"{self}: ready in {self.start_seconds:.1f} s")
        return self

    def _init_group(self, progress=None) -> list[dict]:
        """(Re)build the process group on every rank, with a fresh store on a fresh port."""
        import torch.distributed as dist

        old, self._store = self._store, None
        del old  # frees the previous port
        self._store = dist.TCPStore(self.host if self.engines != "local" else "127.0.0.1", 0,
                                    self.world_size + 1, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=max(self.timeout, 120.0)))
        results = [
            self._client[eid].apply_async(_init_rank, rank, self.world_size, self.host,
                                          self._store.port, self.backend, self.timeout, self.threads)
            for rank, eid in enumerate(self._ids)
        ]
        infos = []
        deadline = time.monotonic() + self.start_timeout
        for rank, ar in enumerate(results):
            try:
                infos.append(ar.get(timeout=max(0.1, deadline - time.monotonic())))
            except Exception as exc:
                raise RuntimeError(
                    f"rank {rank} could not join the {self.backend} process group: {exc}") from exc
            if progress is not None:
                progress.update(1)
        self._group_dirty = False
        return infos

    def restart(self) -> Cluster:
        """Stop every engine and start fresh ones (variables on the ranks are lost)."""
        quiet, self.quiet = self.quiet, True
        try:
            self.stop()
        finally:
            self.quiet = quiet
        return self.start()

    def stop(self) -> None:
        """Stop the engines and the controller, and make sure every one of their processes is gone."""
        global _current
        self._stopped = True
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        if self._ipp is not None:
            self._ipp.log.setLevel(logging.CRITICAL)  # killed engines are expected: no log dumps
            # Ranks hold nothing worth a graceful shutdown: kill them all, then let ipyparallel
            # notice (quick, since nothing is left to wait for).
            _kill(self._processes())
            with contextlib.suppress(Exception):
                self._ipp.stop_cluster_sync()
            self._ipp = None
        self._store = None
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None
        self._ids, self.pids = [], []
        if _current is self:
            _current = None

    def _processes(self) -> list:
        """Every process of this cluster: launcher processes and all their descendants."""
        import psutil

        procs = []
        launchers = [self._ipp.controller] if self._ipp.controller is not None else []
        for engine_set in self._ipp.engines.values():
            launchers.extend(getattr(engine_set, "launchers", {}).values())
        for launcher in launchers:
            pid = getattr(launcher, "pid", -1)
            if pid and pid > 0:
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    procs.append(p)
                    procs.extend(p.children(recursive=True))
        return procs

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("needs restart" if self._needs_restart else "running")
        device = "GPU" if self.backend == "nccl" else "CPU"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r} ({device}), {state})"

    # ---- running code on the ranks --------------------------------------------------------

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` may be defined in the notebook; it sees the rank's variables (``rank``,
        ``world_size``, ``dist``, ``torch``, and whatever %%ranks cells defined), plus the
        imports and notebook functions it uses. Its printed output is shown labelled by rank.
        Raises :class:`ClusterError` naming the failed ranks, with their tracebacks.
        """
        if not callable(fn):
            raise TypeError(f"run expects a function, got {type(fn).__name__}")
        imports, defs = _references(fn)
        values, error = self._submit("call", fn, args, kwargs, imports, defs, timeout)
        if error is not None:
            raise error  # raised here, so that the notebook's traceback ends at cluster.run
        return values

    def run_cell(self, source: str, timeout: float | None = None) -> list:
        """Run notebook-cell source on every rank (what %%ranks does); print output by rank."""
        values, error = self._submit("cell", source, (), {}, {}, {}, timeout, show_values=True)
        if error is not None:
            raise error
        return values

    def pull(self, name: str) -> list:
        """The value of variable ``name`` on every rank, in rank order: ``cluster.pull("x")[2]``."""
        values, error = self._submit("call", _pull, (name,), {}, {}, {}, None)
        if error is not None:
            raise error
        return values

    def _ready(self) -> None:
        if self._stopped:
            raise RuntimeError(
                "this cluster is stopped. Start a new one with cluster = shardlab.start_cluster(...)")
        if self._needs_restart:
            if not self.quiet:
                print("restarting the ranks after the last failure (their variables are lost) ...")
            self.restart()
        elif self._group_dirty:
            self._init_group()  # a rank failed last time and left the group: rebuild it (~0.1 s)

    def _submit(self, kind, payload, args, kwargs, imports, defs, timeout, show_values=False):
        """Run on every rank; return (values in rank order, None) or (None, the error to raise)."""
        self._ready()
        waiting = self.timeout if timeout is None else float(timeout)
        results = [self._client[eid].apply_async(_on_rank, kind, payload, args, kwargs, imports, defs)
                   for eid in self._ids]
        # The ranks' own collective timeout fires first; this margin only catches ranks that
        # never return to Python (an endless loop, a dead device).
        deadline = time.monotonic() + waiting + max(5.0, 0.1 * waiting)
        try:
            outcomes = self._collect(results, deadline)
        except KeyboardInterrupt:  # the notebook's stop button: stop the ranks too, then stop
            self._interrupt(list(range(self.world_size)))
            self._group_dirty = True
            try:
                late = self._collect(results, time.monotonic() + _INTERRUPT_GRACE)
            except KeyboardInterrupt:
                late = [None]
            if any(o is None for o in late):
                self._needs_restart = True
                self._kill_engines()
            raise
        hung = [r for r, o in enumerate(outcomes) if o is None]
        if hung:
            self._interrupt(hung)
            outcomes = self._collect(results, time.monotonic() + _INTERRUPT_GRACE, outcomes)
        self._show(outcomes, show_values)
        failures = {r: o for r, o in enumerate(outcomes) if o is None or not o.get("ok")}
        if not failures:
            return [o["value"] for o in outcomes], None
        self._group_dirty = True
        if any(o is None or o.get("died") for o in failures.values()):
            self._needs_restart = True
            self._kill_engines()  # free the CPU now; restarted on the next run
        return None, self._error(failures, waiting)

    def _collect(self, results, deadline, outcomes=None) -> list:
        """Wait until every rank answered or the deadline passed; None for ranks that did not."""
        outcomes = list(outcomes or [None] * len(results))
        next_check = time.monotonic() + 0.2
        while True:
            for rank, ar in enumerate(results):
                if outcomes[rank] is None and ar.ready():
                    try:
                        outcomes[rank] = ar.get(0)
                    except Exception as exc:  # noqa: BLE001 - the engine itself failed
                        outcomes[rank] = _died(f"{type(exc).__name__}: {exc}")
            if all(o is not None for o in outcomes) or time.monotonic() > deadline:
                return outcomes
            if time.monotonic() > next_check:  # a dead engine never answers: look for it
                next_check = time.monotonic() + 0.2
                for rank, code in self._exit_codes().items():
                    if outcomes[rank] is None:
                        how = "" if code is None else f" with code {code}"
                        outcomes[rank] = _died(f"its process exited{how}: a crash, os._exit or out of memory")
            self._client.wait(results, timeout=0.01)

    def _exit_codes(self) -> dict[int, int | None]:
        """Ranks whose local engine process is gone, with its exit code when known."""
        if self.engines != "local":
            return {}
        import psutil

        gone = {}
        for rank, pid in enumerate(self.pids):
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    gone[rank] = proc.wait(0)
            except psutil.NoSuchProcess:
                gone[rank] = None
            except psutil.TimeoutExpired:
                pass
        return gone

    def _interrupt(self, ranks) -> None:
        """Send SIGINT (KeyboardInterrupt) to ranks stuck in Python code."""
        if self.engines == "local":
            for rank in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pids[rank], signal.SIGINT)
        else:
            self._client.send_signal(signal.SIGINT, targets=[self._ids[r] for r in ranks], block=False)

    def _show(self, outcomes, show_values) -> None:
        for rank, o in enumerate(outcomes):
            if o is None:
                continue
            if o.get("stdout"):
                print(_label(rank, o["stdout"]))
            if o.get("stderr"):
                print(_label(rank, o["stderr"]), file=sys.stderr)
            if show_values and o.get("ok") and o.get("has_value"):
                print(_label(rank, _pretty(o["value"])))

    def _error(self, failures: dict, waited: float) -> ClusterError:
        """Turn per-rank failures into one readable error: the cause first, the echoes after."""
        texts, hung, died, timed_out, peers, causes = {}, [], [], [], [], []
        for rank, o in sorted(failures.items()):
            if o is None:
                hung.append(rank)
                texts[rank] = f"no answer within {waited:.0f} s, even after an interrupt"
                continue
            err = o["error"]
            texts[rank] = _format_error(err)
            if o.get("died"):
                died.append(rank)
            elif err["timeout"]:
                timed_out.append(rank)
            elif err["peer"]:
                peers.append(rank)
            else:
                causes.append(rank)
        lines = []
        interrupted = [r for r in causes if failures[r]["error"]["interrupted"]]
        causes = [r for r in causes if r not in interrupted]
        for rank in causes:
            err = failures[rank]["error"]
            lines.append(f"rank {rank} raised {err['type']}: {err['message']}")
        if interrupted:
            lines.append(f"rank(s) {_ranks(interrupted)} did not answer within {waited:.0f} s and were "
                         "interrupted (KeyboardInterrupt); they are usable again")
        if died:
            why = failures[died[0]]["error"]["message"].splitlines()[0]
            lines.append(f"rank(s) {_ranks(died)} died ({why}); the ranks restart on the next run, "
                         "and their variables are lost")
        if timed_out:
            lines.append(
                f"rank(s) {_ranks(timed_out)}: a collective did not complete within {self.timeout:.0f} s. "
                "Every rank must call the same collectives in the same order; here some rank never "
                "joined (a mismatched collective, or a rank that skipped it or failed before it)")
        if peers:
            lines.append(f"rank(s) {_ranks(peers)} stopped waiting in a collective because a peer failed")
        if hung:
            lines.append(f"rank(s) {_ranks(hung)} did not answer within {waited:.0f} s and ignored an "
                         "interrupt; the ranks restart on the next run, and their variables are lost")
        if not died and not hung:
            lines.append("the process group is rebuilt before the next run; variables on the ranks are kept")
        shown = causes or timed_out or interrupted or died or peers or hung
        detail = "\n".join(f"\n--- rank {r} ---\n{texts[r]}" for r in shown)
        message = "\n".join(lines) + "\n" + detail
        cls = ClusterError
        if not causes and not died:
            cls = CollectiveTimeout if timed_out else RankTimeout if (interrupted or hung) else ClusterError
        return cls({r: texts[r] for r in failures}, message)

    def _kill_engines(self) -> None:
        if self._ipp is None:
            return
        procs = [p for p in self._processes() if "ipyparallel.controller" not in " ".join(_cmdline(p))]
        _kill(procs)


def _died(why: str) -> dict:
    return {"ok": False, "died": True, "stdout": "", "stderr": "",
            "error": {"type": "RankDied", "message": why, "frames": [], "timeout": False,
                      "peer": False, "interrupted": False}}


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001
        return []


def _kill(procs) -> None:
    """SIGKILL whatever is still alive in ``procs`` and reap it."""
    import psutil

    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                alive.append(p)
    psutil.wait_procs(procs, timeout=5)


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _pretty(value) -> str:
    try:
        from IPython.lib.pretty import pretty
        return pretty(value)
    except Exception:  # noqa: BLE001
        return repr(value)


def _format_error(err: dict) -> str:
    """A traceback in Python's own format; lines missing on the rank come from the kernel's cells."""
    lines = ["Traceback (most recent call last):"] if err["frames"] else []
    for filename, lineno, name, line in err["frames"]:
        line = line or linecache.getline(filename, lineno).strip()
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        if line:
            lines.append(f"    {line}")
    lines.append(f"{err['type']}: {err['message']}")
    return "\n".join(lines)


def _routable_host() -> str:
    import socket

    return socket.getfqdn()


def start_cluster(world_size: int = 4, backend: str = "auto", timeout: float = 60.0, **options) -> Cluster:
    """Start ``world_size`` ranks for this notebook and return the :class:`Cluster`.

    ``backend="auto"`` picks NCCL with one GPU per rank when CUDA has enough devices, else gloo
    on CPU. ``timeout`` (seconds) bounds every collective. A second call replaces the first
    cluster. Options: ``threads`` per rank (1), ``max_ranks_per_core`` (2), ``start_timeout``
    (120 s), ``quiet``; for engines on other machines (see workshop/README.md): ``engines``
    (an ipyparallel launcher such as "slurm"), ``host`` (this machine's address as the ranks
    see it) and ``launcher_config`` (traitlets config for that launcher, as a dict).
    Also registers the ``%%ranks`` cell magic when running under IPython.
    """
    global _current
    if _current is not None:
        _current.stop()
    cluster = Cluster(world_size, backend, timeout, **options)
    cluster.start()
    _current = cluster
    _register_magic()
    return cluster


def current() -> Cluster:
    """The cluster that %%ranks uses: the last one started."""
    if _current is None or _current._stopped:
        raise RuntimeError("no cluster is running: start one with cluster = shardlab.start_cluster(4)")
    return _current


def _register_magic() -> None:
    shell = _shell()
    if shell is None or getattr(shell, "_shardlab_magic", False):
        return

    def ranks(line, cell):
        """%%ranks [timeout]: run this cell on every rank of the current cluster; output by rank."""
        timeout = float(line) if line.strip() else None
        _, error = current()._submit("cell", cell, (), {}, {}, {}, timeout, show_values=True)
        if error is not None:
            raise error  # the notebook's traceback ends here, not deep in the runtime

    shell.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    shell._shardlab_magic = True


@atexit.register
def _stop_all() -> None:
    for cluster in list(_clusters):
        with contextlib.suppress(Exception):
            cluster.stop()
