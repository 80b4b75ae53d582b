"""A communication ledger: what this rank's collectives moved, by kind and by phase, three ways.

``count_comm()`` listens to the ``comm`` / ``comm_done`` events that every collective of the
engine emits (:mod:`shardlab.engine.comm` is its only door to the network) and books each call
(one that raises instead, ``comm_failed``, is taken off the books again)::

    with shardlab.count_comm() as ledger:
        loss_fn(model(x), y).backward(); optimizer.step()
    print(ledger)                       # a table: kind x phase, calls, volume, ring and wire bytes, time
    ledger.elements()                   # 3 * padded Ψ at stage 3, 2 * padded Ψ at stages 0-2
    ledger.wire_bytes()                 # this rank's bytes on the wire for the step, measured

Each call is counted three ways, side by side:

* ``elements``, the **paper's volume**, in elements of the FULL buffer: an all-gather or a
  reduce-scatter of a Ψ-element buffer moves Ψ, an all-reduce 2Ψ (a reduce-scatter plus an
  all-gather), a broadcast Ψ. A convention, not bytes.
* ``ring_bytes``, a **formula**: (N-1)/N × volume × element size, what one rank sends in a ring
  (for broadcast, a pipelined ring, on average over ranks). It is what NCCL's ring sends on GPUs.
* ``wire_bytes``, **measured**: the bytes this rank's gloo threads wrote to their sockets while
  the call was in flight, counted by the kernel (:mod:`shardlab.instruments.wire`). On gloo it
  differs from the ring where gloo is no ring: reduce-scatter sends twice the ring's bytes.

Async calls overlap, so the wire is booked by slices of time: bytes written while calls of one
(phase, kind) alone were in flight go to that row; bytes written while calls of several rows
were in flight go to ``shared`` (the table prints them as an "overlapped" row), and bytes written
while no engine call was in flight (bookkeeping such as a barrier) to ``outside``. The total,
``wire_bytes()``, is exact whatever overlapped. A record's ``wire_bytes`` is everything written
during its own window; it is that call's alone when its ``overlapped`` count is 0.
``seconds`` is wall time from issue to completion; async collectives overlap compute, so these
seconds need not add up to lost time.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

from shardlab.engine import events
from shardlab.instruments.measured import Formula, Measured
from shardlab.instruments.wire import GlooWire, Unavailable

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
PHASES = ("init", "forward", "backward", "step")
FIELDS = ("calls", "elements", "ring_bytes", "wire_bytes", "seconds")
SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


MEASURED_FIELDS = ("calls", "elements", "wire_bytes", "seconds")  # counted, read off the kernel or timed
FORMULA_FIELDS = ("ring_bytes",)  # the ring formula applied to those calls


def _tagged(field: str, value):
    """``Measured`` for what this rank counted, read or timed, ``Formula`` for ``ring_bytes``; a field
    in neither list stays a plain number (never taken for a measurement), and an ``Unavailable``
    wire count stays what it is: a reason, not a number."""
    if isinstance(value, Unavailable):
        return value
    if field in FORMULA_FIELDS:
        return Formula(value, formula="(N-1)/N × volume × element size (a ring)")
    return Measured(value, by="count_comm") if field in MEASURED_FIELDS else value


def volume(kind: str, numel: int) -> int:
    """Elements a collective on a ``numel``-element full buffer moves, as the paper counts them."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
    return 2 * numel if kind == "all_reduce" else numel


def ring_bytes(kind: str, numel: int, world_size: int, element_size: int) -> float:
    """The formula: bytes one rank sends for that collective in a ring, (N-1)/N × volume × element size."""
    return (world_size - 1) / world_size * volume(kind, numel) * element_size


class Ledger:
    """Totals per (phase, kind): ``calls``, ``elements`` (paper), ``ring_bytes`` (formula),
    ``wire_bytes`` (measured), ``seconds``; one record per call in ``records``."""

    def __init__(self, wire: GlooWire | None = None):
        self.rows: dict = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
        self.records: list[dict] = []  # kind, phase, unit, numel, dtype, start, end, ring/wire bytes
        self.shared: dict[tuple, int] = defaultdict(int)  # rows in flight together -> bytes
        self.outside = 0  # bytes written while no engine collective was in flight
        self._wire = wire
        self._first = self._last = wire.read() if wire is not None else Unavailable("this ledger takes no wire readings (count_comm(wire=False))")
        self._in_flight: list[dict] = []
        self._cuda = False
        self._closed = False

    # -- booking ----------------------------------------------------------------------------
    def _advance(self) -> None:
        """Read the wire and give the bytes since the last reading to the calls in flight."""
        if self._wire is None or self._closed or isinstance(self._last, Unavailable):
            return
        now = self._wire.read()
        delta, self._last = now - self._last, now
        if not delta:
            return
        rows = sorted({(r["phase"], r["kind"]) for r in self._in_flight})
        for rec in self._in_flight:
            rec["wire_bytes"] += delta
        if not rows:
            self.outside += delta
        elif len(rows) == 1:
            self.rows[rows[0]]["wire_bytes"] += delta
        else:
            self.shared[tuple(rows)] += delta

    def on_event(self, name: str, f: dict) -> None:
        if name == events.COMM:
            self._advance()
            row = self.rows[(f["phase"], f["kind"])]
            ring = ring_bytes(f["kind"], f["numel"], f["world_size"], f["dtype"].itemsize)
            row["calls"] += 1
            row["elements"] += volume(f["kind"], f["numel"])
            row["ring_bytes"] += ring
            rec = {k: f[k] for k in ("kind", "phase", "unit", "numel", "dtype", "start")}
            rec.update(ring_bytes=ring, wire_bytes=0, overlapped=len(self._in_flight))
            self._cuda |= f.get("device", "cpu") == "cuda"
            for other in self._in_flight:
                other["overlapped"] += 1
            self._in_flight.append(rec)
            self.records.append(rec)
        elif name == events.COMM_DONE:
            self._advance()
            self.rows[(f["phase"], f["kind"])]["seconds"] += f["end"] - f["start"]
            rec = self._take_in_flight(f)
            if rec is not None:
                rec["end"] = f["end"]
        elif name == events.COMM_FAILED:
            self._advance()  # what did reach the wire before it raised stays where it went
            rec = self._take_in_flight(f)
            if rec is not None:
                self._take_back(rec)

    def _take_back(self, rec: dict) -> None:
        """A call that raised never landed: it is no call, and no ring bytes are owed for it.

        Its row goes too when the call was all it had; a row that holds measured wire bytes or
        seconds, or that a shared reading names, stays (with zero calls).
        """
        key = (rec["phase"], rec["kind"])
        row = self.rows[key]
        row["calls"] -= 1
        row["elements"] -= volume(rec["kind"], rec["numel"])
        row["ring_bytes"] -= rec["ring_bytes"]
        if row["calls"] == 0:  # exactly zero, not a float's residue of adding and taking back
            row["elements"] = row["ring_bytes"] = 0
        # by identity: two calls of one unit, kind and size can make equal records
        del self.records[next(i for i, r in enumerate(self.records) if r is rec)]
        shared = any(key in rows for rows in self.shared)
        if row["calls"] == 0 and not row["wire_bytes"] and not row["seconds"] and not shared:
            del self.rows[key]

    def _take_in_flight(self, f: dict) -> dict | None:
        """Take the record of the call ``f`` closes out of the in-flight list: same kind, unit, start."""
        for rec in reversed(self._in_flight):
            if rec["start"] == f["start"] and rec["kind"] == f["kind"] and rec["unit"] == f["unit"]:
                self._in_flight.remove(rec)
                return rec
        return None

    def close(self) -> None:
        """Take the last reading (count_comm does this when its block ends)."""
        self._advance()
        self._closed = True
        why = self.wire_unavailable()
        if why is not None:
            for rec in self.records:
                rec["wire_bytes"] = why

    # -- reading ----------------------------------------------------------------------------
    def wire_unavailable(self) -> Unavailable | None:
        """Why this ledger has no wire count (None when it has one)."""
        if isinstance(self._last, Unavailable):
            return self._last
        if self._cuda:
            return Unavailable("NCCL carried GPU collectives over NVLink/PCIe/InfiniBand, not this "
                               "process's sockets: only the ring formula is available")
        if self.records and self._wire.threads_seen == 0:
            return Unavailable("no gloo threads in this process: these collectives did not run on gloo")
        return None

    def total(self, field: str = "elements", kind: str | None = None, phase: str | None = None):
        """Sum of ``field`` over the calls of ``kind`` and ``phase`` (None = all).

        For ``wire_bytes`` with no kind and no phase, the exact total (overlaps and bookkeeping
        included); with a kind or phase, the bytes booked to those rows alone (see ``shared``).
        """
        if field not in FIELDS:
            raise ValueError(f"unknown field {field!r}; expected one of {FIELDS}")
        for name, value, allowed in (("kind", kind, KINDS), ("phase", phase, PHASES)):
            if value is not None and value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")
        if field == "wire_bytes":
            why = self.wire_unavailable()
            if why is not None:
                return why
            if kind is None and phase is None:
                self._advance()
                return _tagged(field, self._last - self._first)
        return _tagged(field, sum(row[field] for (p, k), row in self.rows.items()
                                  if (kind is None or k == kind) and (phase is None or p == phase)))

    def calls(self, kind=None, phase=None) -> int:
        return self.total("calls", kind, phase)

    def elements(self, kind=None, phase=None) -> int:
        """Volume in elements, the paper's convention (all-reduce counts twice)."""
        return self.total("elements", kind, phase)

    def ring_bytes(self, kind=None, phase=None) -> float:
        """The ring formula's bytes for these calls: what NCCL's ring would send (not measured)."""
        return self.total("ring_bytes", kind, phase)

    def wire_bytes(self, kind=None, phase=None):
        """Bytes this rank's gloo threads wrote to the wire, measured (an int, or Unavailable)."""
        return self.total("wire_bytes", kind, phase)

    def seconds(self, kind=None, phase=None) -> float:
        return self.total("seconds", kind, phase)

    def as_dict(self) -> dict:
        """``{phase: {kind: {calls, elements, ring_bytes, wire_bytes, seconds}}}`` for the phases seen."""
        why = self.wire_unavailable()
        out: dict = {}
        for (phase, kind), row in sorted(self.rows.items(), key=lambda kv: (PHASES.index(kv[0][0]), KINDS.index(kv[0][1]))):
            row = dict(row, **({"wire_bytes": why} if why is not None else {}))
            out.setdefault(phase, {})[kind] = {f: _tagged(f, v) for f, v in row.items()}
        return out

    def summary(self, params: int | None = None) -> dict:
        """Totals per kind and overall; with ``params`` (Ψ), also the volume in multiples of Ψ."""
        out = {kind: {f: self.total(f, kind=kind) for f in FIELDS} for kind in KINDS if self.calls(kind)}
        out["total"] = {f: self.total(f) for f in FIELDS}
        if params:
            for row in out.values():
                row["psi"] = row["elements"] / params
        return out

    def table(self, params: int | None = None) -> str:
        """One row per (phase, kind), the overlapped bytes, and a total; ``params`` adds a ×Ψ column.

        Three counts side by side: the paper's volume, the ring's bytes (a formula) and the
        wire's bytes (measured on this rank), then wire / ring.
        """
        why = self.wire_unavailable()
        gone = why is not None
        psi = f"{'× Ψ':>7}" if params else ""
        head = (f"{'phase':<9}{'collective':<16}{'calls':>6}{'elements':>13}{psi}"
                f"{'ring (MB)':>12}{'wire (MB)':>12}{'wire/ring':>10}{'time (ms)':>11}")
        top = f"{'':<31}{'paper':>13}{'':<{len(psi)}}{'FORMULA':>12}{'MEASURED':>12}"

        def cell(x, width, fmt=""):
            return " " * width if x is None else f"{x:>{width}{fmt}}"

        def line(phase, label, calls=None, elements=None, ring_bytes=None, wire_bytes=None, seconds=None):
            ring, wire = ring_bytes, wire_bytes
            ratio = None if gone or not ring or wire is None else wire / ring
            return (f"{phase:<9}{label:<16}" + cell(calls, 6) + cell(elements, 13, ",")
                    + (cell(None if elements is None else elements / params, 7, ".3f") if params else "")
                    + cell(None if ring is None else ring / 1e6, 12, ".3f")
                    + (f"{'unavailable':>12}" if gone else cell(None if wire is None else wire / 1e6, 12, ".3f"))
                    + cell(ratio, 10, ".2f") + cell(None if seconds is None else seconds * 1e3, 11, ".2f"))

        lines = [top, head, "-" * len(head)]
        for phase, kinds in self.as_dict().items():
            lines += [line(phase, kind, **r) for kind, r in kinds.items()]
        if not gone:
            for rows, nbytes in self.shared.items():
                phases = sorted({p for p, _ in rows}, key=PHASES.index)
                kinds = "+".join(SHORT[k] for k in sorted({k for _, k in rows}, key=KINDS.index))
                lines.append(line(phases[0] if len(phases) == 1 else "mixed", f"overlap {kinds}", wire_bytes=nbytes))
            if self.outside:
                lines.append(line("-", "no engine call", wire_bytes=self.outside))
        lines.append(line("total", "", **{f: self.total(f) for f in FIELDS}))
        lines.append("ring: a FORMULA, (N-1)/N × volume × element size, what NCCL's ring sends on GPUs.")
        if gone:
            lines.append(f"wire: {why}.")
        else:
            lines.append("wire: MEASURED, bytes gloo's threads wrote to this rank's sockets (the kernel's count).")
            if self.shared:
                lines.append("overlap: bytes written while calls of those kinds were in flight together.")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<Ledger {self.calls()} calls, {self.elements():,} elements>"


@contextmanager
def count_comm(wire: bool = True):
    """Book every collective the engine issues inside the block on this rank (see module doc).

    ``wire=False`` skips the kernel readings (about 20 µs a gloo thread per call and completion).
    """
    ledger = Ledger(GlooWire() if wire else None)
    try:
        with events.listen(ledger.on_event):
            yield ledger
    finally:
        ledger.close()
        if ledger._wire is not None:
            ledger._wire.close()
