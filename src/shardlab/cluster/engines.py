"""The ranks' processes: one ipyparallel engine each, joined in one process group, and their health.

:class:`Engines` owns what lives outside the kernel: the ipyparallel cluster and its client,
the rendezvous store, each rank's pid, device and start-up line, and the temporary profile
folder. :class:`Health` is the one state a run reads and marks:

    state          meaning                                        repaired, before the next run, by
    STOPPED        not started, or stopped for good               nothing: a run refuses it
    STARTING       engines coming up, ranks joining the group     (start() finishes)
    RUNNING        every rank up, the group whole                 -
    GROUP_BROKEN   a rank failed and left the process group       init_group(), ~0.1 s, variables kept
    ENGINES_DEAD   a rank died or would not answer; engines killed restart, variables lost

A run only marks what a failure broke (:meth:`Engines.mark`), so that the error reaches the
notebook at once; ``Cluster`` repairs it before the next run.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import shutil
import tempfile
import time
from enum import Enum

from shardlab.cluster.on_rank import init_rank
from shardlab.cluster.processes import engine_processes, kill, launch_config, processes


class Health(Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    GROUP_BROKEN = "group broken"
    ENGINES_DEAD = "needs restart"


#: How bad each state is: a mark never makes the health better (a dead engine stays dead
#: although its group is also broken).
_WORSE = [Health.RUNNING, Health.GROUP_BROKEN, Health.ENGINES_DEAD]


def phase(world_size: int, up: int, joined: int) -> str:
    """The start-up bar's label: engines coming up, then ranks joining the process group."""
    if up < world_size:
        return f"starting {world_size} ranks: {up}/{world_size} engines up"
    if joined < world_size:
        return f"starting {world_size} ranks: {world_size} engines up, {joined}/{world_size} joined the process group"
    return f"starting {world_size} ranks: {world_size} engines up, process group joined"


class Engines:
    """``world_size`` engine processes for one cluster; ``start`` and ``stop`` may repeat."""

    def __init__(self, world_size: int, backend: str, timeout: float, *, threads: int | None,
                 start_timeout: float, launcher: str, host: str, launcher_config: dict):
        self.world_size, self.backend, self.timeout, self.threads = world_size, backend, timeout, threads
        self.start_timeout = start_timeout
        self.launcher = launcher  # "local", or an ipyparallel launcher such as "slurm"
        self.host = host
        self.launcher_config = launcher_config
        self.health = Health.STOPPED
        self.pids: list[int] = []
        #: each rank's device and start-up line ("[rank 0] cuda:0, gloo for CPU tensors, ...")
        self.devices: list[str] = []
        self.lines: list[str] = []
        self.client = None  # the ipyparallel client: runs send through it
        self.ids: list[int] = []  # engine id of each rank
        self.profile_dir: str | None = None
        self._ipp = None  # ipyparallel.Cluster
        self._store = None  # the rendezvous TCPStore, hosted here

    def mark(self, health: Health) -> None:
        """Note what a failure broke; never better than it was."""
        if self.health in _WORSE and _WORSE.index(health) > _WORSE.index(self.health):
            self.health = health

    def start(self, bar) -> None:
        """Start the engines and join them in a process group; ``bar`` (tqdm) shows both phases."""
        import ipyparallel as ipp

        self.health = Health.STARTING
        self.profile_dir = tempfile.mkdtemp(prefix="shardlab-ipp-")
        config = launch_config(self.launcher, self.profile_dir, self.launcher_config)
        self._ipp = ipp.Cluster(
            n=self.world_size, engines=self.launcher, profile_dir=self.profile_dir,
            config=config, load_profile=False, log_level=logging.WARNING, delay=0.0,
            engine_timeout=int(self.start_timeout),
            **({"controller_ip": "*", "controller_location": self.host}
               if self.launcher != "local" else {}),
        )
        self._ipp.start_cluster_sync()
        self.client = self._ipp.connect_client_sync()
        deadline = time.monotonic() + self.start_timeout
        while len(self.client.ids) < self.world_size:
            if len(self.client.ids) != bar.n:
                bar.set_description_str(phase(self.world_size, len(self.client.ids), 0))
                bar.update(len(self.client.ids) - bar.n)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self.client.ids)} of {self.world_size} engines registered within "
                    f"{self.start_timeout:.0f} s; the machine may be overloaded. Retry with a "
                    f"smaller world_size or a larger start_timeout. Engine logs: {self.profile_dir}/log")
            time.sleep(0.05)
        bar.set_description_str(phase(self.world_size, self.world_size, 0))
        bar.update(self.world_size - bar.n)
        self.ids = sorted(self.client.ids)[: self.world_size]
        infos = self.init_group(progress=bar)
        self.pids = [info["pid"] for info in infos]
        self.devices = [info["device"] for info in infos]
        self.lines = [info["line"] for info in infos]
        self.health = Health.RUNNING

    def init_group(self, progress=None) -> list[dict]:
        """(Re)build the process group on every rank, with a fresh store on a fresh port."""
        import torch.distributed as dist

        old, self._store = self._store, None
        del old  # frees the previous port
        self._store = dist.TCPStore(self.host if self.launcher != "local" else "127.0.0.1", 0,
                                    self.world_size + 1, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=max(self.timeout, 120.0)))
        results = [
            self.client[eid].apply_async(init_rank, rank, self.world_size, self.host, self._store.port,
                                         self.backend, self.timeout, self.threads, self.launcher != "local")
            for rank, eid in enumerate(self.ids)
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
                progress.set_description_str(phase(self.world_size, self.world_size, rank + 1))
                progress.update(1)
        if self.health is Health.GROUP_BROKEN:
            self.health = Health.RUNNING
        return infos

    def kill(self) -> None:
        """Kill the ranks' processes now; the next run restarts them."""
        if self._ipp is None:
            return
        kill(engine_processes(self._ipp))

    def stop(self) -> None:
        """Stop the engines and the controller, and make sure every one of their processes is gone."""
        self.health = Health.STOPPED
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
        if self._ipp is not None:
            self._ipp.log.setLevel(logging.CRITICAL)  # killed engines are expected: no log dumps
            # Ranks hold nothing worth a graceful shutdown: kill them all, then let ipyparallel
            # notice (quick, since nothing is left to wait for).
            kill(processes(self._ipp))
            with contextlib.suppress(Exception):
                self._ipp.stop_cluster_sync()
            self._ipp = None
        self._store = None
        if self.profile_dir:
            shutil.rmtree(self.profile_dir, ignore_errors=True)
            self.profile_dir = None
        self.ids, self.pids, self.devices, self.lines = [], [], [], []
