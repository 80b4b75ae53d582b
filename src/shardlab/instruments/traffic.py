"""A communication ledger: what this rank's collectives moved, by kind and by phase.

``count_comm()`` listens to the ``comm`` / ``comm_done`` events that every collective of the
engine emits (:mod:`shardlab.engine.comm` is its only door to the network) and books each call::

    with shardlab.count_comm() as ledger:
        loss_fn(model(x), y).backward(); optimizer.step()
    print(ledger)                       # a table: kind x phase, calls, volume, bytes, time
    ledger.elements()                   # 3 * padded Ψ at stage 3, 2 * padded Ψ at stages 0-2

Volume follows the ZeRO paper, in elements of the FULL buffer: an all-gather or a
reduce-scatter of a Ψ-element buffer moves Ψ, an all-reduce moves 2Ψ (it is a reduce-scatter
plus an all-gather), a broadcast moves Ψ. ``bytes_sent`` is what this rank puts on its link in
a ring (pipelined, for broadcast, on average over ranks): (N-1)/N × volume × element size.
``seconds`` is wall time from issue to completion; async collectives overlap compute, so these
seconds need not add up to lost time. gloo's algorithms are not all rings: measure, don't assume.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

from shardlab.engine import events
from shardlab.instruments.measured import Formula, Measured

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
PHASES = ("init", "forward", "backward", "step")
FIELDS = ("calls", "elements", "bytes_sent", "seconds")


MEASURED_FIELDS = ("calls", "elements", "seconds")  # counted or timed on this rank's live calls
FORMULA_FIELDS = ("bytes_sent",)  # the ring formula applied to those calls


def _tagged(field: str, value):
    """``Measured`` for what this rank counted or timed, ``Formula`` for ``bytes_sent``; a field
    in neither list stays a plain number (never taken for a measurement)."""
    if field in FORMULA_FIELDS:
        return Formula(value, formula="(N-1)/N × volume × element size (a ring)")
    return Measured(value, by="count_comm") if field in MEASURED_FIELDS else value


def volume(kind: str, numel: int) -> int:
    """Elements a collective on a ``numel``-element full buffer moves, as the paper counts them."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
    return 2 * numel if kind == "all_reduce" else numel


def ring_bytes_sent(kind: str, numel: int, world_size: int, element_size: int) -> float:
    """Bytes one rank sends for that collective in a ring: (N-1)/N × volume × element size."""
    return (world_size - 1) / world_size * volume(kind, numel) * element_size


class Ledger:
    """Totals per (phase, kind): ``calls``, ``elements`` (paper volume), ``bytes_sent``, ``seconds``."""

    def __init__(self):
        self.rows: dict = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
        self.records: list[dict] = []  # one per call: kind, phase, unit, numel, dtype, start, end

    # -- booking ----------------------------------------------------------------------------
    def on_event(self, name: str, f: dict) -> None:
        if name == "comm":
            row = self.rows[(f["phase"], f["kind"])]
            row["calls"] += 1
            row["elements"] += volume(f["kind"], f["numel"])
            row["bytes_sent"] += ring_bytes_sent(f["kind"], f["numel"], f["world_size"], f["dtype"].itemsize)
            self.records.append({k: f[k] for k in ("kind", "phase", "unit", "numel", "dtype", "start")})
        elif name == "comm_done":
            self.rows[(f["phase"], f["kind"])]["seconds"] += f["end"] - f["start"]
            for rec in reversed(self.records):  # the matching issue: same kind, unit and start
                if rec["start"] == f["start"] and rec["kind"] == f["kind"] and rec["unit"] == f["unit"]:
                    rec["end"] = f["end"]
                    break

    # -- reading ----------------------------------------------------------------------------
    def total(self, field: str = "elements", kind: str | None = None, phase: str | None = None):
        """Sum of ``field`` over the calls of ``kind`` and ``phase`` (None = all)."""
        if field not in FIELDS:
            raise ValueError(f"unknown field {field!r}; expected one of {FIELDS}")
        for name, value, allowed in (("kind", kind, KINDS), ("phase", phase, PHASES)):
            if value is not None and value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")
        return _tagged(field, sum(row[field] for (p, k), row in self.rows.items()
                                  if (kind is None or k == kind) and (phase is None or p == phase)))

    def calls(self, kind=None, phase=None) -> int:
        return self.total("calls", kind, phase)

    def elements(self, kind=None, phase=None) -> int:
        """Volume in elements, the paper's convention (all-reduce counts twice)."""
        return self.total("elements", kind, phase)

    def bytes_sent(self, kind=None, phase=None) -> float:
        return self.total("bytes_sent", kind, phase)

    def seconds(self, kind=None, phase=None) -> float:
        return self.total("seconds", kind, phase)

    def as_dict(self) -> dict:
        """``{phase: {kind: {calls, elements, bytes_sent, seconds}}}`` for the phases seen."""
        out: dict = {}
        for (phase, kind), row in sorted(self.rows.items(), key=lambda kv: (PHASES.index(kv[0][0]), KINDS.index(kv[0][1]))):
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
        """A readable table, one row per (phase, kind) and a total; ``params`` adds a ×Ψ column."""
        head = f"{'phase':<9}{'collective':<16}{'calls':>6}{'elements':>13}{'sent (MB)':>11}{'time (ms)':>11}"
        lines = [head + (f"{'× Ψ':>8}" if params else ""), "-" * (len(head) + (8 if params else 0))]
        rows = [(p, k, r) for p, ks in self.as_dict().items() for k, r in ks.items()]
        rows.append(("total", "", {f: self.total(f) for f in FIELDS}))
        for phase, kind, r in rows:
            line = (f"{phase:<9}{kind:<16}{r['calls']:>6}{r['elements']:>13,}"
                    f"{r['bytes_sent'] / 1e6:>11.3f}{r['seconds'] * 1e3:>11.2f}")
            lines.append(line + (f"{r['elements'] / params:>8.3f}" if params else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<Ledger {self.calls()} calls, {self.elements():,} elements>"


@contextmanager
def count_comm():
    """Book every collective the engine issues inside the block on this rank (see module doc)."""
    ledger = Ledger()
    with events.listen(ledger.on_event):
        yield ledger
