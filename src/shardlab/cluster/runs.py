"""How one run goes: send to every rank, wait with a deadline, repair what the run broke.

A run never waits forever and never leaves the cluster broken for the next cell:

* the ranks' collective timeout fires first; past a margin, a rank that has not answered is
  interrupted (SIGINT), and one that ignores even that is killed;
* a rank whose process died is noticed by its pid, not by waiting for an answer that never comes;
* the kernel's own interrupt (the notebook's stop button) interrupts the ranks too;
* what a failure broke is only marked here, as the engines' health (``Health.GROUP_BROKEN``:
  rebuild the process group, ``Health.ENGINES_DEAD``: restart the engines, ``engines.py``),
  and repaired by ``Cluster`` before the next run, so that the error reaches the notebook at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from shardlab.cluster.engines import Engines, Health
from shardlab.cluster.errors import died, explain, interrupted
from shardlab.cluster.on_rank import run_on_rank
from shardlab.cluster.processes import exit_codes

#: Seconds to wait, after an interrupt, for a rank to give control back before it is killed
#: (the default of a cluster's ``interrupt_grace``; a loaded machine may need more).
INTERRUPT_GRACE = 5.0


def submit(engines: Engines, kind, payload, args, kwargs, imports, defs, *, waiting: float,
           interrupt_grace: float, debug: bool, show_values: bool = False):
    """Run on every rank of healthy ``engines``, waiting ``waiting`` seconds (plus a margin);
    return (values in rank order, None) or (None, the error to raise)."""
    results = []
    try:
        for eid in engines.ids:
            results.append(engines.client[eid].apply_async(
                run_on_rank, kind, payload, args, kwargs, imports, defs))
        # The ranks' own collective timeout fires first; this margin only catches ranks that
        # never return to Python (an endless loop, a dead device).
        deadline = time.monotonic() + waiting + max(5.0, 0.1 * waiting)
        outcomes = _collect(engines, results, deadline)
    except KeyboardInterrupt:  # the stop button, at any point after the first send
        raise _stop_button(engines, results, interrupt_grace, debug) from None
    hung = [r for r, o in enumerate(outcomes) if o is None]
    if hung:
        _interrupt(engines, hung)
        outcomes = _collect(engines, results, time.monotonic() + interrupt_grace, outcomes)
    _show(outcomes, show_values)
    failures = {r: o for r, o in enumerate(outcomes) if o is None or not o.get("ok")}
    if not failures:
        return [o["value"] for o in outcomes], None
    engines.mark(Health.GROUP_BROKEN)
    if any(o is None or o.get("died") for o in failures.values()):
        engines.mark(Health.ENGINES_DEAD)
        engines.kill()  # free the CPU now; restarted on the next run
    return None, explain(failures, waiting, engines.timeout, debug)


def _stop_button(engines: Engines, results, interrupt_grace: float, debug: bool) -> BaseException:
    """The notebook's stop button: interrupt the ranks too, and say in one line what is left.

    A rank that does not give control back within a grace period is killed (the ranks
    restart on the next run); either way the next cell runs at once.
    """
    ranks = list(range(len(results)))
    if not results:  # interrupted before anything was sent: nothing runs on the ranks
        return KeyboardInterrupt()
    _interrupt(engines, ranks)
    engines.mark(Health.GROUP_BROKEN)
    try:
        late = _collect(engines, results, time.monotonic() + interrupt_grace)
    except KeyboardInterrupt:  # pressed twice: do not wait
        late = [None] * len(results)
    stuck = [r for r, o in enumerate(late) if o is None]
    if stuck:
        engines.mark(Health.ENGINES_DEAD)
        engines.kill()
    error = interrupted(ranks, stuck)
    error.debug = debug
    return error


def _collect(engines: Engines, results, deadline, outcomes=None) -> list:
    """Wait until every rank answered or the deadline passed; None for ranks that did not."""
    outcomes = list(outcomes or [None] * len(results))
    next_check = time.monotonic() + 0.2
    while True:
        for rank, ar in enumerate(results):
            if outcomes[rank] is None and ar.ready():
                try:
                    outcomes[rank] = ar.get(0)
                except Exception as exc:  # noqa: BLE001 - the engine itself failed
                    outcomes[rank] = died(f"{type(exc).__name__}: {exc}")
        if all(o is not None for o in outcomes) or time.monotonic() > deadline:
            return outcomes
        if time.monotonic() > next_check:  # a dead engine never answers: look for it
            next_check = time.monotonic() + 0.2
            gone = exit_codes(engines.pids) if engines.launcher == "local" else {}  # pids are local
            for rank, code in gone.items():
                if outcomes[rank] is None:
                    how = "" if code is None else f" with code {code}"
                    outcomes[rank] = died(f"its process exited{how}: a crash, os._exit or out of memory")
        engines.client.wait(results, timeout=0.01)


def _interrupt(engines: Engines, ranks) -> None:
    """Send SIGINT (KeyboardInterrupt) to ranks stuck in Python code."""
    if engines.launcher == "local":
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engines.pids[rank], signal.SIGINT)
    else:
        engines.client.send_signal(signal.SIGINT, targets=[engines.ids[r] for r in ranks], block=False)


def _show(outcomes, show_values) -> None:
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
