"""A collective that raises instead of landing: ``comm`` says so (``COMM_FAILED``), a later
``wait()`` raises instead of reading as landed, and no instrument counts it as sent."""

from __future__ import annotations

import time

import pytest
import torch
from support import slowdown

import shardlab
from shardlab import launch
from shardlab.engine import comm, events
from shardlab.instruments.link import emulate_link, link_delay
from shardlab.instruments.traffic import ring_bytes


def _a_failed_gather_after_a_good_one():
    """On each of 2 ranks, under a ledger and an emulated link: one all-gather that lands, then
    one whose call raises (3 is not 2 × 2 elements). The link's books after each, the ledger's."""
    with shardlab.count_comm() as ledger, emulate_link(bandwidth_gbps=10, latency_us=0) as em:
        comm.all_gather(torch.empty(4), torch.ones(2))
        good = em.ops, em.link_time_s, em.free_at
        with pytest.raises((RuntimeError, ValueError)):
            comm.all_gather(torch.empty(3), torch.zeros(2))
        failed = em.ops, em.link_time_s, em.free_at
    counted = ledger.calls(), ledger.elements(), ledger.ring_bytes(), [r["numel"] for r in ledger.records]
    return good, failed, counted


def test_a_collective_that_raises_on_live_ranks_is_taken_off_the_books():
    """Nothing landed: the ledger counts the good call only, and the emulated link neither
    charges the failed call's time nor keeps its slot."""
    for good, failed, counted in launch.run_ranks(_a_failed_gather_after_a_good_one, 2, timeout=slowdown(90)):
        assert good[0] == 1 and good[1] == pytest.approx(link_delay("all_gather", 4, 4, 2, 10, 0))
        assert failed[0] == good[0] and failed[2] == good[2]
        assert failed[1] == pytest.approx(good[1], rel=1e-9)  # one cost added, then taken away
        calls, elements, ring, numels = counted
        assert (calls, elements, numels) == (1, 4, [4])
        assert ring == ring_bytes("all_gather", 4, 2, 4)  # 4 float32 over 2 ranks: 8 bytes


def test_an_async_call_whose_wait_raises_is_announced_as_failed():
    """``wait()`` on a call that never lands (a timeout, a rank gone) emits ``COMM_FAILED``, not
    ``COMM_DONE``, and the call leaves the in-flight list. Waiting again says it failed: it does
    not read as landed."""

    class NeverLands:
        def wait(self):
            raise RuntimeError("timed out")

    seen = []

    def listener(name, f):  # at COMM_FAILED the call is no longer in flight (memory's view)
        seen.append((name, f.get("error"), pending in comm.in_flight()))

    with events.listen(listener):
        pending = comm.Pending("all_gather", "blocks.0", (torch.zeros(2),))
        pending.announce(dict(kind="all_gather", numel=2, dtype=torch.float32, world_size=2,
                              unit="blocks.0", start=time.perf_counter(), phase="forward"))
        pending.started(NeverLands())
        with pytest.raises(RuntimeError, match="timed out"):
            pending.wait()
        with pytest.raises(RuntimeError, match=r"all_gather of blocks.0 failed earlier \(RuntimeError: "
                                               r"timed out\).*fresh model.*restart the ranks"):
            pending.wait()
    assert seen == [(events.COMM, None, True), (events.COMM_FAILED, "RuntimeError: timed out", False)]
    assert pending not in comm.in_flight() and pending.buffers == ()


def _failed(fields: dict, **changes) -> None:
    events.emit(events.COMM_FAILED, **{**fields, **changes}, error="RuntimeError: gone")


def test_a_failed_calls_unit_label_is_dropped_and_no_other():
    """The dispatcher recorders take a collective's unit from its ``COMM`` event. A call that
    raises before the dispatcher must not lend its label to the next call; an older call that
    fails at its wait must not drop the label staged for a newer one."""
    from shardlab.course.labs.lab4 import _Reductions
    from shardlab.instruments.schedule import record_shardlab

    rs = dict(kind="reduce_scatter", numel=4, dtype=torch.float32, world_size=2, unit="blocks.0",
              start=1.0, phase="backward")
    with record_shardlab() as seen:
        events.emit(events.COMM, **rs)
        _failed(rs, start=0.5, unit="blocks.1")  # an older call, failing at its wait
        assert seen.unit == "blocks.0"
        _failed(rs)
        assert seen.unit is None and seen.phase is None
    watcher = _Reductions(None, [])
    watcher.on_event(events.COMM, rs)
    watcher.on_event(events.COMM_FAILED, {**rs, "start": 0.5, "unit": "blocks.1"})
    assert watcher.named == "blocks.0"
    watcher.on_event(events.COMM_FAILED, rs)
    assert watcher.named is None


def test_a_listener_that_raises_does_not_keep_the_event_from_the_others():
    """An interrupt in the emulated link's sleep (it listens first) must not keep ``COMM_DONE``
    from the ledger: it would hold the call in flight for good. The first error still comes out."""
    heard = []

    def interrupted(name, f):
        raise KeyboardInterrupt

    with events.listen(lambda name, f: heard.append(name)), events.listen(interrupted, first=True):
        with pytest.raises(KeyboardInterrupt):
            events.emit(events.COMM_DONE, kind="all_gather")
    assert heard == [events.COMM_DONE]


def test_a_call_whose_done_event_is_interrupted_is_not_left_in_flight():
    """The call landed; an interrupt out of a ``COMM_DONE`` listener (the link's sleep) must not
    leave it listed in flight, where the memory instruments would count its buffers for good."""

    class Lands:
        def wait(self):
            pass

    def interrupted(name, f):
        if name == events.COMM_DONE:
            raise KeyboardInterrupt

    with events.listen(interrupted):
        pending = comm.Pending("all_gather", "blocks.0", (torch.zeros(2),))
        pending.announce(dict(kind="all_gather", numel=2, dtype=torch.float32, world_size=2,
                              unit="blocks.0", start=time.perf_counter(), phase="forward"))
        pending.started(Lands())
        with pytest.raises(KeyboardInterrupt):
            pending.wait()
    assert pending not in comm.in_flight() and pending.buffers == ()
