"""Two schedules side by side: which collectives each unit issued, how big, in what order.

A :class:`Schedule` is what one rank's step put on the network, as the dispatcher recorder saw
it (:mod:`shardlab.instruments.collectives`): one record per collective (kind, unit, phase,
numel of the full buffer, dtype, reduce op) and the stream of collectives and ``forward`` /
``backward`` / ``free`` marks in order. :func:`record_shardlab` records ShardLab's engine;
:func:`shardlab.instruments.fsdp2.record_fully_shard` records PyTorch's FSDP2. Then::

    print(side_by_side(ours, theirs))     # per unit: all-gathers, reduce-scatters, dtype, ring bytes
    for name, a, b in differences(ours, theirs): ...

The bytes are the ring formula, (N-1)/N x numel x element size, not the wire. A record may
carry measured wire bytes under ``wire_bytes`` (the traffic ledger's records, once they have them):
the table then adds a wire column beside the formula. Any list of records with the ledger's
keys (kind, unit, numel, dtype) makes a Schedule: ``Schedule(ledger.records, [], world_size)``.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from shardlab.engine import events
from shardlab.instruments.collectives import Recorder
from shardlab.instruments.traffic import ring_bytes
from shardlab.instruments.wire import Unavailable

SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC",
         events.FORWARD: "F", events.BACKWARD: "B", events.FREE: "free"}


@dataclasses.dataclass
class Schedule:
    """One rank's collectives (``records``) and the ordered ``stream`` of (what, unit)."""

    records: list[dict]
    stream: list[tuple[str, str | None]]
    world_size: int

    @classmethod
    def of(cls, seen: Recorder) -> Schedule:
        return cls(seen.records(), list(seen.stream), seen.log[0].world_size if seen.log else 1)

    def units(self) -> list[str]:
        """Units in the order their first collective was issued."""
        return list(dict.fromkeys(r["unit"] for r in self.records))

    def calls(self, unit: str | None = None, kind: str | None = None) -> list[dict]:
        return [r for r in self.records if (unit is None or r["unit"] == unit) and (kind is None or r["kind"] == kind)]

    def numel(self, unit=None, kind=None) -> int:
        return sum(r["numel"] for r in self.calls(unit, kind))

    def ring_bytes(self, unit=None, kind=None) -> float:
        return sum(ring_bytes(r["kind"], r["numel"], self.world_size, r["dtype"].itemsize)
                   for r in self.calls(unit, kind) if r["dtype"] is not None)  # None: no tensors, nothing sent

    def wire(self, unit=None, kind=None) -> float | Unavailable | None:
        """Measured wire bytes, if every record carries its own (``wire_bytes``); else None, or
        the records' :class:`~shardlab.instruments.wire.Unavailable` where this machine cannot count
        them (macOS, NCCL, ``wire=False``): the table then prints ``unavail.``, never a number.

        A record whose call overlapped others (``overlapped`` > 0) shares the bytes written
        meanwhile with them, so summing such records would count those bytes once per call: then
        there is no honest per-unit figure, and the ledger's step total is the one to show.
        """
        calls = self.calls(unit, kind)
        got = [r.get("wire_bytes") for r in calls]
        missing = next((g for g in got if isinstance(g, Unavailable)), None)
        if missing is not None:
            return missing
        if not got or any(not isinstance(g, (int, float)) for g in got) or any(r.get("overlapped", 0) for r in calls):
            return None
        return sum(got)

    def order(self, short=lambda u: u) -> str:
        """The stream as one line: ``AG root · AG blocks.0 · F root · ...``."""
        return " · ".join(f"{SHORT.get(what, what)} {short(unit)}" for what, unit in self.stream)


class _ShardLabRecorder(Recorder):
    """Each engine collective is announced by a ``comm`` event: its unit names that one call only."""

    def _record(self, kind, op, args):
        super()._record(kind, op, args)
        self.unit = self.phase = None


@contextmanager
def record_shardlab():
    """Record ShardLab's collectives at the dispatcher, each labelled by the engine's ``comm`` event."""
    seen = _ShardLabRecorder()
    staged = None  # the start of the call whose label is staged: only that call's failure clears it

    def on_event(name: str, f: dict) -> None:
        nonlocal staged
        if name == events.COMM:
            seen.unit, seen.phase, staged = f["unit"], f["phase"], f["start"]
        elif name == events.COMM_FAILED and f["start"] == staged:
            seen.unit = seen.phase = None  # it raised before the dispatcher took the label
        elif name in (events.FORWARD, events.BACKWARD, events.FREE):
            seen.mark(name, f.get("unit"))

    with events.listen(on_event), seen:
        yield seen


def _cell(s: Schedule, unit: str, wire: bool) -> str:
    def counts(kind):
        sizes = [r["numel"] for r in s.calls(unit, kind)]
        return f"{len(sizes)}×{sizes[0]:,}" if sizes and len(set(sizes)) == 1 else "+".join(map(str, sizes)) or "-"

    dtypes = "/".join(sorted({str(r["dtype"]).replace("torch.", "") for r in s.calls(unit)}))
    cell = f"{counts('all_gather'):>10} {counts('reduce_scatter'):>10} {dtypes:>8} {s.ring_bytes(unit) / 1e3:>8.1f}"
    if wire:
        cell += _wire_kb(s.wire(unit))
    return cell


def _wire_kb(w) -> str:
    if isinstance(w, Unavailable):
        return f" {'unavail.':>8}"
    return f" {w / 1e3:>8.1f}" if w is not None else f" {'-':>8}"


def side_by_side(ours: Schedule, theirs: Schedule, labels=("ShardLab stage 3", "fully_shard"),
                 sizes: dict | None = None) -> str:
    """Per unit, both schedules: all-gathers and reduce-scatters (count × elements), dtype, KB.

    ``sizes`` ({unit: real elements}) adds each unit's parameter count, to read the padding off.
    A ``wire`` column (KB) appears when the records carry measured wire bytes.
    """
    if ours.world_size != theirs.world_size:
        raise ValueError(f"the schedules ran on {ours.world_size} and {theirs.world_size} ranks: "
                         "compare them at one world size")
    wire = ours.wire() is not None or theirs.wire() is not None
    sub = f"{'AG':>10} {'RS':>10} {'dtype':>8} {'ring KB':>8}" + (f" {'wire KB':>8}" if wire else "")
    first = f"{'unit':<10}" + (f"{'elements':>9}" if sizes else "")
    width = len(sub)
    lines = [" " * len(first) + f" | {labels[0]:<{width}} | {labels[1]:<{width}}",
             first + f" | {sub} | {sub}"]
    lines.append("-" * len(lines[-1]))
    for unit in list(dict.fromkeys(ours.units() + theirs.units())):
        row = f"{str(unit):<10}" + (f"{sizes.get(unit, 0):>9,}" if sizes else "")
        lines.append(row + f" | {_cell(ours, unit, wire)} | {_cell(theirs, unit, wire)}")
    total = lambda s: f"{s.numel():>21,} {'':>8} {s.ring_bytes() / 1e3:>8.1f}" + (  # noqa: E731
        _wire_kb(s.wire()) if wire else "")
    lines.append(f"{'total':<10}" + (f"{sum(sizes.values()):>9,}" if sizes else "") + f" | {total(ours)} | {total(theirs)}")
    return "\n".join(lines)


# -- what differs, read off the two schedules ----------------------------------------------------
def free_before_reduce_scatter(s: Schedule, unit: str) -> bool | None:
    """In backward: does ``unit`` free its gathered weights before issuing its reduce-scatter?

    None when the stream holds no backward mark for ``unit`` (or no free or reduce-scatter after
    it): searching from the start instead would find the forward's free and answer wrongly.
    """
    begin = max((i for i, (w, u) in enumerate(s.stream) if w == events.BACKWARD and u == unit), default=None)
    if begin is None:
        return None
    stream = s.stream[begin:]
    rs = next((i for i, (w, u) in enumerate(stream) if w == "reduce_scatter" and u == unit), None)
    free = next((i for i, (w, u) in enumerate(stream) if w == events.FREE and u == unit), None)
    return None if rs is None or free is None else free < rs


def prefetched(s: Schedule, phase: str) -> list[str]:
    """The units whose ``phase`` all-gather was issued before another unit's compute began.

    A gather is prefetched when, between its issue and its own unit's ``phase`` mark, another
    unit's compute starts: the transfer can then run behind that unit's compute.
    """
    out, stream = [], s.stream
    for i, (what, unit) in enumerate(stream):
        if what != "all_gather" or s.records[_index(s, i)]["phase"] != phase:
            continue
        own = next((j for j in range(i + 1, len(stream)) if stream[j] == (phase, unit)), len(stream))
        if any(w == phase and u != unit for w, u in stream[i + 1:own]):
            out.append(unit)
    return out


def _index(s: Schedule, stream_position: int) -> int:
    """The record of the collective at ``stream_position`` (collectives appear in both in order)."""
    return sum(w not in (events.FORWARD, events.BACKWARD, events.FREE) for w, _ in s.stream[:stream_position])


def reductions(s: Schedule) -> list[str]:
    """The distinct (dtype, reduce op) of the reduce-scatters, e.g. ['float32 SUM']."""
    return sorted({f"{str(r['dtype']).replace('torch.', '')} {r['reduce_op']}" for r in s.calls(kind="reduce_scatter")})


def differences(ours: Schedule, theirs: Schedule, root: str = "root") -> list[tuple[str, str, str]]:
    """(what, ShardLab's, fully_shard's) for each way the two schedules can differ, measured."""
    both = [u for u in ours.units() if u in theirs.units() and u != root]

    def free_order(s):
        got = {u: free_before_reduce_scatter(s, u) for u in both}
        unseen = [u for u, g in got.items() if g is None]
        if unseen:
            return f"not seen for {', '.join(map(str, unseen))} (no backward mark, free or reduce-scatter)"
        return {frozenset({True}): "free, then reduce-scatter", frozenset({False}): "reduce-scatter, then free"}.get(
            frozenset(got.values()), f"mixed: {got}")

    return [
        ("elements all-gathered (padding)", f"{ours.numel(kind='all_gather'):,}", f"{theirs.numel(kind='all_gather'):,}"),
        ("backward: free and reduce-scatter", free_order(ours), free_order(theirs)),
        ("all-gathers of the root unit", str(len(ours.calls(root, "all_gather"))), str(len(theirs.calls(root, "all_gather")))),
        ("forward gathers prefetched", ", ".join(prefetched(ours, "forward")) or "none",
         ", ".join(prefetched(theirs, "forward")) or "none"),
        ("backward gathers prefetched", ", ".join(prefetched(ours, "backward")) or "none",
         ", ".join(prefetched(theirs, "backward")) or "none"),
        ("reduce-scatter dtype and op", ", ".join(reductions(ours)), ", ".join(reductions(theirs))),
    ]
