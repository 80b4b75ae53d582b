"""The stage-3 cycle seen on the timeline: gather, compute, free, and prefetch overlap."""

from __future__ import annotations

import pytest
from instrument_workers import measured

import shardlab
from shardlab.engine import events

CYCLE = ["all_gather", "forward", "free", "all_gather", "backward", "reduce_scatter", "free"]


def _blocks(m):
    return [u for u in m["unit_names"] if u != "root"]


def _of(evs, rank, unit=None, kind=None, phase=None):
    return sorted((e for e in evs if e["rank"] == rank and (unit is None or e["unit"] == unit)
                   and (kind is None or e["kind"] == kind) and (phase is None or e.get("phase") == phase)),
                  key=lambda e: e["start"])


def test_every_rank_is_gathered_on_one_clock():
    results = measured(2)
    evs = results[0][3]["events"]
    assert {e["rank"] for e in evs} == {0, 1}
    assert results[1][3]["events"] == evs  # every rank holds the whole picture
    assert all(0 <= e["start"] <= e["end"] for e in evs)
    assert all(e["lane"] in ("compute", "comm") for e in evs)


def test_stage3_cycle_per_unit():
    """Each block: all_gather -> forward -> free -> all_gather -> backward -> reduce_scatter -> free."""
    for prefetch_index in (3, 4):  # with and without prefetch
        m = measured(2)[0][prefetch_index]
        for rank in (0, 1):
            for unit in _blocks(m):
                kinds = [e["kind"] for e in _of(m["events"], rank, unit) if e["kind"] in set(CYCLE)]
                assert kinds == CYCLE, (prefetch_index, rank, unit, kinds)


def test_prefetch_overlaps_the_next_gather_with_compute():
    with_prefetch, without = measured(2)[0][3], measured(2)[0][4]
    for m, overlaps in ((with_prefetch, True), (without, False)):
        blocks = _blocks(m)
        for rank in (0, 1):
            for this, nxt in zip(blocks, blocks[1:]):
                compute = _of(m["events"], rank, this, "forward")[0]
                gather = _of(m["events"], rank, nxt, "all_gather", "forward")[0]
                assert (gather["start"] < compute["end"]) == overlaps, (rank, this, nxt)


def test_step_and_backward_done_are_marked_at_every_stage():
    for m in measured(2)[0][:4]:
        kinds = {e["kind"] for e in m["events"]}
        assert {"step", "backward_done"} <= kinds


def test_trace_without_process_group():
    with shardlab.trace() as tr:
        events.emit("forward", unit="u", time=1.0)
        events.emit("forward_done", unit="u", time=1.25)
        events.emit("free", unit="u")
    assert [e["kind"] for e in tr.events] == ["forward", "free"]
    assert tr.events[0]["end"] - tr.events[0]["start"] == 0.25 and tr.events[0]["rank"] == 0
    assert tr.of(kind="free")[0]["unit"] == "u"


def test_trace_events_draw():
    """The chart shows what the trace holds: a compute and a comm lane per rank, a bar per
    interval as long as it lasted, a marker per instant, and every kind in the legend."""
    from matplotlib.patches import Rectangle

    from shardlab.instruments.plots import timeline

    evs = measured(2)[0][3]["events"]
    ax = timeline(evs, time_unit="ms").axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    intervals = [e for e in evs if e["end"] > e["start"]]
    instants = [e for e in evs if e["end"] <= e["start"]]
    assert intervals and instants
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert sorted(b.get_width() for b in bars) == pytest.approx(
        sorted((e["end"] - e["start"]) * 1e3 for e in intervals))
    markers = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
    assert len(markers) == len(instants)
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {e["kind"] for e in evs}
