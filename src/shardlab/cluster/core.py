"""The :class:`Cluster`: start the ranks, run code on them, repair what a run broke, stop them for good.

Starting costs seconds (processes, imports, rendezvous), so a cluster is started once per
notebook and kept; what a run breaks is repaired cheaply before the next one (the engines'
:class:`~shardlab.cluster.engines.Health`, see ``engines.py``). Stopping does not trust anything
to exit by itself: it kills every process of the cluster and reaps them, and ``atexit`` stops
whatever the notebook did not.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref

from shardlab.cluster.engines import Engines, Health, phase
from shardlab.cluster.magic import register_ranks_magic
from shardlab.cluster.on_rank import ipython_shell, pull_value
from shardlab.cluster.processes import cores, routable_host
from shardlab.cluster.runs import INTERRUPT_GRACE, submit
from shardlab.cluster.shipping import references

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
        n_cores = cores()
        if engines == "local" and world_size > max_ranks_per_core * n_cores:
            raise ValueError(
                f"world_size={world_size} is more than {max_ranks_per_core} ranks per core on this "
                f"{n_cores}-core machine: every rank is a process, and beyond that they only queue "
                f"for the CPU. Use world_size<={max_ranks_per_core * n_cores}, or override with "
                f"start_cluster({world_size}, max_ranks_per_core={-(-world_size // n_cores)}).")
        self.world_size = world_size
        self.backend = _pick_backend(backend, world_size, engines)
        self.timeout = float(timeout)
        self.engines = engines
        self.quiet = quiet
        #: True shows the runtime's own frames in errors (also: environment SHARDLAB_DEBUG=1)
        self.debug = False
        #: seconds an interrupted rank has to answer before it is killed (restarted next run)
        self.interrupt_grace = INTERRUPT_GRACE
        self.start_seconds: float | None = None
        #: the ranks' processes and their health
        self.pool = Engines(world_size, self.backend, self.timeout, threads=threads,
                            start_timeout=float(start_timeout), launcher=engines,
                            host=host or ("127.0.0.1" if engines == "local" else routable_host()),
                            launcher_config=launcher_config or {})

    @property
    def pids(self) -> list[int]:
        return self.pool.pids

    @property
    def devices(self) -> list[str]:
        """Each rank's device: ``cpu``, or ``cuda:r``."""
        return self.pool.devices

    @property
    def lines(self) -> list[str]:
        """Each rank's start-up line ("[rank 0] cuda:0, gloo for CPU tensors, ...")."""
        return self.pool.lines

    @property
    def health(self) -> Health:
        return self.pool.health

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start the engines and join them in a process group, with a progress bar for both."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        _clusters.add(self)
        # Two phases of world_size steps each; the label says which (no bare "0/8"). The bar
        # stays (leave=True): closing a notebook bar's widget races its display ("Error
        # displaying widget: model not found"). The time taken is in the repr, not here.
        bar = tqdm(total=2 * self.world_size, desc=phase(self.world_size, 0, 0), disable=self.quiet,
                   leave=True, bar_format="{desc}  {bar}")
        try:
            self.pool.start(bar)
        except BaseException:
            bar.close()
            self.stop()
            raise
        bar.close()
        self.start_seconds = time.perf_counter() - t0
        # No "ready" line: the cluster's repr says it, once (a notebook cell shows the repr).
        # On GPUs each rank's device and backends are printed, so nobody guesses what runs where.
        if not self.quiet and any(d != "cpu" for d in self.devices):
            print("\n".join(self.lines))
        return self

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
        self.pool.stop()
        if _current is self:
            _current = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        health = self.health
        state = {Health.STOPPED: "stopped", Health.ENGINES_DEAD: "needs restart"}.get(health, "running")
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

    # ---- running code on the ranks --------------------------------------------------------

    def _ready(self) -> None:
        """Refuse a stopped cluster; repair what the last run broke, before this one."""
        if self.health is Health.STOPPED:
            raise RuntimeError(
                "this cluster is stopped. Start a new one with cluster = shardlab.start_cluster(...)")
        if self.health is Health.ENGINES_DEAD:
            if not self.quiet:
                print("restarting the ranks after the last failure (their variables are lost) ...")
            self.restart()
        elif self.health is Health.GROUP_BROKEN:
            self.pool.init_group()  # a rank failed last time and left the group: rebuild it (~0.1 s)

    def _run(self, kind, payload, args=(), kwargs=None, imports=None, defs=None, timeout=None, show_values=False):
        self._ready()
        values, error = submit(self.pool, kind, payload, args, kwargs or {}, imports or {}, defs or {},
                               waiting=self.timeout if timeout is None else float(timeout),
                               interrupt_grace=self.interrupt_grace, debug=self.debug, show_values=show_values)
        if error is not None:
            raise error  # raised here, so that the notebook's traceback ends at the cluster's method
        return values

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
        imports, defs = references(fn)
        for arg in (*args, *kwargs.values()):  # a function passed along (a lab's check gets the
            if callable(arg):                  # learner's) needs what it uses, too
                more_imports, more_defs = references(arg)
                imports, defs = {**more_imports, **imports}, {**more_defs, **defs}
        return self._run("call", fn, args, kwargs, imports, defs, timeout)

    def run_cell(self, source: str, timeout: float | None = None, *, name: str | None = None,
                 first_line: int = 1) -> list:
        """Run notebook-cell source on every rank (what %%ranks does); print output by rank.

        ``name`` and ``first_line`` say how tracebacks show the cell: %%ranks passes Jupyter's
        ``Cell In[10]`` and 2 (the body starts after the magic's line)."""
        cell = source if name is None and first_line == 1 else (source, name, first_line)
        return self._run("cell", cell, timeout=timeout, show_values=True)

    def pull(self, name: str) -> list:
        """The value of variable ``name`` on every rank, in rank order: ``cluster.pull("x")[2]``."""
        return self._run("call", pull_value, (name,))


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
    global _current
    if _current is not None:
        _current.stop()
    cluster = Cluster(world_size, backend, timeout, **options)
    cluster.start()
    _current = cluster
    register_ranks_magic(ipython_shell(), current)
    return cluster


def current() -> Cluster:
    """The cluster that %%ranks uses: the last one started."""
    if _current is None or _current.health is Health.STOPPED:
        raise RuntimeError("no cluster is running: start one with cluster = shardlab.start_cluster(4)")
    return _current


@atexit.register
def _stop_all() -> None:
    for cluster in list(_clusters):
        with contextlib.suppress(Exception):
            cluster.stop()
