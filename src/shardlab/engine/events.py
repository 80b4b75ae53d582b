"""A tiny event bus: the engine says what it is doing, instruments listen.

The engine calls :func:`emit` at each step of the FSDP cycle (forward, backward, free,
optimizer step) and :mod:`shardlab.engine.comm` emits one event per collective when it is issued,
and one when it lands (or fails).
The names are the constants below, listed once with their fields. Instruments (communication ledger, timeline, slow-link emulation) subscribe with
:func:`listen`. With no listener, ``emit`` returns at once, so the hot path pays almost nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

Listener = Callable[[str, dict], None]

# The events, declared once: emitters and listeners use these names, never the strings.
# Every event also carries ``time`` (perf_counter) and ``phase`` (below).
FORWARD = "forward"              #: unit=: a unit's forward starts (its weights are gathered)
FORWARD_DONE = "forward_done"    #: unit=: a unit's forward returned
BACKWARD = "backward"            #: unit=: a unit's backward starts (its output's gradient arrived)
BACKWARD_DONE = "backward_done"  #: unit=: every gradient of a unit is computed
FREE = "free"                    #: unit=: a unit gave its borrowed shards back
COMM = "comm"                    #: a collective was issued: kind, numel, dtype, device, world_size, unit, start
COMM_DONE = "comm_done"          #: that collective landed: the same fields, and end
COMM_FAILED = "comm_failed"      #: that collective raised instead: the same fields, and error
STEP_START = "step_start"        #: the optimizer step begins
STEP_END = "step_end"            #: the optimizer step (and the stage's after_step) is over

_listeners: list[Listener] = []

#: What the engine is doing now: "init", "forward", "backward" or "step".
#: Collectives are filed under this phase by the communication ledger.
phase = "init"


def set_phase(name: str) -> None:
    global phase
    phase = name


def emit(name: str, **fields) -> None:
    """Tell every listener that ``name`` happened now (``fields`` describe it).

    Every listener hears the event even if one before it raised; the first error is raised once
    all have heard, and later ones are dropped.
    """
    if not _listeners:
        return
    fields.setdefault("time", time.perf_counter())
    fields.setdefault("phase", phase)
    first_error = None
    for listener in list(_listeners):
        # An interrupt in the emulated link's sleep, say: a ledger that missed that COMM_DONE
        # would keep the call in flight for good.
        try:
            listener(name, fields)
        except BaseException as exc:
            if first_error is None:
                first_error = exc
    if first_error is not None:
        raise first_error


def active() -> bool:
    """True when someone listens (lets callers skip work that only feeds instruments)."""
    return bool(_listeners)


@contextmanager
def listen(listener: Listener, *, first: bool = False):
    """Call ``listener(name, fields)`` for every event emitted inside the ``with`` block
    (an error it raises reaches the emitter, after the other listeners: see :func:`emit`).

    Listeners share one ``fields`` dict per event; ``first=True`` puts a listener ahead of
    the others, so that what it changes (slow-link emulation delays ``end``) is what they see.
    """
    if first:
        _listeners.insert(0, listener)
    else:
        _listeners.append(listener)
    try:
        yield listener
    finally:
        _listeners.remove(listener)
