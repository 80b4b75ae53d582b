"""The notebook runtime: ranks on persistent ipyparallel engines, errors by rank, no hangs, no orphans.

One 4-rank cluster serves most tests (starting one costs ~10 s on 2 cores). Functions are built
with ``exec`` in a namespace named ``__main__``, which is exactly what a notebook cell does.
"""

from __future__ import annotations

import itertools
import linecache
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from support import slowdown

import shardlab
from shardlab.cluster import ClusterError, CollectiveTimeout, RankTimeout
from shardlab.cluster.engines import Health

_cells = itertools.count()
TIMEOUT = slowdown(4.0)  # seconds a collective may wait: short, so that the timeout tests are quick


def notebook(source: str) -> dict:
    """Run ``source`` as a notebook cell would (module ``__main__``) and return its namespace."""
    source = textwrap.dedent(source)
    name = f"<notebook cell {next(_cells)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # as IPython does
    ns = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), ns)
    return ns


def lam(source: str):
    """A lambda as a notebook cell would define it (``rank``, ``dist``... are the ranks' own)."""
    return eval(source, {"__name__": "__main__"})


def family() -> set[int]:
    """Every live descendant of this test process (zombies count as gone)."""
    alive = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def listening() -> set[int]:
    """TCP ports this process listens on (the rendezvous store is one while a cluster runs)."""
    conns = psutil.Process().net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def strays(profile_dirs) -> list[int]:
    """Processes anywhere on the machine that belong to one of our (stopped) clusters."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(d in cmd for d in profile_dirs):
            found.append(p.info["pid"])
    return found


@pytest.fixture(scope="module")
def shared():
    """One cluster for the module's tests (started on first use, again if a test stopped it)."""
    before, state = family(), {"cluster": None}
    yield state
    if state["cluster"] is not None:
        folder = state["cluster"].pool.profile_dir
        state["cluster"].stop()
        assert not folder or not os.path.exists(folder), f"stop() left {folder} behind"
    assert family() <= before


@pytest.fixture
def cluster(shared):
    """The shared cluster, running, with ``kept = rank`` on every rank: tests run in any order."""
    c = shared["cluster"]
    if c is None or c.health is Health.STOPPED:
        c = shared["cluster"] = shardlab.start_cluster(4, timeout=TIMEOUT, quiet=True)
        c.interrupt_grace = slowdown(5)  # an interrupted rank's time to answer, on a loaded machine
    c.run_cell("kept = rank")  # restarts the ranks first if a test killed one
    return c


def test_too_many_ranks_per_core_is_refused_with_the_fix():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="max_ranks_per_core"):
        shardlab.Cluster(world_size=2 * cores + 1)


def test_run_returns_one_result_per_rank_for_notebook_functions(cluster, capsys):
    ns = notebook("""
        import math as m

        def scale(x):
            return 10 * x

        def step(k):
            t = torch.ones(2) * rank
            dist.all_reduce(t)                     # SUM over ranks: 0 + 1 + 2 + 3 = 6
            print("hello from", rank)
            return scale(rank) + k + m.floor(t[0].item())
        """)
    assert cluster.run(ns["step"], 1) == [7, 17, 27, 37]  # helper and import came along
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "hello" in line] == [
        f"[rank {r}] hello from {r}" for r in range(4)]
    assert cluster.run(lam("lambda: (rank, world_size)")) == [(r, 4) for r in range(4)]
    assert cluster.run(lam("lambda a, b=0: a * b"), 3, b=2) == [6] * 4

    t0 = time.perf_counter()
    for _ in range(10):
        cluster.run(lam("lambda: rank"))
    per_run = (time.perf_counter() - t0) / 10
    print(f"\nrepeated run latency: {per_run * 1000:.0f} ms (printed, not asserted: a benchmark)", file=sys.stderr)


def test_a_notebook_function_passed_as_an_argument_travels_with_what_it_uses(cluster):
    ns = notebook("""
        import math

        def helper(x):
            return math.sqrt(x)

        def learner(x):
            return helper(x) + rank

        def runner(fn, x):
            return fn(x)
        """)
    assert cluster.run(ns["runner"], ns["learner"], 16.0) == [4.0, 5.0, 6.0, 7.0]


def test_notebook_classes_travel_too(cluster):
    """A notebook nn.Module whose __init__ calls super() (ipyparallel alone recurses forever)."""
    ns = notebook("""
        import torch.nn as nn

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 2)

            @property
            def width(self):
                return self.lin.out_features

            def forward(self, x):
                return self.lin(x)

        def build():
            torch.manual_seed(0)
            model = Tiny()
            return type(model).__name__, model.width, model(torch.ones(1, 3)).sum().item()
        """)
    results = cluster.run(ns["build"])
    assert [r[:2] for r in results] == [("Tiny", 2)] * 4
    assert len({r[2] for r in results}) == 1  # same seed, same weights, on every rank


def test_cells_run_on_every_rank_and_state_stays_between_cells(cluster, capsys):
    cluster.run_cell("x = torch.arange(3.) + 10 * rank\nprint('shape', tuple(x.shape))\nx.sum()")
    out = capsys.readouterr().out.splitlines()
    assert "[rank 2] shape (3,)" in out and "[rank 2] tensor(63.)" in out
    assert cluster.pull("x")[2].tolist() == [20.0, 21.0, 22.0]
    with pytest.raises(ClusterError, match="not defined"):
        cluster.pull("no_such_variable")


def test_a_ranks_cell_is_named_as_ipython_names_the_running_cell():
    """IPython 9 counts a cell before running it: in In [10], ``execution_count`` is already 11.
    The name comes from the running cell's result, as IPython's own tracebacks do."""
    from types import SimpleNamespace

    from shardlab.cluster.magic import cell_name

    running = SimpleNamespace(execution_count=11, displayhook=SimpleNamespace(exec_result=SimpleNamespace(execution_count=10)))
    assert cell_name(running) == "Cell In[10]"
    assert cell_name(SimpleNamespace(execution_count=10)) == "Cell In[10]"  # a shell without a displayhook


def test_ranks_magic(cluster, capsys, monkeypatch):
    """The %%ranks cell magic (the notebook runs it in a real kernel; here a stand-in shell,
    so that this test leaves no IPython instance behind for the other tests)."""
    from shardlab.cluster import magic as runtime

    class Shell:
        magics: dict = {}
        execution_count = 10  # the cell's number, as Jupyter shows it: In [10]

        def register_magic_function(self, fn, magic_kind, magic_name):
            self.magics[(magic_kind, magic_name)] = fn

    shell = Shell()
    monkeypatch.delenv("SHARDLAB_DEBUG", raising=False)
    runtime.register_ranks_magic(shell, lambda: cluster)
    ranks = shell.magics[("cell", "ranks")]
    ranks("", "y = rank * 100\nprint('y is', y)")
    assert "[rank 3] y is 300" in capsys.readouterr().out
    assert cluster.pull("y") == [0, 100, 200, 300]

    # An error shows the learner's cell, numbered as the notebook numbers it, line 3 counting
    # the %%ranks line; not the runtime's frames (here, or on the rank).
    cell = "z = 1\n1 / 0 if rank == 1 else None"
    with pytest.raises(ClusterError, match="rank 1 raised ZeroDivisionError") as info:
        ranks("", cell)
    text, shown = str(info.value), "\n".join(info.value._render_traceback_())
    for out in (text, shown):
        assert "Cell In[10], line 3, in <module>\n    1 / 0 if rank == 1 else None" in out
        assert "on_rank.py" not in out and "shardlab/cluster" not in out
    assert "run_cell_magic" not in shown and "magic.py" not in shown
    assert "\nClusterError: rank 1 raised ZeroDivisionError" in shown

    # Debugging the runtime: everything is shown, as Python would.
    cluster.debug = True
    try:
        with pytest.raises(ClusterError) as info:
            ranks("", cell)
    finally:
        cluster.debug = False
    assert "on_rank.py" in str(info.value) and not hasattr(info.value, "_render_traceback_")
    monkeypatch.setenv("SHARDLAB_DEBUG", "1")
    with pytest.raises(ClusterError) as info:
        ranks("", cell)
    assert "on_rank.py" in str(info.value) and not hasattr(info.value, "_render_traceback_")


def test_an_error_names_its_rank_quickly_and_keeps_the_state(cluster):
    ns = notebook("""
        def step():
            if rank == 2:
                raise ValueError("bad shard on rank 2")
            t = torch.ones(4)
            dist.all_reduce(t)                     # the others wait for rank 2 here
            return t
        """)
    t0 = time.perf_counter()
    with pytest.raises(ClusterError) as info:
        cluster.run(ns["step"])
    seconds = time.perf_counter() - t0
    print(f"\ntime to surface a rank's error: {seconds * 1000:.0f} ms", file=sys.stderr)
    message = str(info.value)
    assert "rank 2 raised ValueError: bad shard on rank 2" in message
    assert 'raise ValueError("bad shard on rank 2")' in message  # the failing line, from the cell
    assert "ranks 0, 1, 3" in message.replace("rank(s)", "ranks")
    assert set(info.value.failures) == {0, 1, 2, 3}
    assert not isinstance(info.value, TimeoutError)
    assert seconds < TIMEOUT  # the peers were released, not left to time out
    assert cluster.run(lam("lambda: kept")) == [0, 1, 2, 3]
    assert cluster.run(lam("lambda: dist.all_reduce(torch.ones(1)) or 1")) == [1] * 4


def test_a_mismatched_collective_times_out_with_a_clear_message(cluster):
    ns = notebook("""
        def lonely():
            if rank == 0:
                dist.all_reduce(torch.ones(1))     # nobody else joins
            return rank
        """)
    t0 = time.perf_counter()
    with pytest.raises(CollectiveTimeout) as info:
        cluster.run(ns["lonely"])
    assert time.perf_counter() - t0 < TIMEOUT + slowdown(4)
    message = str(info.value)
    assert f"did not complete within {TIMEOUT:.0f} s" in message
    assert "same collectives in the same order" in message
    assert isinstance(info.value, TimeoutError) and list(info.value.failures) == [0]
    assert cluster.run(lam("lambda: dist.all_reduce(torch.ones(1)) or rank")) == [0, 1, 2, 3]


def test_a_rank_stuck_in_python_is_interrupted(cluster):
    ns = notebook("""
        def spin():
            while rank == 1:
                pass
            return rank
        """)
    wait = slowdown(1)
    with pytest.raises(RankTimeout, match=rf"rank\(s\) 1 did not answer within {wait:.0f} s"):
        cluster.run(ns["spin"], timeout=wait)
    assert cluster.run(lam("lambda: kept")) == [0, 1, 2, 3]  # interrupted, not restarted


def test_the_notebooks_stop_button_stops_the_ranks_too(cluster, tmp_path):
    """Interrupting the kernel while ranks run interrupts the ranks, so the next cell runs now,
    and the notebook shows one line, not the runtime's traceback."""
    import _thread
    import threading

    def press_stop_once_all_ranks_sleep():
        deadline = time.monotonic() + slowdown(30)
        while len(list(tmp_path.iterdir())) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        _thread.interrupt_main()

    # interrupt_main only raises KeyboardInterrupt under Python's own SIGINT handler, which a
    # kernel has while a cell runs; an earlier test in the same process may have replaced it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=press_stop_once_all_ranks_sleep, daemon=True).start()
    sleep = lam(f"lambda: open(__import__('os').path.join({str(tmp_path)!r}, str(rank)), 'w').close()"
                " or __import__('time').sleep(60)")
    t0 = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt) as info:  # only the stop button may end this run:
            cluster.run(sleep, timeout=slowdown(60))      # not the run's own deadline, on a slow start
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - t0 < slowdown(30) + slowdown(4), "the ranks were not interrupted"
    assert str(info.value) == "interrupted on ranks 0\u20133; the cluster is ready"
    assert info.value._render_traceback_() == [str(info.value)]  # what the notebook shows
    t0 = time.perf_counter()
    assert cluster.run(lam("lambda: kept")) == [0, 1, 2, 3]  # the same ranks, state kept
    # Not queued behind the 60 s sleep: only the process group's rebuild (~0.1 s when quiet,
    # seconds on a loaded machine) comes before it.
    assert time.perf_counter() - t0 < slowdown(10)


def test_many_runs_and_failures_hold_no_extra_processes_or_ports(cluster):
    procs, ports = family(), listening()
    ns = notebook("""
        def maybe_fail(i):
            if i % 2 and rank == i % 4:
                raise RuntimeError(f"failure {i}")
            t = torch.ones(8)
            dist.all_reduce(t)
            return t[0].item()
        """)
    for i in range(40):
        if i % 2:
            with pytest.raises(ClusterError, match=f"rank {i % 4} raised RuntimeError: failure {i}"):
                cluster.run(ns["maybe_fail"], i)
        else:
            assert cluster.run(ns["maybe_fail"], i) == [4.0] * 4
    assert family() == procs
    assert len(listening()) == len(ports)  # the store moved to a new port, no port piled up


def test_a_dead_rank_is_reported_and_the_cluster_restarts(cluster, capsys):
    old_pids = list(cluster.pids)
    ns = notebook("""
        def crash():
            import os
            if rank == 3:
                os._exit(3)
            return rank
        """)
    t0 = time.perf_counter()
    with pytest.raises(ClusterError, match=r"rank\(s\) 3 died"):
        cluster.run(ns["crash"])
    assert time.perf_counter() - t0 < TIMEOUT + slowdown(2)
    cluster.quiet = False
    try:
        assert cluster.run(lam("lambda: rank")) == [0, 1, 2, 3]  # restarted on the next run
    finally:
        cluster.quiet = True
    assert "restarting the ranks" in capsys.readouterr().out
    assert shardlab.cluster.current() is cluster  # %%ranks still finds it after the restart
    assert not set(old_pids) & set(cluster.pids)
    assert shardlab.cluster.current() is cluster  # %%ranks still talks to it after the restart
    assert not [p for p in old_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_starts_replacements_and_stops_leave_no_orphans_or_ports(cluster, capsys):
    cluster.stop()  # the module's cluster: the rest starts its own
    procs, ports, dirs = family(), listening(), []
    capsys.readouterr()
    first = shardlab.start_cluster(2, timeout=TIMEOUT)  # not quiet: the progress bar shows
    out, err = capsys.readouterr()
    dirs.append(first.pool.profile_dir)
    assert "2 engines up" in err and "process group joined" in err  # the bar names its phases
    assert out == ""  # no "ready" line: the repr says it, once
    assert f"running, ready in {first.start_seconds:.1f} s)" in repr(first)
    assert first.run(lam("lambda: rank")) == [0, 1]
    second = shardlab.start_cluster(2, timeout=TIMEOUT, quiet=True)  # replaces the first
    dirs.append(second.pool.profile_dir)
    assert "stopped" in repr(first) and not strays(dirs[:1])
    with pytest.raises(RuntimeError, match="stopped"):
        first.run(lam("lambda: 0"))
    with second:
        assert second.run(lam("lambda: dist.get_world_size()")) == [2, 2]
    assert family() == procs and listening() == ports and not strays(dirs)
    assert not [d for d in dirs if os.path.exists(d)], "stop() left a temporary folder behind"


def test_a_killed_kernel_takes_its_ranks_along(tmp_path):
    """If the kernel dies without cleanup (SIGKILL), engines and controller kill themselves."""
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import time, shardlab
        c = shardlab.start_cluster(2, quiet=True)
        print(c.pool.profile_dir, *c.pids, flush=True)
        time.sleep(120)
        """))
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        profile_dir, *pids = kernel.stdout.readline().split()
        assert len(pids) == 2 and strays([profile_dir])
    finally:
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(slowdown(10))
    deadline = time.monotonic() + slowdown(10)
    while (strays([profile_dir]) or os.path.exists(profile_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not strays([profile_dir])
    assert not os.path.exists(profile_dir), "the orphan guard left the cluster's folder behind"
