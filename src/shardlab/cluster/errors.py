"""What a failed run raises in the notebook, and how the ranks' failures are told apart.

When one rank fails, its peers fail too ("a peer failed", or a collective timeout), so a plain
list of four tracebacks buries the cause. :func:`_explain` sorts the failures into the cause
(an exception in the learner's code), the echoes (peers released, collectives timed out) and
the casualties (ranks that hung or died), and says first what happened and what happens next.

The ranks send failures as plain data (see ``on_rank._failure``); the traceback text is built
here, in the kernel, because only the kernel has the notebook cells' source lines.
"""

from __future__ import annotations

import linecache

from shardlab.launch import RankError


class ClusterError(RankError):
    """One or more ranks failed in :meth:`Cluster.run`; ``.failures`` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str], message: str):
        self.failures = dict(sorted(failures.items()))
        RuntimeError.__init__(self, message)


class RankTimeout(ClusterError, TimeoutError):
    """A rank did not finish in time (it was interrupted, or killed if it ignored that)."""


class CollectiveTimeout(RankTimeout):
    """A collective did not complete in time: some rank never joined it."""


def _died(why: str) -> dict:
    """The outcome of a rank whose engine died: shaped like a failure the rank reported itself."""
    return {"ok": False, "died": True, "stdout": "", "stderr": "",
            "error": {"type": "RankDied", "message": why, "frames": [], "timeout": False,
                      "peer": False, "interrupted": False}}


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


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _explain(failures: dict, waited: float, timeout: float) -> ClusterError:
    """Turn per-rank failures into one readable error: the cause first, the echoes after.

    ``failures`` maps rank -> outcome (None for a rank that never answered); ``waited`` is how
    long the run waited for answers, ``timeout`` the collectives' own timeout.
    """
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
    return cls({r: texts[r] for r in failures}, message)
