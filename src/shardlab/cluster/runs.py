"""How one run goes: send to every rank, wait with a deadline, repair what the run broke.

A run never waits forever and never leaves the cluster broken for the next cell:

* the ranks' collective timeout fires first; past a margin, a rank that has not answered is
  interrupted (SIGINT), and one that ignores even that is killed;
* a rank whose process died is noticed by its pid, not by waiting for an answer that never comes;
* the kernel's own interrupt (the notebook's stop button) interrupts the ranks too;
* what a failure broke is only marked here (``_group_dirty``: rebuild the process group,
  ``_needs_restart``: restart the engines) and repaired by :meth:`_Runs._ready` before the
  next run, so that the error reaches the notebook at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from shardlab.cluster.errors import _died, _explain, _interrupted
from shardlab.cluster.on_rank import _on_rank
from shardlab.cluster.processes import _exit_codes

#: Seconds to wait, after an interrupt, for a rank to give control back before it is killed
#: (the default of a cluster's ``interrupt_grace``; a loaded machine may need more).
_INTERRUPT_GRACE = 5.0


class _Runs:
    """The run machinery of :class:`~shardlab.cluster.Cluster` (its only subclass), kept apart
    from starting and stopping. Uses the cluster's ``_client``, ``_ids``, ``pids``, ``engines``,
    ``timeout``, ``world_size``, ``quiet``, ``debug``, ``interrupt_grace``, the two repair
    flags, ``restart()``, ``_init_group()`` and ``_kill_engines()``.
    """

    def _ready(self) -> None:
        """Refuse a stopped cluster; repair what the last run broke, before this one."""
        if self._stopped:
            raise RuntimeError(
                "this cluster is stopped. Start a new one with cluster = shardlab.start_cluster(...)")
        if self._needs_restart:
            if not self.quiet:
                print("restarting the ranks after the last failure (their variables are lost) ...")
            self.restart()
        elif self._group_dirty:
            self._init_group()  # a rank failed last time and left the group: rebuild it (~0.1 s)

    def _submit(self, kind, payload, args, kwargs, imports, defs, timeout, show_values=False):
        """Run on every rank; return (values in rank order, None) or (None, the error to raise)."""
        self._ready()
        waiting = self.timeout if timeout is None else float(timeout)
        results = []
        try:
            for eid in self._ids:
                results.append(self._client[eid].apply_async(
                    _on_rank, kind, payload, args, kwargs, imports, defs))
            # The ranks' own collective timeout fires first; this margin only catches ranks that
            # never return to Python (an endless loop, a dead device).
            deadline = time.monotonic() + waiting + max(5.0, 0.1 * waiting)
            outcomes = self._collect(results, deadline)
        except KeyboardInterrupt:  # the stop button, at any point after the first send
            raise self._stop_button(results) from None
        hung = [r for r, o in enumerate(outcomes) if o is None]
        if hung:
            self._interrupt(hung)
            outcomes = self._collect(results, time.monotonic() + self.interrupt_grace, outcomes)
        self._show(outcomes, show_values)
        failures = {r: o for r, o in enumerate(outcomes) if o is None or not o.get("ok")}
        if not failures:
            return [o["value"] for o in outcomes], None
        self._group_dirty = True
        if any(o is None or o.get("died") for o in failures.values()):
            self._needs_restart = True
            self._kill_engines()  # free the CPU now; restarted on the next run
        return None, _explain(failures, waiting, self.timeout, self.debug)

    def _stop_button(self, results) -> BaseException:
        """The notebook's stop button: interrupt the ranks too, and say in one line what is left.

        A rank that does not give control back within a grace period is killed (the ranks
        restart on the next run); either way the next cell runs at once.
        """
        ranks = list(range(len(results)))
        if not results:  # interrupted before anything was sent: nothing runs on the ranks
            return KeyboardInterrupt()
        self._interrupt(ranks)
        self._group_dirty = True
        try:
            late = self._collect(results, time.monotonic() + self.interrupt_grace)
        except KeyboardInterrupt:  # pressed twice: do not wait
            late = [None] * len(results)
        stuck = [r for r, o in enumerate(late) if o is None]
        if stuck:
            self._needs_restart = True
            self._kill_engines()
        error = _interrupted(ranks, stuck)
        error.debug = self.debug
        return error

    def _collect(self, results, deadline, outcomes=None) -> list:
        """Wait until every rank answered or the deadline passed; None for ranks that did not."""
        outcomes = list(outcomes or [None] * len(results))
        next_check = time.monotonic() + 0.2
        while True:
            for rank, ar in enumerate(results):
                if outcomes[rank] is None and ar.ready():
                    try:
                        outcomes[rank] = ar.get(0)
                    except Exception as exc:  # noqa: BLE001 - the engine itself failed
                        outcomes[rank] = _died(f"{type(exc).__name__}: {exc}")
            if all(o is not None for o in outcomes) or time.monotonic() > deadline:
                return outcomes
            if time.monotonic() > next_check:  # a dead engine never answers: look for it
                next_check = time.monotonic() + 0.2
                gone = _exit_codes(self.pids) if self.engines == "local" else {}  # pids are local
                for rank, code in gone.items():
                    if outcomes[rank] is None:
                        how = "" if code is None else f" with code {code}"
                        outcomes[rank] = _died(f"its process exited{how}: a crash, os._exit or out of memory")
            self._client.wait(results, timeout=0.01)

    def _interrupt(self, ranks) -> None:
        """Send SIGINT (KeyboardInterrupt) to ranks stuck in Python code."""
        if self.engines == "local":
            for rank in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pids[rank], signal.SIGINT)
        else:
            self._client.send_signal(signal.SIGINT, targets=[self._ids[r] for r in ranks], block=False)

    def _show(self, outcomes, show_values) -> None:
        """Print what each rank printed (and a cell's final value), labelled by rank, in order."""
        for rank, o in enumerate(outcomes):
            if o is None:
                continue
            if o.get("stdout"):
                print(_label(rank, o["stdout"]))
            if o.get("stderr"):
                print(_label(rank, o["stderr"]), file=sys.stderr)
            if show_values and o.get("ok") and o.get("has_value"):
                print(_label(rank, _pretty(o["value"])))


def _label(rank: int, text: str) -> str:
    return "\n".join(f"[rank {rank}] {line}" for line in text.rstrip("\n").splitlines())


def _pretty(value) -> str:
    try:
        from IPython.lib.pretty import pretty
        return pretty(value)
    except Exception:  # noqa: BLE001
        return repr(value)
