"""The engine and controller processes: started guarded, found, watched and killed by pid.

A notebook kernel can die without running any cleanup (SIGKILL, a crashed kernel), and a rank
stuck in C code ignores polite requests. So the runtime never relies on a graceful shutdown:
every process it starts carries an orphan guard that kills it when the kernel is gone, and
stopping a cluster kills all of its processes outright, then reaps them.
"""

from __future__ import annotations

import contextlib
import os
import sys

# A tiny prelude for the controller and engine processes: if the kernel that started them dies
# (even by SIGKILL, when no atexit handler runs), they remove the cluster's temporary folder and
# kill their own process group within 0.5 s.
# Plain code, no shardlab import, so the controller does not pay for importing torch.
_GUARD = """\
import os, runpy, shutil, signal, sys, threading, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
_kernel = os.getppid()
def _watch():
    while os.getppid() == _kernel:
        time.sleep(0.5)
    shutil.rmtree({folder!r}, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=_watch, daemon=True, name="shardlab-orphan-guard").start()
if {preload}:
    threading.Thread(target=lambda: __import__("torch.distributed"), daemon=True).start()
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def _guarded(module: str, profile_dir: str, preload: bool = False) -> list[str]:
    """The command line of a guarded process; ``profile_dir`` in it makes the cluster's processes
    easy to find (ps), and is removed by the guard if the kernel dies."""
    code = f"# shardlab cluster {profile_dir}\n" + _GUARD.format(module=module, preload=preload,
                                                                  folder=profile_dir)
    return [sys.executable, "-c", code]


def launch_config(engines: str, profile_dir: str, extra: dict):
    """ipyparallel's traitlets config: local processes guarded and lean, then ``extra`` on top."""
    from traitlets.config import Config

    config = Config()
    if engines == "local":
        config.LocalControllerLauncher.controller_cmd = _guarded("ipyparallel.controller", profile_dir)
        config.LocalEngineSetLauncher.engine_cmd = _guarded("ipyparallel.engine", profile_dir, preload=True)
        config.LocalEngineSetLauncher.delay = 0.0
        # Fewer processes start faster on a laptop: schedulers as threads, no nanny per
        # engine (we interrupt and watch local engines by pid ourselves).
        config.LocalControllerLauncher.controller_args = ["--IPController.use_threads=True"]
        config.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False"]
    config.merge(Config(extra))  # e.g. {"SlurmEngineSetLauncher": {...}}
    return config


def cores() -> int:
    """CPU cores this process may use (fewer than the machine's in a container or under taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def routable_host() -> str:
    """This machine's name as engines on other machines reach it."""
    import socket

    return socket.getfqdn()


def processes(ipp) -> list:
    """Every process of an ipyparallel cluster: launcher processes and all their descendants."""
    import psutil

    procs = []
    launchers = [ipp.controller] if ipp.controller is not None else []
    for engine_set in ipp.engines.values():
        launchers.extend(getattr(engine_set, "launchers", {}).values())
    for launcher in launchers:
        pid = getattr(launcher, "pid", -1)
        if pid and pid > 0:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                procs.append(p)
                procs.extend(p.children(recursive=True))
    return procs


def engine_processes(ipp) -> list:
    """The cluster's processes except the controller: the ranks, killed to free the CPU at once."""
    return [p for p in processes(ipp) if "ipyparallel.controller" not in " ".join(_cmdline(p))]


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001
        return []


def exit_codes(pids: list[int]) -> dict[int, int | None]:
    """Ranks (indexes into ``pids``) whose process is gone, with its exit code when known."""
    import psutil

    gone = {}
    for rank, pid in enumerate(pids):
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                gone[rank] = proc.wait(0)
        except psutil.NoSuchProcess:
            gone[rank] = None
        except psutil.TimeoutExpired:
            pass
    return gone


def kill(procs) -> None:
    """SIGKILL whatever is still alive in ``procs`` and reap it."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
    psutil.wait_procs(procs, timeout=5)
