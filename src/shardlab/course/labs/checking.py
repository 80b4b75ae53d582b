"""Running a lab's checks on live ranks, and turning what happened into one line per task.

A task's check is a function that runs on every rank, inside an initialised process group. It
calls the learner's function, compares with a reference, and either returns what it verified
or raises :class:`Hint` naming the likely mistake::

    @task("lab1.all_gather_shards", fn_name="all_gather_shards")
    def check_all_gather_shards(fn) -> str:
        ...                       # every collective first (the learner's and the reference's)
        if wrong_in_a_known_way:  # then judge: a Hint raised on some ranks only must not leave
            raise Hint("...")     # the other ranks waiting in a collective
        return "the full tensor is back on all 4 ranks"

The checks run in two places, with the same verdicts:

* :func:`run_on_cluster`: on the notebook's ranks (``shardlab.start_cluster``), for ``check()``;
* :func:`run_on_fresh_ranks`: on fresh local ranks (:func:`shardlab.launch.run_ranks`), for the
  command line, the grader and the tests.

Nothing a learner writes may hang a check or bury the reason under tracebacks: every task has a
time limit (the process group's collective timeout, and an alarm for endless Python loops); a
learner exception becomes one line naming its type, message and line; a rank that fails leaves
the process group so that its peers are released at once, and the group is rebuilt after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import io
import itertools
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

#: Seconds a task may take on a 2-core laptop before it counts as timed out (a deadlock).
DEFAULT_TIMEOUT = 30.0

#: The labs, by id: ``lab1`` -> its topic (the notebook is ``labs/lab1_shard_and_gather.ipynb``).
LABS = {"lab1": "shard_and_gather", "lab2": "zero1", "lab3": "zero2", "lab4": "fsdp_unit",
        "lab5": "prefetch"}

NOT_IMPLEMENTED = "not implemented"
#: Outcomes after which the process group cannot be trusted (a rank left it, or it timed out).
_BROKEN = ("error", "timed out", "peer")
_SYMBOL = {"pass": "✓", NOT_IMPLEMENTED: "○"}


class Hint(Exception):  # noqa: N818 - a learner reads "Hint", not "HintError"
    """A recognised mistake: ``message`` names it, ``stronger`` (optional) nearly gives the fix."""

    def __init__(self, message: str, stronger: str | None = None):
        super().__init__(message)
        self.message, self.stronger = message, stronger


@dataclasses.dataclass(frozen=True)
class Task:
    id: str                      # "lab1.pad_and_split"
    fn_name: str                 # the learner's function: "pad_and_split"
    check: Callable[..., str]    # runs on every rank: check(fn) -> what was verified
    world_size: int              # ranks on the command line (the notebook uses its cluster's)
    timeout: float               # seconds, before the task counts as timed out


_TASKS: dict[str, Task] = {}


def task(task_id: str, fn_name: str, *, world_size: int = 4, timeout: float = DEFAULT_TIMEOUT):
    """Register the decorated function as the check of ``task_id`` (in the lab's order)."""
    def register(check):
        _TASKS[task_id] = Task(task_id, fn_name, check, world_size, timeout)
        return check
    return register


def lab_tasks(lab: str) -> list[Task]:
    """The tasks of ``lab`` ("lab1" or "lab1_shard_and_gather"), in the order of the notebook."""
    lab = lab.split("_")[0]
    if lab not in LABS:
        raise ValueError(f"unknown lab {lab!r}: the labs are {', '.join(LABS)}")
    importlib.import_module(f"shardlab.course.labs.{lab}")  # registers its tasks
    return [t for t in _TASKS.values() if t.id.split(".")[0] == lab]


def get_task(task_id: str) -> Task:
    names = [t.id for t in lab_tasks(task_id.split(".")[0])]
    if task_id not in _TASKS:
        raise ValueError(f"unknown task {task_id!r}: this lab's tasks are {', '.join(names)}")
    return _TASKS[task_id]


@dataclasses.dataclass
class Result:
    """The verdict on one task: ``status`` is pass, fail, not implemented, error or timed out."""

    task: str
    status: str
    message: str
    stronger: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def line(self) -> str:
        return f"{_SYMBOL.get(self.status, '✗')} {self.task}: {self.message}"


# ---- on each rank --------------------------------------------------------------------------

class _TaskTimeout(Exception):  # noqa: N818
    pass


def _set_collective_timeout(seconds: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def _drop_group() -> None:
    """Leave the process group, so that peers waiting on this rank fail now, not at the timeout."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort: the group is rebuilt anyway
            pass


_modules: dict[str, object] = {}


def _resolve(source, fn_name: str):
    """The learner's function: ``source`` is the function itself, or a .py file to import it from."""
    if callable(source):
        return source
    path = os.path.abspath(source)
    if path not in _modules:
        spec = importlib.util.spec_from_file_location(f"_submission_{len(_modules)}", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        spec.loader.exec_module(module)
        _modules[path] = module
    fn = getattr(_modules[path], fn_name, None)
    if not callable(fn):
        raise NotImplementedError(f"no function {fn_name} in {os.path.basename(path)}")
    return fn


def _where(exc: BaseException, files: set[str]) -> str:
    """' (line N of your cell)': the last line of the learner's code in the traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in files]
    if not frames:
        return ""
    name = frames[-1].filename
    place = "your cell" if "ipykernel" in name or name.startswith("<") else os.path.basename(name)
    return f" (line {frames[-1].lineno} of {place})"


_import_failures: dict[str, dict] = {}  # a file that cannot be imported fails every task at once


def _judge(task: Task, source, limit: float, *, alarm: bool) -> dict:
    """Run ``task.check`` on this rank; the outcome as plain data. Raises nothing."""
    if isinstance(source, str) and os.path.abspath(source) in _import_failures:
        return dict(_import_failures[os.path.abspath(source)])
    files: set[str] = set()
    _set_collective_timeout(limit)
    if alarm:
        def _ring(signum, frame):
            raise _TaskTimeout
        previous = signal.signal(signal.SIGALRM, _ring)
        signal.setitimer(signal.ITIMER_REAL, limit + 2.0)
    try:
        try:
            fn = _resolve(source, task.fn_name)
        except NotImplementedError:
            raise
        except (_TaskTimeout, KeyboardInterrupt):
            out = {"status": "timed out", "message": f"importing your file did not finish "
                   f"within {limit:.0f} s: top-level code that never ends?"}
            _import_failures[os.path.abspath(source)] = out
            return out
        except BaseException as exc:  # noqa: BLE001 - the file itself is broken
            first = (str(exc).strip().splitlines() or [""])[0]
            out = {"status": "error", "message": f"importing your file raised {type(exc).__name__}: {first}"}
            _import_failures[os.path.abspath(source)] = out
            return out
        code = getattr(fn, "__code__", None)
        files.add(code.co_filename if code else "")
        if isinstance(source, str):
            files.add(os.path.abspath(source))
        return {"status": "pass", "message": task.check(fn)}
    except Hint as hint:
        return {"status": "fail", "message": hint.message, "stronger": hint.stronger}
    except NotImplementedError as exc:
        text = str(exc) if str(exc).startswith("no function") else \
            f"write {task.fn_name} above, then run this cell again"
        return {"status": NOT_IMPLEMENTED, "message": f"not implemented yet: {text}"}
    except (_TaskTimeout, KeyboardInterrupt):
        return {"status": "timed out",
                "message": f"your function was still running after {limit:.0f} s: an endless loop?"}
    except BaseException as exc:  # noqa: BLE001 - a learner's mistake, told in one line
        text = f"{type(exc).__name__}: {exc}"
        if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
            return {"status": "timed out", "message": _DEADLOCK.format(limit=limit)}
        if any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                    "Broken pipe", "DistBackendError", "not been initialized")):
            return {"status": "peer", "message": "released: another rank failed"}
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        where = _where(exc, files)
        if where:
            return {"status": "error", "message": f"your function raised {type(exc).__name__}: {first}{where}"}
        return {"status": "error", "message": f"{type(exc).__name__} in the check, on what your "
                f"function returned: {first}. Does it return what its docstring asks for?"}
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


_DEADLOCK = ("timed out after {limit:.0f} s: did every rank call the same collectives in the "
             "same order? (a rank that skips or adds one leaves the others waiting)")

_outcomes: dict[int, dict] = {}  # on a cluster rank: the last outcome, by run id


class _CheckFailed(Exception):  # noqa: N818
    """Raised on a cluster rank after a failure that broke the group: the cluster rebuilds it."""


def _on_cluster_rank(task_id: str, fn, limit: float, restore: float, run_id: int) -> dict:
    out = _judge(get_task(task_id), fn, limit, alarm=False)
    _outcomes.clear()
    _outcomes[run_id] = out
    if out["status"] in _BROKEN:
        raise _CheckFailed(out["message"])  # the cluster drops this rank's group, releasing peers
    _set_collective_timeout(restore)
    return out


def _outcome(run_id: int) -> dict | None:
    return _outcomes.get(run_id)


def _on_fresh_rank(jobs: list, limits: list[float], log_dir: str) -> list[dict]:
    """Judge ``jobs`` ((task id, source) pairs) in order, on this rank of a fresh process group.

    After each job the ranks compare outcomes through the rendezvous store, not a collective
    (a learner's unfinished collective must not meet it). If the group broke (a deadlock, an
    endless loop, an exception on some ranks), every rank leaves it and all join a new one, so
    the next job starts clean in the same processes. Outcomes are also appended to
    ``log_dir/rank<r>.jsonl``, so that the parent knows how far a run got if a rank crashes.
    """
    import torch.distributed as dist

    rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    store = dist.distributed_c10d._get_default_store()
    outs = []
    for k, ((task_id, source), limit) in enumerate(zip(jobs, limits)):
        with contextlib.redirect_stdout(io.StringIO()):  # a learner's prints: not in the report
            out = _judge(get_task(task_id), source, limit, alarm=True)
        outs.append(out)
        with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "a") as log:
            log.write(json.dumps(out) + "\n")
        keys = [f"lab/{k}/{r}" for r in range(world_size)]
        store.set(keys[rank], out["status"])
        store.wait(keys, datetime.timedelta(seconds=limit + 30))  # a dead peer: raise, the parent sees
        if k + 1 < len(jobs) and any(store.get(key).decode() in _BROKEN for key in keys):
            _drop_group()
            dist.init_process_group(backend, store=dist.PrefixStore(f"lab/{k}/", store), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=limit))
    return outs


def _logged(log_dir: str, world_size: int) -> list[list[dict]]:
    """What each rank logged before its run failed."""
    logs = []
    for r in range(world_size):
        path = os.path.join(log_dir, f"rank{r}.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        logs.append([json.loads(line) for line in lines])
    return logs


# ---- in the notebook or the grader: one verdict per task -----------------------------------

def _verdict(task: Task, outcomes: list, limit: float) -> Result:
    """Many ranks' outcomes -> one line: the cause first (an exception, a loop, a deadlock, a
    hint), echoes (ranks released because a peer failed) dropped."""
    deadlock = _DEADLOCK.format(limit=limit)
    outcomes = [o if o is not None else {"status": "timed out", "message": deadlock} for o in outcomes]
    if outcomes and all(o["status"] == "pass" for o in outcomes):
        return Result(task.id, "pass", outcomes[0]["message"])
    waited = [r for r, o in enumerate(outcomes) if o["message"] == deadlock]
    looped = [r for r, o in enumerate(outcomes) if o["status"] == "timed out" and r not in waited]
    if not any(o["status"] == "error" for o in outcomes) and not looped and waited:
        others = [r for r in range(len(outcomes)) if r not in waited]
        if others:  # name the ranks that went on: they skipped (or added) a collective
            deadlock += (f" Rank{'s' if len(waited) > 1 else ''} {_list(waited)} waited in a "
                         f"collective that rank{'s' if len(others) > 1 else ''} {_list(others)} "
                         "never joined.")
        return Result(task.id, "timed out", deadlock)
    for status in ("error", "timed out", "fail", NOT_IMPLEMENTED, "peer"):
        ranks = [r for r, o in enumerate(outcomes) if o["status"] == status]
        if ranks:
            break
    if status == "peer":
        return Result(task.id, "timed out", deadlock)
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(outcomes[r]["message"], []).append(r)
    if len(groups) == 1 and (len(ranks) == len(outcomes) or status == "timed out"):
        text = next(iter(groups))
    else:  # the lowest rank's problem in full; the others counted (one line, not a wall)
        (message, first), *rest = groups.items()
        text = f"rank{'s' if len(first) > 1 else ''} {_list(first)}: {message}"
        if rest:
            others = sorted(r for _, rs in rest for r in rs)
            text += f" (rank{'s' if len(others) > 1 else ''} {_list(others)}: a similar problem)"
    return Result(task.id, "fail" if status == "error" else status, text,
                  outcomes[ranks[0]].get("stronger"))


def _list(ranks) -> str:
    return ", ".join(map(str, ranks))


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
        outcomes = cluster.run(_on_cluster_rank, task_id, fn, limit, cluster.timeout, run_id, timeout=limit)
    except ClusterError:  # a rank failed and left the group: rebuilt now, then ask what happened
        try:
            outcomes = cluster.run(_outcome, run_id, timeout=30.0)
        except ClusterError:  # the ranks had to be restarted: they hung
            outcomes = [None] * cluster.world_size
    return _verdict(task, outcomes, limit)


def run_on_fresh_ranks(jobs: list[tuple[str, object]], *, scale: float = 1.0,
                       world_size: int | None = None, timeout: float | None = None,
                       report=None) -> list[Result]:
    """Judge each (task id, source) job on fresh local ranks; ``source`` is the learner's function
    (importable: the ranks are spawned) or the path of a .py file that defines it.

    All jobs run in one set of ranks (a deadlock or an endless loop costs its time limit, then
    the ranks join a new group); a rank that crashes ends the set, its job gets a verdict and
    the rest continue on fresh ranks. ``scale`` multiplies every time limit (a loaded machine),
    ``timeout`` replaces the tasks' own limits (seconds, before scaling); ``report(result)``,
    if given, is called as each verdict arrives (the grader keeps what a submission finished
    before it hung).
    """
    from shardlab.launch import RankError, run_ranks

    report = report or (lambda result: None)
    results: list[Result] = []
    todo = list(jobs)
    while todo:
        ws = world_size or get_task(todo[0][0]).world_size
        batch = list(itertools.takewhile(
            lambda j, ws=ws: (world_size or get_task(j[0]).world_size) == ws, todo))
        limits = [(timeout or get_task(t).timeout) * scale for t, _ in batch]
        crash = None
        with tempfile.TemporaryDirectory() as log_dir:
            try:
                per_rank = run_ranks(_on_fresh_rank, ws, batch, limits, log_dir,
                                     timeout=60.0 * scale + 1.5 * sum(limits))
            except RankError as exc:  # a rank died or hung: keep the jobs every rank finished
                crash, per_rank = exc, _logged(log_dir, ws)
        done = min(len(o) for o in per_rank) if crash else max(len(o) for o in per_rank)
        for i in range(done):
            outcomes = [o[i] if i < len(o) else None for o in per_rank]
            results.append(_verdict(get_task(batch[i][0]), outcomes, limits[i]))
            report(results[-1])
        if crash is not None and done < len(batch):  # the job the ranks were on when it happened
            results.append(_crashed(get_task(batch[done][0]), crash, limits[done]))
            report(results[-1])
            done += 1
        todo = todo[done:]
    return results


def _crashed(task: Task, exc: Exception, limit: float) -> Result:
    texts = list(getattr(exc, "failures", {}).values())
    if all("no answer within" in t for t in texts):
        return Result(task.id, "timed out", _DEADLOCK.format(limit=limit))
    last = next((t.strip().splitlines()[-1] for t in texts if "no answer" not in t), str(exc))
    why = ": gloo aborts a rank when ranks call different collectives; did every rank call the " \
          "same collectives in the same order?" if "exit code -6" in last else ""
    return Result(task.id, "fail", f"your ranks crashed ({last}){why}")
