"""Running a lab's checks on live ranks, in two places, with the same verdicts:

* :func:`run_on_cluster`: on the notebook's ranks (``shardlab.start_cluster``), for ``check()``;
* :func:`run_on_fresh_ranks`: on fresh local ranks (:func:`shardlab.launch.run_ranks`), for the
  command line, the grader and the tests, at each of :data:`~.tasks.WORLD_SIZES` (4, then 3).

A rank that fails in a way that breaks the process group (an exception inside a collective, a
deadlock, an endless loop) leaves the group, so that its peers are released at once; the group
is rebuilt before the next task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import itertools
import json
import linecache
import os
import tempfile
import time

from shardlab.course.labs.judge import drop_group, judge, set_collective_timeout
from shardlab.course.labs.tasks import WORLD_SIZES, get_task
from shardlab.course.labs.verdicts import BROKEN, Result, crashed, verdict


def _breaks_group(out: dict) -> bool:
    return out["status"] in BROKEN or bool(out.get("broken"))


# ---- on the notebook's cluster ---------------------------------------------------------------

_outcomes: dict[int, dict] = {}  # on a cluster rank: the last outcome, by run id


class _CheckFailed(Exception):  # noqa: N818
    """Raised on a cluster rank after a failure that broke the group: the cluster rebuilds it."""


def _cell_lines(fn) -> tuple[str, list[str]] | None:
    """The learner's cell, as the kernel's linecache holds it (IPython puts each cell there).

    A rank's linecache lacks it, and a check that reads the learner's failing line (lab 5 tells
    ``units[i + 1]`` at the last unit as "the last unit has no next one") needs it on the rank.
    """
    code = getattr(fn, "__code__", None)
    if code is None or os.path.exists(code.co_filename):  # a real file: the rank reads it itself
        return None
    lines = linecache.getlines(code.co_filename)
    return (code.co_filename, lines) if lines else None


def _on_cluster_rank(task_id: str, fn, limit: float, restore: float, run_id: int,
                     cell_lines=None) -> dict:
    """Judge ``fn`` on this rank of the notebook's cluster; ``cell_lines`` is the learner's cell,
    (filename, lines), to read its failing line here."""
    if cell_lines is not None:
        # imported here, not at the top, so that the labs import without the cluster package
        from shardlab.cluster.on_rank import remember_lines

        remember_lines(*cell_lines)
    out = judge(get_task(task_id), fn, limit, alarm=False)
    _outcomes.clear()
    _outcomes[run_id] = out
    if _breaks_group(out):
        raise _CheckFailed(out["message"])  # the cluster drops this rank's group, releasing peers
    set_collective_timeout(restore)
    return out


def _outcome(run_id: int) -> dict | None:
    return _outcomes.get(run_id)


_run_ids = itertools.count(int(time.time()))


def run_on_cluster(task_id: str, fn, *, timeout: float | None = None, cluster=None) -> Result:
    """Judge ``fn`` on every rank of ``cluster`` (default: the notebook's, ``cluster.current()``)."""
    from shardlab.cluster import ClusterError, current

    task = get_task(task_id)
    if not callable(fn):
        return Result(task_id, "fail", f"check expects your function {task.fn_name}, got {type(fn).__name__}")
    try:
        cluster = cluster or current()
    except RuntimeError:
        return Result(task_id, "fail", "no cluster is running: run the lab's first cell "
                      "(cluster = shardlab.start_cluster(4)), then this one again")
    limit = float(timeout or task.timeout)
    run_id = next(_run_ids)
    try:
        outcomes = cluster.run(_on_cluster_rank, task_id, fn, limit, cluster.timeout, run_id, _cell_lines(fn),
                               timeout=limit)
    except ClusterError:  # a rank failed and left the group: rebuilt now, then ask what happened
        try:
            outcomes = cluster.run(_outcome, run_id, timeout=30.0)
        except ClusterError:  # the ranks had to be restarted: they hung
            outcomes = [None] * cluster.world_size
    return verdict(task_id, outcomes, limit, cluster.world_size)


# ---- on fresh local ranks --------------------------------------------------------------------

def _on_fresh_rank(jobs: list, limits: list[float], log_dir: str, sizes: tuple) -> dict:
    """Judge ``jobs`` ((task id, source) pairs) on this rank, at each world size in ``sizes``:
    all of them on every rank first, then, on the first ``sizes[1]`` ranks in a new group, again
    the jobs that passed everywhere (no new processes: spawning ranks is the slow part).

    After each job the ranks compare outcomes through the rendezvous store, not a collective
    (a learner's unfinished collective must not meet it). If the group broke, every rank leaves
    it and all join a new one, so the next job starts clean in the same processes. Outcomes are
    also appended to ``log_dir/rank<r>.jsonl``, so that the parent knows how far a run got if a
    rank crashes. Returns {world size: {job index: outcome}}.
    """
    import torch.distributed as dist

    rank, backend = dist.get_rank(), dist.get_backend()
    store = dist.distributed_c10d._get_default_store()
    out: dict[int, dict[int, dict]] = {}
    todo = list(range(len(jobs)))
    for phase, ws in enumerate(sizes):
        if phase:  # only the jobs that passed on every rank go on, on fewer ranks
            todo = [k for k in todo if all(store.get(f"lab/{sizes[0]}/{k}/{r}") == b"pass" for r in range(sizes[0]))]
            drop_group()
            if rank >= ws or not todo:
                break
            dist.init_process_group(backend, store=dist.PrefixStore(f"lab/ws{ws}/", store), rank=rank,
                                    world_size=ws, timeout=datetime.timedelta(seconds=max(limits)))
        out[ws] = _judge_jobs(jobs, todo, limits, log_dir, ws, store)
    return out


def _judge_jobs(jobs, todo, limits, log_dir, ws, store) -> dict[int, dict]:
    import torch.distributed as dist

    rank, backend = dist.get_rank(), dist.get_backend()
    outs = {}
    for n, k in enumerate(todo):
        (task_id, source), limit = jobs[k], limits[k]
        with contextlib.redirect_stdout(io.StringIO()):  # a learner's prints: not in the report
            out = judge(get_task(task_id), source, limit, alarm=True)
        if out.get("broken"):
            drop_group()  # a Hint raised inside a collective's call: release the peers now
        outs[k] = out
        with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "a") as log:
            log.write(json.dumps({"ws": ws, "job": k, **out}) + "\n")
        keys = [f"lab/{ws}/{k}/{r}" for r in range(ws)]
        store.set(keys[rank], "broken" if _breaks_group(out) else out["status"])
        store.wait(keys, datetime.timedelta(seconds=limit + 30))  # a dead peer: raise, the parent sees
        if n + 1 < len(todo) and any(store.get(key).decode() == "broken" for key in keys):
            drop_group()
            dist.init_process_group(backend, store=dist.PrefixStore(f"lab/{ws}/{k}/", store), rank=rank,
                                    world_size=ws, timeout=datetime.timedelta(seconds=limit))
    return outs


def _logged(log_dir: str, world_size: int) -> list[dict]:
    """What each rank logged before its run failed, as {world size: {job index: outcome}}."""
    logs = []
    for r in range(world_size):
        path = os.path.join(log_dir, f"rank{r}.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        mine: dict[int, dict[int, dict]] = {}
        for line in map(json.loads, lines):
            mine.setdefault(line.pop("ws"), {})[line.pop("job")] = line
        logs.append(mine)
    return logs


def run_on_fresh_ranks(jobs: list[tuple[str, object]], *, scale: float = 1.0,
                       world_size: int | None = None, timeout: float | None = None,
                       report=None) -> list[Result]:
    """Judge each (task id, source) job on fresh local ranks; ``source`` is the learner's function
    (importable: the ranks are spawned) or the path of a .py file that defines it.

    With no ``world_size``, each job runs on 4 ranks, and a job that passes there runs again on
    3 of them (a failure on 3 ranks is told as such). ``scale`` multiplies every time limit (a
    loaded machine), ``timeout`` replaces the tasks' own limits (seconds, before scaling);
    ``report(result)``, if given, is called with each final verdict, in the jobs' order.
    """
    report = report or (lambda result: None)
    sizes = (world_size,) if world_size else WORLD_SIZES
    found: dict[int, dict[int, Result]] = {ws: {} for ws in sizes}
    rounds = [(sizes, list(range(len(jobs))))]
    while rounds:
        round_sizes, todo = rounds.pop(0)
        rounds += _round([jobs[i] for i in todo], round_sizes, scale, timeout, found, todo)
    results = []
    for i in range(len(jobs)):
        r = found[sizes[0]][i]
        for ws in sizes[1:]:
            if r.passed and i in found[ws]:
                again = found[ws][i]
                r = dataclasses.replace(r, message=f"{r.message}; also on {ws} ranks") if again.passed else \
                    dataclasses.replace(again, message=f"with {ws} ranks: {again.message}")
        results.append(r)
        report(r)
    return results


def _round(batch, sizes, scale, timeout, found, index) -> list:
    """One set of ranks for ``batch``; verdicts into ``found``; the rounds still to run (after a crash)."""
    from shardlab.launch import RankError, run_ranks

    limits = [(timeout or get_task(t).timeout) * scale for t, _ in batch]
    crash = None
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            per_rank = run_ranks(_on_fresh_rank, sizes[0], batch, limits, log_dir, sizes,
                                 timeout=60.0 * scale + 1.5 * len(sizes) * sum(limits))
        except RankError as exc:  # a rank died or hung: keep the jobs every rank finished
            crash, per_rank = exc, _logged(log_dir, sizes[0])
    later, passed = [], []
    for phase, ws in enumerate(sizes):
        todo = list(range(len(batch))) if not phase else passed
        passed, stop = [], None
        for k in todo:
            outcomes = [per_rank[r].get(ws, {}).get(k) for r in range(ws)]
            if crash is not None and any(o is None for o in outcomes):
                stop = k
                break
            found[ws][index[k]] = verdict(batch[k][0], outcomes, limits[k], ws)
            passed += [k] if found[ws][index[k]].passed else []
        if stop is not None:  # the job the ranks were on when it happened, then the rest afresh
            found[ws][index[stop]] = crashed(batch[stop][0], crash, limits[stop], ws)
            rest = todo[todo.index(stop) + 1:]
            if rest:
                later.append((sizes[phase:], [index[k] for k in rest]))
            if passed and phase + 1 < len(sizes):
                later.append((sizes[phase + 1:], [index[k] for k in passed]))
            break
    return later
