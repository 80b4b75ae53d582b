"""The :class:`Cluster`: start the ranks, join them in a process group, stop them for good.

Starting costs seconds (processes, imports, rendezvous), so a cluster is started once per
notebook and kept; what a run breaks is repaired cheaply before the next one (see runs.py).
Stopping does not trust anything to exit by itself: it kills every process of the cluster and
reaps them, and ``atexit`` stops whatever the notebook did not.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import shutil
import tempfile
import time
import weakref

from shardlab.cluster.on_rank import _init_rank, _pull
from shardlab.cluster.processes import (
    _cores,
    _engine_processes,
    _kill,
    _launch_config,
    _processes,
    _routable_host,
)
from shardlab.cluster.runs import _INTERRUPT_GRACE, _Runs
from shardlab.cluster.shipping import _references

#: Ranks beyond this many per CPU core only queue for the CPU; start_cluster refuses them.
RANKS_PER_CORE = 2

_clusters: weakref.WeakSet = weakref.WeakSet()  # every live Cluster, stopped at exit
_current: Cluster | None = None  # the one %%ranks talks to (the last started)


def _pick_backend(backend: str, world_size: int, engines: str = "local", gpus: int | None = None) -> str:
    """The group's backend (see :func:`shardlab.launch.pick_backend`). Engines on other
    machines (SLURM) have GPUs this kernel cannot count: "auto" stays on gloo there, and a
    rank without the GPU an NCCL backend needs says so when it joins."""
    from shardlab.launch import carriers, pick_backend

    if engines != "local":
        carriers(backend if backend != "auto" else "gloo")  # validates the name
        return "gloo" if backend == "auto" else backend
    return pick_backend(backend, world_size, gpus)


def _phase(world_size: int, up: int, joined: int) -> str:
    """The start-up bar's label: engines coming up, then ranks joining the process group."""
    if up < world_size:
        return f"starting {world_size} ranks: {up}/{world_size} engines up"
    if joined < world_size:
        return f"starting {world_size} ranks: {world_size} engines up, {joined}/{world_size} joined the process group"
    return f"starting {world_size} ranks: {world_size} engines up, process group joined"


class Cluster(_Runs):
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
        self.backend = _pick_backend(backend, world_size, engines)
        self.timeout = float(timeout)
        self.threads = threads
        self.start_timeout = float(start_timeout)
        self.engines = engines
        self.host = host or ("127.0.0.1" if engines == "local" else _routable_host())
        self.launcher_config = launcher_config or {}
        self.quiet = quiet
        #: True shows the runtime's own frames in errors (also: environment SHARDLAB_DEBUG=1)
        self.debug = False
        #: seconds an interrupted rank has to answer before it is killed (restarted next run)
        self.interrupt_grace = _INTERRUPT_GRACE
        self.start_seconds: float | None = None
        self.pids: list[int] = []
        #: each rank's device and start-up line ("[rank 0] cuda:0, gloo for CPU tensors, ...")
        self.devices: list[str] = []
        self.lines: list[str] = []
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
        """Start the engines and join them in a process group, with a progress bar for both."""
        import ipyparallel as ipp
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        self._stopped = False
        _clusters.add(self)
        self._profile_dir = tempfile.mkdtemp(prefix="shardlab-ipp-")
        config = _launch_config(self.engines, self._profile_dir, self.launcher_config)
        # Two phases of world_size steps each; the label says which (no bare "0/8"). The bar
        # stays (leave=True): closing a notebook bar's widget races its display ("Error
        # displaying widget: model not found"). The time taken is in the repr, not here.
        bar = tqdm(total=2 * self.world_size, desc=_phase(self.world_size, 0, 0), disable=self.quiet,
                   leave=True, bar_format="{desc}  {bar}")
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
                    bar.set_description_str(_phase(self.world_size, len(self._client.ids), 0))
                    bar.update(len(self._client.ids) - bar.n)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"only {len(self._client.ids)} of {self.world_size} engines registered within "
                        f"{self.start_timeout:.0f} s; the machine may be overloaded. Retry with a "
                        f"smaller world_size or a larger start_timeout. Engine logs: {self._profile_dir}/log")
                time.sleep(0.05)
            bar.set_description_str(_phase(self.world_size, self.world_size, 0))
            bar.update(self.world_size - bar.n)
            self._ids = sorted(self._client.ids)[: self.world_size]
            infos = self._init_group(progress=bar)
            self.pids = [info["pid"] for info in infos]
            self.devices = [info["device"] for info in infos]
            self.lines = [info["line"] for info in infos]
        except BaseException:
            bar.close()
            self.stop()
            raise
        bar.close()
        self._needs_restart = False
        self.start_seconds = time.perf_counter() - t0
        # No "ready" line: the cluster's repr says it, once (a notebook cell shows the repr).
        # On GPUs each rank's device and backends are printed, so nobody guesses what runs where.
        if not self.quiet and any(d != "cpu" for d in self.devices):
            print("\n".join(self.lines))
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
                progress.set_description_str(_phase(self.world_size, self.world_size, rank + 1))
                progress.update(1)
        self._group_dirty = False
        return infos

    def restart(self) -> Cluster:
        """Stop every engine and start fresh ones (variables on the ranks are lost).

        The cluster stays the one ``%%ranks`` talks to, if it was (a dead rank restarts it)."""
        global _current
        was_current = _current is self
        quiet, self.quiet = self.quiet, True
        try:
            self.stop()
        finally:
            self.quiet = quiet
        self.start()
        if was_current:
            _current = self
        return self

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
            _kill(_processes(self._ipp))
            with contextlib.suppress(Exception):
                self._ipp.stop_cluster_sync()
            self._ipp = None
        self._store = None
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None
        self._ids, self.pids, self.devices, self.lines = [], [], [], []
        if _current is self:
            _current = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("needs restart" if self._needs_restart else "running")
        if state == "running" and self.start_seconds is not None:
            state += f", ready in {self.start_seconds:.1f} s"
        return f"Cluster(world_size={self.world_size}, {self.where()}, {state})"

    def where(self) -> str:
        """Where the ranks run and which backend carries which tensors, in one phrase:
        ``rank r on cuda:r, gloo for CPU tensors, nccl for CUDA tensors``."""
        from shardlab.launch import carriers

        what = ", ".join(f"{name} for {kind.upper()} tensors" for kind, name in carriers(self.backend).items())
        if not self.devices:
            return what
        if self.devices == [f"cuda:{r}" for r in range(self.world_size)]:
            return f"rank r on cuda:r, {what}"
        if len(set(self.devices)) == 1:
            return f"ranks on {self.devices[0]}, {what}"
        return f"ranks on {', '.join(self.devices)}, {what}"

    def _kill_engines(self) -> None:
        """Kill the ranks' processes now; the next run restarts them."""
        if self._ipp is None:
            return
        _kill(_engine_processes(self._ipp))

    # ---- running code on the ranks --------------------------------------------------------

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` may be defined in the notebook; it sees the rank's variables (``rank``,
        ``world_size``, ``dist``, ``torch``, and whatever %%ranks cells defined), plus the
        imports and notebook functions it uses (and those that functions passed as arguments use).
        Its printed output is shown labelled by rank.
        Raises :class:`ClusterError` naming the failed ranks, with their tracebacks.
        """
        if not callable(fn):
            raise TypeError(f"run expects a function, got {type(fn).__name__}")
        imports, defs = _references(fn)
        for arg in (*args, *kwargs.values()):  # a function passed along (a lab's check gets the
            if callable(arg):                  # learner's) needs what it uses, too
                more_imports, more_defs = _references(arg)
                imports, defs = {**more_imports, **imports}, {**more_defs, **defs}
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


def start_cluster(world_size: int = 4, backend: str = "auto", timeout: float = 60.0, **options) -> Cluster:
    """Start ``world_size`` ranks for this notebook and return the :class:`Cluster`.

    ``backend="auto"``: with a GPU per rank, rank r drives ``cuda:r`` and the group carries CPU
    tensors over gloo and CUDA tensors over NCCL (``"cpu:gloo,cuda:nccl"``), so that cells
    written for CPU ranks run unchanged; without, gloo on CPU. ``"nccl"`` alone carries CUDA
    tensors only. ``timeout`` (seconds) bounds every collective. A second call replaces the first
    cluster. Options: ``threads`` per rank (1), ``max_ranks_per_core`` (2), ``start_timeout``
    (120 s), ``quiet``; for engines on other machines (see workshop/README.md): ``engines``
    (an ipyparallel launcher such as "slurm"), ``host`` (this machine's address as the ranks
    see it) and ``launcher_config`` (traitlets config for that launcher, as a dict).
    Also registers the ``%%ranks`` cell magic when running under IPython.
    """
    from shardlab.cluster.magic import _register_magic  # magic.py needs current(), from here

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


@atexit.register
def _stop_all() -> None:
    for cluster in list(_clusters):
        with contextlib.suppress(Exception):
            cluster.stop()
