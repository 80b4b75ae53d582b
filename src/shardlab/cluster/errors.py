"""What a failed run raises in the notebook, and how the ranks' failures are told apart.

When one rank fails, its peers fail too ("a peer failed", or a collective timeout), so a plain
list of four tracebacks buries the cause. :func:`explain` sorts the failures into the cause
(an exception in the learner's code), the echoes (peers released, collectives timed out) and
the casualties (ranks that hung or died), and says first what happened and what happens next.

The ranks send failures as plain data (see ``on_rank._failure``); the traceback text is built
here, in the kernel, because only the kernel has the notebook cells' source lines.

A learner should read their own code in a traceback, not the runtime's: frames are labelled
as Jupyter labels cells (``Cell In[10], line 3``), and frames from IPython's magic machinery,
from ``shardlab/cluster/`` and from torch's insides are hidden. ``cluster.debug = True`` or
the environment variable ``SHARDLAB_DEBUG=1`` shows everything, as Python would.
"""

from __future__ import annotations

import linecache
import os
import sys

from shardlab.launch import RankError

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # shardlab/cluster/


def _debug_env() -> bool:
    return os.environ.get("SHARDLAB_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


class ClusterError(RankError):
    """One or more ranks failed in :meth:`Cluster.run`; ``.failures`` maps rank -> traceback text."""

    debug = False  # set from the cluster when raised: True shows IPython's full traceback

    def __init__(self, failures: dict[int, str], message: str):
        self.failures = dict(sorted(failures.items()))
        RuntimeError.__init__(self, message)

    @property
    def _render_traceback_(self):
        """What IPython shows instead of its own traceback: the notebook's cells, then the ranks'.

        A property, so that in debug mode it does not exist and IPython shows everything.
        """
        if self.debug or _debug_env():
            raise AttributeError("_render_traceback_")
        return lambda: _kernel_frames(self.__traceback__) + [
            f"{type(self).__name__}: {self}", "(cluster.debug = True shows the runtime's frames too)"]


class RanksInterrupted(KeyboardInterrupt):
    """The notebook's stop button interrupted a run: the ranks were interrupted too.

    Still a KeyboardInterrupt (so "Run All" stops here), but shown as its one-line message.
    """

    debug = False

    @property
    def _render_traceback_(self):
        if self.debug or _debug_env():
            raise AttributeError("_render_traceback_")
        return lambda: [str(self)]


class RankTimeout(ClusterError, TimeoutError):
    """A rank did not finish in time (it was interrupted, or killed if it ignored that)."""


class CollectiveTimeout(RankTimeout):
    """A collective did not complete in time: some rank never joined it."""


def died(why: str) -> dict:
    """The outcome of a rank whose engine died: shaped like a failure the rank reported itself."""
    return {"ok": False, "died": True, "stdout": "", "stderr": "",
            "error": {"type": "RankDied", "message": why, "frames": [], "timeout": False,
                      "peer": False, "interrupted": False}}


def _cell_label(filename: str) -> str | None:
    """``Cell In[10]`` for a notebook cell's code (a %%ranks cell, or a kernel cell), else None."""
    if filename.startswith("Cell In["):  # a %%ranks cell, named so by the magic
        return filename
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    number = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(filename)
    return None if number is None else f"Cell In[{number}]"


def _frame_lines(filename: str, lineno: int, name: str, line: str | None) -> list[str]:
    label = _cell_label(filename)
    where = f"{label}, line {lineno}" if label else f'File "{filename}", line {lineno}'
    line = line or linecache.getline(filename, lineno).strip()
    return [f"  {where}, in {name}"] + ([f"    {line}"] if line else [])


def _kernel_frames(tb) -> list[str]:
    """The notebook's own frames of a kernel-side traceback (not IPython's, not the runtime's)."""
    lines = []
    while tb is not None:
        code = tb.tb_frame.f_code
        path = os.path.abspath(code.co_filename)
        line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
        internal = (path.startswith(_HERE) or f"{os.sep}IPython{os.sep}" in path
                    or "run_cell_magic" in line)
        if not internal:
            lines += _frame_lines(code.co_filename, tb.tb_lineno, code.co_name, line)
        tb = tb.tb_next
    return lines


def _format_error(err: dict, debug: bool = False) -> str:
    """A traceback in Python's form, notebook cells labelled as Jupyter does; the runtime's and
    torch's frames hidden unless ``debug``. Lines missing on the rank come from the kernel's cells."""
    frames = [f for f in err["frames"] if debug or not (len(f) > 4 and f[4])]
    lines = ["Traceback (most recent call last):"] if frames else []
    for filename, lineno, name, line, *_ in frames:
        lines += _frame_lines(filename, lineno, name, line)
    lines.append(f"{err['type']}: {err['message']}")
    return "\n".join(lines)


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _span(ranks) -> str:
    """``0–3`` for a run of consecutive ranks, else ``0, 2``."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}\u2013{ranks[-1]}"
    return _ranks(ranks)


def interrupted(ranks, stuck) -> RanksInterrupted:
    """The one line the stop button prints: which ranks were interrupted, and what state is left."""
    if not stuck:
        return RanksInterrupted(f"interrupted on ranks {_span(ranks)}; the cluster is ready")
    return RanksInterrupted(
        f"interrupted on ranks {_span(ranks)}; rank(s) {_ranks(stuck)} did not stop and were "
        "killed: the ranks restart on the next run, and their variables are lost")


def explain(failures: dict, waited: float, timeout: float, debug: bool = False) -> ClusterError:
    """Turn per-rank failures into one readable error: the cause first, the echoes after.

    ``failures`` maps rank -> outcome (None for a rank that never answered); ``waited`` is how
    long the run waited for answers, ``timeout`` the collectives' own timeout; ``debug`` keeps
    the runtime's frames in the tracebacks.
    """
    debug = debug or _debug_env()
    texts, hung, died, timed_out, peers, causes = {}, [], [], [], [], []
    for rank, o in sorted(failures.items()):
        if o is None:
            hung.append(rank)
            texts[rank] = f"no answer within {waited:.0f} s, even after an interrupt"
            continue
        err = o["error"]
        texts[rank] = _format_error(err, debug)
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
            f"rank(s) {_ranks(timed_out)}: a collective did not complete within {timeout:.0f} s. "
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
    error = cls({r: texts[r] for r in failures}, message)
    error.debug = debug
    return error
