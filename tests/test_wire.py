"""Bytes on the wire: the instrument against an independent count, the ring formula, the ledger.

The instrument (:mod:`shardlab.instruments.wire`) sums the kernel's per-thread ``wchar`` of gloo's
threads. The independent count reads each TCP connection's own sequence counters
(``TCP_INFO``) for the same processes. Two different kernel mechanisms: if the instrument
counted something else (a file, a pipe, the store) or missed a thread, they would disagree.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import pytest
import torch
from instrument_workers import wire_against_tcp
from support import slowdown

import shardlab
from shardlab.engine import events
from shardlab.instruments import wire
from shardlab.instruments.traffic import KINDS, Ledger, ring_bytes, volume
from shardlab.launch import run_ranks

WORLD_SIZES = (2, 3, 4)
MIB = 2**20
linux_only = pytest.mark.skipif(wire.unavailable_reason() is not None, reason="no per-thread I/O counters here")


@functools.cache
def measured() -> list[dict]:
    """One launch of 4 ranks; the collectives run at 2, 3 and 4 ranks (groups of the first ranks)."""
    from support import slowdown

    numels = {n: n * math.ceil(MIB / 4 / n) for n in WORLD_SIZES}  # 1 MiB of float32, in equal shards
    return run_ranks(wire_against_tcp, 4, numels, timeout=slowdown(180))


def _at(world_size):
    """Per rank taking part at ``world_size``: (rank's result, {kind: measurements})."""
    return [(r, r["sizes"][world_size]) for r in measured() if r["rank"] < world_size]


@linux_only
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_wire_agrees_with_the_sockets_own_counters(world_size):
    """Within 2% for every collective kind on every rank (they agree to the byte here)."""
    for rank, kinds in _at(world_size):
        for kind in KINDS:
            m = kinds[kind]
            assert m["wire"] == pytest.approx(m["tcp"], rel=0.02, abs=256), (world_size, rank["rank"], kind, m)
        # the counts are megabytes, not 0 = 0 or a few headers
        assert kinds["all_reduce"]["tcp"] > rank["numel"][world_size] * 4 * (world_size - 1) / world_size


@linux_only
def test_the_ledger_reads_the_same_wire():
    for _, kinds in _at(4):
        for kind in KINDS:
            assert kinds[kind]["ledger_wire"] == pytest.approx(kinds[kind]["wire"], rel=0.02, abs=256)


@linux_only
def test_wire_leaves_out_the_rank_s_other_writes():
    """The process's own ``wchar`` saw the file write inside each block; the instrument did not,
    and a rank outside the group wrote nothing to the wire."""
    for rank in measured():
        for kinds in rank["sizes"].values():
            for m in kinds.values():
                assert m["proc"] >= m["wire"] + rank["noise"]
                assert m["wire"] < m["tcp"] + rank["noise"] / 2
                if not m["member"]:
                    assert m["wire"] == 0 == m["tcp"]


@linux_only
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gloo_reduce_scatter_sends_twice_the_ring(world_size):
    """What docs/instruments.md says gloo does: all-reduce and all-gather are rings, broadcast a
    binomial tree (the ring's bytes on average over ranks), reduce-scatter an all-reduce of the
    full buffer (twice the ring's bytes, ProcessGroupGloo::reduce_scatter_tensor_coalesced)."""
    ranks = _at(world_size)
    numel = ranks[0][0]["numel"][world_size]
    for kind, times_ring in (("all_reduce", 1), ("all_gather", 1), ("reduce_scatter", 2), ("broadcast", 1)):
        mean = sum(kinds[kind]["wire"] for _, kinds in ranks) / world_size
        assert mean == pytest.approx(times_ring * ring_bytes(kind, numel, world_size, 4), rel=0.01), kind
    root = ranks[0][1]["broadcast"]["wire"]
    assert root == pytest.approx(math.ceil(math.log2(world_size)) * numel * 4, rel=0.01)


@linux_only
def test_the_ledger_carries_formula_and_measurement_side_by_side():
    for rank, kinds in _at(4):
        for kind in KINDS:
            m = kinds[kind]
            formula = 3 / 4 * volume(kind, rank["numel"][4]) * 4
            assert m["ring"] == pytest.approx(formula) and m["row"]["ring_bytes"] == pytest.approx(formula)
            assert m["row"]["wire_bytes"] == m["ledger_wire"] == m["record"]["wire_bytes"]
            assert m["record"]["ring_bytes"] == pytest.approx(formula) and m["record"]["overlapped"] == 0
            for word in ("FORMULA", "MEASURED", "ring (MB)", "wire (MB)", f"{m['ledger_wire'] / 1e6:.3f}"):
                assert word in m["table"], (word, m["table"])


def test_the_ring_formula_stays_the_formula():
    assert ring_bytes("all_reduce", 1000, 4, 4) == 0.75 * 2000 * 4
    assert ring_bytes("reduce_scatter", 300, 3, 2) == pytest.approx(2 / 3 * 300 * 2)
    assert ring_bytes("broadcast", 100, 2, 8) == 400
    assert ring_bytes("all_gather", 8, 1, 4) == 0  # one rank sends nothing
    with pytest.raises(ValueError, match="collective"):
        ring_bytes("send", 8, 2, 4)


class ScriptedWire:
    """A stand-in meter whose readings are given, to check how overlapping calls are booked."""

    threads_seen = 2

    def __init__(self, readings):
        self._readings = iter(readings)

    def read(self):
        return next(self._readings)

    def close(self):
        pass


def _event(name, kind, phase, start, **extra):
    fields = dict(kind=kind, numel=100, dtype=torch.float32, world_size=2, unit=kind, start=start, phase=phase)
    return name, fields | extra


def _overlapping_ledger() -> Ledger:
    """An all-gather and a reduce-scatter that overlap: 10 bytes while A alone, 20 while both, 5 while
    B alone, 5 with no engine call in flight (40 in all)."""
    ledger = Ledger(ScriptedWire([0, 0, 10, 30, 35, 40]))
    for name, fields in (_event("comm", "all_gather", "backward", 1.0),
                         _event("comm", "reduce_scatter", "backward", 2.0),
                         _event("comm_done", "all_gather", "backward", 1.0, end=3.0),
                         _event("comm_done", "reduce_scatter", "backward", 2.0, end=4.0)):
        ledger.on_event(name, fields)
    ledger.close()
    return ledger


def test_overlapping_calls_are_booked_honestly():
    """A alone 10 bytes, A and B together 20 (another kind: shared), B alone 5, nothing 5."""
    ledger = _overlapping_ledger()
    assert ledger.wire_bytes() == 40  # the total is exact, whatever overlapped
    assert ledger.wire_bytes(kind="all_gather") == 10 and ledger.wire_bytes(kind="reduce_scatter") == 5
    assert dict(ledger.shared) == {(("backward", "all_gather"), ("backward", "reduce_scatter")): 20}
    assert ledger.outside == 5
    a, b = ledger.records
    assert (a["wire_bytes"], a["overlapped"], b["wire_bytes"], b["overlapped"]) == (30, 1, 25, 1)
    assert "overlap AG+RS" in ledger.table() and "no engine call" in ledger.table()


def test_without_counters_the_wire_says_unavailable_and_why(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    reason = wire.unavailable_reason()
    assert "darwin" in reason and "only the ring formula" in reason
    assert isinstance(wire.GlooWire().read(), wire.Unavailable)
    with shardlab.count_comm() as ledger:
        events.emit("comm", **_event("comm", "all_reduce", "backward", 1.0)[1])
        events.emit("comm_done", **_event("comm", "all_reduce", "backward", 1.0, end=2.0)[1])
    got = ledger.wire_bytes()
    assert isinstance(got, wire.Unavailable) and got.reason == reason and not got
    assert ledger.ring_bytes() == 0.5 * 200 * 4  # the formula is still there
    assert ledger.records[0]["wire_bytes"] == got and ledger.as_dict()["backward"]["all_reduce"]["wire_bytes"] == got
    assert "unavailable" in ledger.table() and reason in ledger.table()
    assert f"{got:>12.3f}" == " unavailable" and reason in str(got)
    with pytest.raises(wire.WireUnavailableError, match="darwin"):
        got / 2**20
    with pytest.raises(wire.WireUnavailableError):
        sum([got, 1])


@linux_only
def test_gpu_collectives_and_no_gloo_say_unavailable_too():
    with shardlab.count_comm() as ledger:  # this process has no process group, so no gloo threads
        events.emit("comm", **_event("comm", "all_gather", "forward", 1.0)[1])
    assert "no gloo threads" in ledger.wire_bytes().reason
    with shardlab.count_comm() as ledger:
        events.emit("comm", **_event("comm", "all_gather", "forward", 1.0, device="cuda")[1])
    assert "NCCL" in ledger.wire_bytes().reason
    with wire.count_wire() as w:
        pass
    assert "no gloo threads" in w.bytes.reason


def test_a_schedule_of_overlapping_or_uncounted_calls_shows_no_made_up_wire(monkeypatch):
    """Schedule.wire sums only calls that did not overlap (H1: summing 30 + 25 said 55 where 40 were
    written), and says ``unavail.`` where the machine cannot count (no crash in the printer)."""
    from shardlab.instruments.schedule import Schedule, side_by_side

    ledger = _overlapping_ledger()
    overlapped = Schedule(ledger.records, [], 2)
    assert overlapped.wire() is None and ledger.wire_bytes() == 40
    alone = Ledger(ScriptedWire([0, 0, 10, 10]))
    for name, fields in (_event("comm", "all_gather", "backward", 1.0),
                         _event("comm_done", "all_gather", "backward", 1.0, end=2.0)):
        alone.on_event(name, fields)
    alone.close()
    assert Schedule(alone.records, [], 2).wire() == alone.wire_bytes() == 10
    monkeypatch.setattr(sys, "platform", "darwin")
    with shardlab.count_comm() as blind:
        events.emit("comm", **_event("comm", "all_gather", "backward", 1.0)[1])
        events.emit("comm_done", **_event("comm", "all_gather", "backward", 1.0, end=2.0)[1])
    uncounted = Schedule(blind.records, [], 2)
    assert isinstance(uncounted.wire(), wire.Unavailable)
    table = side_by_side(uncounted, Schedule(alone.records, [], 2))
    assert "unavail." in table and "wire KB" in table


@pytest.mark.skipif(wire.unavailable_reason() is not None, reason="needs Linux's per-thread io counters")
def test_a_thread_that_names_itself_gloo_after_a_scan_is_still_counted():
    """c10d names its worker after the thread starts; a scan in between must not file it as not gloo's."""
    import threading

    renamed, written, scanned, read = (threading.Event() for _ in range(4))

    def worker():
        scanned.wait(slowdown(30))  # the meter sees this thread under its inherited name first
        with open("/proc/thread-self/comm", "w") as f:
            f.write("pt_gloo_runloop")
        renamed.set()
        with open(os.devnull, "wb", buffering=0) as sink:
            sink.write(b"x" * 100_000)
        written.set()
        read.wait(slowdown(30))  # alive until the meter has read it, as a gloo worker is

    with open("/proc/self/comm") as f:  # the creator's OS name: CPython >= 3.14 names a thread after
        creator = f.read().strip()       # its Thread.name, so give it the name c10d's workers inherit
    thread = threading.Thread(target=worker, name=creator, daemon=True)
    thread.start()
    meter = wire.GlooWire()
    try:
        before = meter.read()
        scanned.set()
        assert written.wait(slowdown(30)) and renamed.is_set()
        assert meter.read() - before >= 100_000 and meter.threads_seen >= 1
    finally:
        read.set()
        meter.close()
        thread.join(slowdown(30))
