"""Judging one task on one rank, within a time limit, whatever the learner's function does.

Nothing a learner writes may hang a check or bury the reason under tracebacks: every task has a
time limit (the process group's collective timeout, and an alarm for endless Python loops); a
learner's exception becomes one line naming its type, message and line, and the errors torch
and gloo raise for a collective called with the wrong sizes are told in the lab's words.
"""

from __future__ import annotations

import datetime
import importlib.util
import linecache
import os
import re
import signal
import sys
import traceback

from shardlab.course.labs.tasks import Hint, Task
from shardlab.course.labs.verdicts import DEADLOCK, NOT_IMPLEMENTED


class TaskTimeout(Exception):  # noqa: N818
    pass


def set_collective_timeout(seconds: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def drop_group() -> None:
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


#: The comment ``notebook_to_script`` puts before each piece of a notebook it keeps: the notebook's
#: code cell and line the piece starts at, so that a hint names them, not the script's line.
CELL_MARK = "# shardlab cell {cell} line {line}"
_MARK = re.compile(r"# shardlab cell (\d+) line (\d+)")


def _where(exc: BaseException, files: set[str]) -> str:
    """' (line N of your cell)': the last line of the learner's code in the traceback. In a script
    made from a notebook (``notebook_to_script``), the notebook's cell and line, from the marks."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in files]
    if not frames:
        return ""
    name, lineno = frames[-1].filename, frames[-1].lineno
    if "ipykernel" in name or name.startswith("<"):
        return f" (line {lineno} of your cell)"
    for above in range(lineno - 1, 0, -1):  # the nearest mark above the line, if the script has marks
        mark = _MARK.fullmatch(linecache.getline(name, above).strip())
        if mark:
            cell, first = map(int, mark.groups())
            notebook = os.path.splitext(os.path.basename(name))[0] + ".ipynb"
            return f" (line {first + lineno - above - 1} of code cell {cell} in {notebook})"
    return f" (line {lineno} of {os.path.basename(name)})"


#: torch's and gloo's words for a collective called with buffers of the wrong sizes.
_SIZE_ERRORS = ("invalid output tensor", "invalid input tensor", "outputShape", "inputShape",
                "must be equal to world_size", "output tensor size", "input tensor size",
                "tensor size mismatch", "must have the same number of elements")
UNEQUAL = ("your collective's buffers do not fit: all-gather needs full = world_size x shard "
           "elements, reduce-scatter needs full = world_size x shard. Are all your shards the same "
           "size, i.e. did you pad to a multiple of the world size?")


def _stub_name(exc: NotImplementedError) -> str | None:
    """The function whose stub raised: the innermost frame of the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1].name if frames else None


_import_failures: dict[str, dict] = {}  # a file that cannot be imported fails every task at once


def judge(task: Task, source, limit: float, *, alarm: bool) -> dict:
    """Run ``task.check`` on this rank; the outcome as plain data. Raises nothing."""
    if isinstance(source, str) and os.path.abspath(source) in _import_failures:
        return dict(_import_failures[os.path.abspath(source)])
    files: set[str] = set()
    fn = None
    set_collective_timeout(limit)
    if alarm:
        def _ring(signum, frame):
            raise TaskTimeout
        previous = signal.signal(signal.SIGALRM, _ring)
        signal.setitimer(signal.ITIMER_REAL, limit + 2.0)
    try:
        try:
            fn = _resolve(source, task.fn_name)
        except NotImplementedError:
            raise
        except (TaskTimeout, KeyboardInterrupt):
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
        return {"status": "fail", "message": hint.message, "stronger": hint.stronger,
                "mistake": hint.mistake, "broken": hint.broken}
    except NotImplementedError as exc:
        stub = _stub_name(exc)
        if str(exc).startswith("no function"):
            text = str(exc)
        elif fn is not None and stub not in (task.fn_name, getattr(fn, "__name__", None)):
            text = f"your {task.fn_name} calls {stub}, which is still a stub: finish that task first"
        else:
            text = f"write {task.fn_name} above, then run this cell again"
        return {"status": NOT_IMPLEMENTED, "message": f"not implemented yet: {text}"}
    except (TaskTimeout, KeyboardInterrupt):
        return {"status": "timed out",
                "message": f"your function was still running after {limit:.0f} s: an endless loop?"}
    except BaseException as exc:  # noqa: BLE001 - a learner's mistake, told in one line
        return _told(exc, files, limit)
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


#: The Python frame through which autograd's engine runs backward: a private name of torch's
#: (torch/autograd/graph.py, torch >= 2.3; tests/test_torch_internals.py would see it go).
AUTOGRAD_ENTRY = "_engine_run_backward"


def _in_backward(exc: BaseException) -> list | None:
    """The frames run by autograd's engine (after :data:`AUTOGRAD_ENTRY`: hooks) if the error was
    raised while the check ran backward; None if it was not."""
    frames = traceback.extract_tb(exc.__traceback__)
    starts = [i for i, f in enumerate(frames) if f.name == AUTOGRAD_ENTRY]
    return frames[starts[-1] + 1:] if starts else None


IN_BACKWARD_HOOK = "{kind}: {first}, raised while backward ran a hook you registered"


def _told_in_backward(exc: BaseException, first: str, hook_frames: list) -> dict:
    """An error raised during backward, where no line of the learner's code is on the stack:
    autograd called a learner's hook with the wrong arguments, the "hook" was not a function, a
    backward hook returned something, or backward itself failed on the graph the learner built."""
    text = IN_BACKWARD_HOOK.format(kind=type(exc).__name__, first=first)
    if isinstance(exc, TypeError) and "not callable" in first:
        return {"status": "error", "mistake": "hook_not_callable", "message": f"{text}: it was not a function. "
                "Passing f(x) calls f at once and hands over what it returned; to have backward call it "
                "later, pass a function: lambda: f(x)"}
    if isinstance(exc, TypeError) and "positional argument" in first:
        return {"status": "error", "mistake": "hook_arguments", "message": f"{text}: autograd calls a hook "
                "with one argument, hook(p) for register_post_accumulate_grad_hook and hook(grad) for a "
                "tensor's register_hook. Give your hook that parameter, even if it does not use it"}
    if "hook returned" in first:
        return {"status": "error", "mistake": "hook_returned", "message": f"{text}: what a backward hook returns "
                "replaces the gradient, and a lambda returns the value of its expression (a tuple, when it "
                "lists several calls). Return nothing: write the hook as a def whose lines only act"}
    if hook_frames:
        return {"status": "error", "message": f"{text} (autograd called it, so no line of yours is on the stack)"}
    return {"status": "error", "message": f"{type(exc).__name__}: {first}, raised while the check ran backward "
            "through what your function built"}


def _told(exc: BaseException, files: set[str], limit: float) -> dict:
    """A learner's exception (or torch's, on what the learner passed) in one line."""
    text = f"{type(exc).__name__}: {exc}"
    if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
        return {"status": "timed out", "message": DEADLOCK.format(limit=limit)}
    if any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                "Broken pipe", "DistBackendError", "not been initialized")):
        return {"status": "peer", "message": "released: another rank failed"}
    where = _where(exc, files)
    if any(s in text for s in _SIZE_ERRORS):
        return {"status": "error", "message": UNEQUAL + where, "mistake": "collective_sizes"}
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if where:
        return {"status": "error", "message": f"your function raised {type(exc).__name__}: {first}{where}"}
    hook_frames = _in_backward(exc)
    if hook_frames is not None:
        return _told_in_backward(exc, first, hook_frames)
    return {"status": "error", "message": f"{type(exc).__name__} in the check, on what your "
            f"function returned: {first}. Does it return what its docstring asks for?"}
