"""A per-rank timeline of one step: when each unit is gathered, computed, freed and reduced.

``trace()`` listens to the engine's events on every rank and turns them into intervals on two
lanes, the format :func:`shardlab.instruments.plots.timeline` draws::

    {"rank": 1, "lane": "comm",    "kind": "all_gather", "unit": "blocks.0", "start": .., "end": ..}
    {"rank": 1, "lane": "compute", "kind": "forward",    "unit": "blocks.0", "start": .., "end": ..}

Kinds: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast`` (comm lane, from issue
to completion); ``forward``, ``backward`` (stage 3: per unit), ``step`` and the instant
``free`` (compute lane, ``start == end``). Instants ``backward_done`` mark when a unit's
gradients are all computed, at every stage.

Clocks: each process reads ``time.perf_counter()``. On entry every rank waits at a barrier and
takes that moment as its zero, so times are seconds since a common start (to within the
barrier's skew, microseconds on one machine). On exit the events of all ranks are exchanged
(``all_gather_object``), so every rank, rank 0 included, holds the whole picture in ``events``.
``start`` and ``end`` are :class:`~shardlab.instruments.measured.Measured` seconds.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch.distributed as dist

from shardlab.engine import comm, events
from shardlab.instruments.measured import Measured

#: the event that closes each compute interval, and the interval's kind
_ENDS = {events.FORWARD_DONE: events.FORWARD, events.BACKWARD_DONE: events.BACKWARD}


class Timeline:
    """What ``trace()`` records: this rank's intervals (``local``) and, after the block, every
    rank's (``events``)."""

    def __init__(self):
        self.rank = dist.get_rank() if comm.dist_ready() else 0
        self.local: list[dict] = []
        self.events: list[dict] = []
        self._open: dict = {}  # (kind, unit) -> start of a compute interval not yet closed
        self.t0 = 0.0

    def start(self) -> None:
        comm.barrier()
        self.t0 = time.perf_counter()

    def _add(self, lane, kind, unit, start, end, **extra) -> None:
        self.local.append(dict(rank=self.rank, lane=lane, kind=kind, unit=unit,
                               start=Measured(start - self.t0, by="trace"),
                               end=Measured(end - self.t0, by="trace"), **extra))

    def on_event(self, name: str, f: dict) -> None:
        unit, t = f.get("unit"), f["time"]
        if name == events.COMM_DONE:
            self._add("comm", f["kind"], unit, f["start"], f["end"], phase=f["phase"],
                      numel=f["numel"], dtype=str(f["dtype"]))
        elif name in (events.FORWARD, events.BACKWARD):
            self._open[(name, unit)] = t
        elif name in _ENDS:
            kind = _ENDS[name]
            start = self._open.pop((kind, unit), None)
            if start is not None:
                self._add("compute", kind, unit, start, t, phase=f["phase"])
            if name == events.BACKWARD_DONE:
                self._add("compute", events.BACKWARD_DONE, unit, t, t, phase=f["phase"])
        elif name == events.FREE:
            self._add("compute", events.FREE, unit, t, t, phase=f["phase"])
        elif name == events.STEP_START:
            self._open[("step", None)] = t
        elif name == events.STEP_END:
            self._add("compute", "step", None, self._open.pop(("step", None), t), t, phase="step")

    def gather(self) -> list[dict]:
        """Every rank's intervals, sorted by start, on every rank (a collective)."""
        self.events = sorted(comm.gather_lists(self.local), key=lambda e: (e["start"], e["rank"]))
        return self.events

    def of(self, rank: int | None = None, unit: str | None = None, kind: str | None = None) -> list[dict]:
        """The gathered (or, before that, local) intervals matching the given fields, by start."""
        source = self.events or self.local
        return sorted((e for e in source if (rank is None or e["rank"] == rank)
                       and (unit is None or e["unit"] == unit) and (kind is None or e["kind"] == kind)),
                      key=lambda e: e["start"])

    def plot(self, **kwargs):
        """Draw the gathered events with :func:`shardlab.instruments.plots.timeline`."""
        from shardlab.instruments.plots import timeline

        return timeline([e for e in (self.events or self.local) if e["lane"] in ("compute", "comm")], **kwargs)


@contextmanager
def trace(gather: bool = True):
    """Record the engine's per-unit events on this rank; on exit, exchange them across ranks.

    ::

        with shardlab.trace() as tr:
            loss_fn(model(x), y).backward(); optimizer.step()
        shardlab.instruments.plots.timeline(tr.events)

    Every rank must enter and leave the block (entry is a barrier, exit a gather); with
    ``gather=False`` the exit exchanges nothing and ``tr.events`` holds this rank's events only.
    If the block raises, nothing is exchanged, so a failing rank cannot hang the others.
    """
    tr = Timeline()
    tr.start()
    with events.listen(tr.on_event):
        yield tr
    if gather:
        tr.gather()
    else:
        tr.events = sorted(tr.local, key=lambda e: e["start"])
