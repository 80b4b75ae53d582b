"""Slow-link emulation: the ring cost model, the presets, and a real collective slowed down."""

import time

import pytest
import torch
from support import slowdown

import shardlab
from shardlab import launch
from shardlab.engine import events
from shardlab.instruments.link import LINKS, Link, LinkEmulator, emulate_link, link_delay

MB = 10**6


def test_delay_follows_the_ring_cost_model():
    n, nbytes, bw, lat = 4, 100 * MB, 8.0, 10.0  # 8 Gbit/s = 1 GB/s
    alpha, beta = lat * 1e-6, 1e9
    ag = link_delay("all_gather", nbytes // 4, 4, n, bw, lat)
    assert ag == pytest.approx(3 * alpha + 3 / 4 * nbytes / beta)
    assert link_delay("reduce_scatter", nbytes // 4, torch.float32, n, bw, lat) == pytest.approx(ag)
    assert link_delay("all_reduce", nbytes // 2, torch.bfloat16, n, bw, lat) == pytest.approx(2 * ag)
    assert link_delay("broadcast", nbytes, "uint8", n, bw, lat) == pytest.approx(3 * alpha + nbytes / beta)


def test_one_rank_sends_nothing_and_latency_adds_up():
    assert link_delay("all_reduce", 10**9, 4, 1, 1.0, 100.0) == 0.0
    assert link_delay("all_gather", 0, 4, 8, 1.0, 100.0) == pytest.approx(7 * 100e-6)


def test_presets_are_sane():
    assert set(LINKS) == {"NVLink", "InfiniBand", "10GbE", "1GbE"}
    order = [LINKS[k] for k in ("NVLink", "InfiniBand", "10GbE", "1GbE")]
    assert [link.bandwidth_gbps for link in order] == sorted((link.bandwidth_gbps for link in order), reverse=True)
    assert [link.latency_us for link in order] == sorted(link.latency_us for link in order)
    assert LINKS["10GbE"].bandwidth_gbps == 10 and LINKS["1GbE"].bandwidth_gbps == 1
    assert all(link.note for link in order)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bandwidth_gbps=0), "bandwidth"), (dict(bandwidth_gbps=-1), "bandwidth"),
    (dict(bandwidth_gbps=1, latency_us=-1), "latency"), (dict(preset="2GbE"), "unknown link"),
    (dict(), "bandwidth_gbps or a preset"),
])
def test_bad_links_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        with emulate_link(**kwargs):
            pass
    assert not events.active()


def test_bad_collective_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown collective"):
        link_delay("all_to_all", 10, 4, 2, 1.0, 0.0)
    with pytest.raises(ValueError, match="element size"):
        link_delay("all_gather", 10, "complex-ish", 2, 1.0, 0.0)
    with pytest.raises(ValueError, match="world_size"):
        link_delay("all_gather", 10, 4, 0, 1.0, 0.0)


def test_preset_by_position_with_override_and_no_nesting():
    with emulate_link("1GbE", latency_us=0) as em:
        assert em.link.bandwidth_gbps == 1 and em.link.latency_us == 0
        with pytest.raises(RuntimeError, match="already emulated"):
            with emulate_link("10GbE"):
                pass
    assert not events.active()


# perf_counter times are large (seconds since boot): approx's relative tolerance would grow with
# them, so times on the clock are compared to a microsecond.
_CLOCK = 1e-6


def _issue(kind="all_gather", numel=125_000, world_size=2):
    fields = dict(kind=kind, numel=numel, dtype=torch.float32, world_size=world_size, unit=None,
                  start=time.perf_counter(), phase="forward")
    events.emit("comm", **fields)
    return fields


def test_compute_between_issue_and_wait_hides_the_transfer():
    # 125k float32 at 2 ranks on 0.04 Gbit/s: 0.5 MB / 5 MB/s = 0.05 s.
    with emulate_link(bandwidth_gbps=0.04) as em:
        op = _issue()
        time.sleep(0.06)  # "compute" longer than the transfer
        events.emit("comm_done", **op, end=time.perf_counter())
    assert em.link_time_s == pytest.approx(0.05)
    assert em.slept_s == 0.0  # nothing left to wait for
    with emulate_link(bandwidth_gbps=0.04, overlap=False) as em:
        op = _issue()
        time.sleep(0.06)
        events.emit("comm_done", **op, end=time.perf_counter())
    assert em.slept_s == pytest.approx(0.05, rel=0.2)  # the pessimistic bound hides nothing


def test_the_link_carries_one_transfer_at_a_time():
    em = LinkEmulator(Link("slow", 0.04, 0.0))
    with events.listen(em):
        a, b = _issue(), _issue()
        t0 = time.perf_counter()
        events.emit("comm_done", **a, end=time.perf_counter())
        events.emit("comm_done", **b, end=time.perf_counter())
        elapsed = time.perf_counter() - t0
    assert em.ops == 2 and em.link_time_s == pytest.approx(0.1)
    assert 0.09 <= elapsed < slowdown(0.5)  # the second waited for the first


def timed_all_gather(bandwidth_gbps: float, load_s: float = 0.0):
    """Run on each of 2 ranks: an all-gather inside emulate_link, then three after it. Returns
    the time inside, the emulator's books (ops, link time, sleep) once inside and again after the
    block, whether anyone still listens, and the ledger's seconds.

    ``load_s`` stands for a loaded machine: a listener ahead of the emulator holds each collective's
    completion that much longer, as a slow gloo call would, so the emulator finds the link's time
    already spent and sleeps nothing."""
    from shardlab.engine import comm

    shard = torch.ones(250_000)  # 1 MB a rank, 2 MB full
    full = torch.empty(2 * shard.numel())

    def once():
        t = time.perf_counter()
        comm.all_gather(full, shard)
        return time.perf_counter() - t

    def loaded(name, fields):
        if name == events.COMM_DONE and load_s:
            time.sleep(load_s)
            fields["end"] = time.perf_counter()

    once()
    # the ledger listens first, yet must book the emulated (slow) completion time
    with shardlab.count_comm() as ledger, emulate_link(bandwidth_gbps, latency_us=0) as em:
        with events.listen(loaded, first=True):
            during = once()
        inside = (em.ops, em.link_time_s, em.slept_s)
    for _ in range(3):
        once()
    after = (em.ops, em.link_time_s, em.slept_s)
    return during, inside, after, events.active(), ledger.total("seconds")


@pytest.mark.parametrize("load_s", [0.0, 0.3], ids=["idle", "loaded"])
def test_a_real_collective_is_slowed_then_restored(load_s):
    """What the emulator books is exact on any machine; what it sleeps depends on the load (on a
    loaded one the collective alone can outlast the link's time, and the sleep is then zero), so
    the sleep is not asserted and no wall time has an upper bound."""
    bw = 0.05  # Gbit/s: 1 MB sent per rank -> 0.16 s
    expected = link_delay("all_gather", 500_000, 4, 2, bw, 0.0)
    assert expected == pytest.approx(0.16)
    for during, inside, after, still_listening, booked in launch.run_ranks(timed_all_gather, 2, bw, load_s,
                                                                           timeout=slowdown(90)):
        ops, link_time, slept = inside
        assert ops == 1 and link_time == pytest.approx(expected)  # one all-gather, on the slow link
        assert during >= 0.95 * expected  # the sleep pads up to the booked finish, whatever the load
        assert booked >= 0.95 * expected  # instruments see the slow link's completion time
        assert 0.0 <= slept <= expected + 1e-9
        assert after == inside  # restored: the collectives after the block are not slowed or booked
        assert not still_listening


def test_two_queued_calls_that_fail_leave_the_link_free():
    """A and B queued on the link, B behind A; both raise, in either order: the link is free again
    from when it was free before A, and a third call is booked from its own start."""
    for order in ((0, 1), (1, 0)):
        em = LinkEmulator(Link("slow", 0.04, 0.0))
        with events.listen(em):
            queued = [_issue(), _issue()]
            assert em.free_at > queued[1]["start"] + 0.09  # B waits behind A: two transfers booked
            for i in order:
                events.emit(events.COMM_FAILED, **queued[i], error="RuntimeError: gone")
            assert em.ops == 0 and em.free_at == 0.0
            c = _issue()
            assert em.free_at == pytest.approx(c["start"] + 0.05, abs=_CLOCK)
            events.emit(events.COMM_DONE, **c, end=time.perf_counter())


def test_a_failed_call_does_not_delay_the_call_queued_behind_it():
    """A and B queued, B behind A; A raises, B lands: B is booked again from its own start, one
    transfer long, so the sleep stays within the link time (the slot A held was never used)."""
    em = LinkEmulator(Link("slow", 0.04, 0.0))
    with events.listen(em):
        a, b = _issue(), _issue()
        events.emit(events.COMM_FAILED, **a, error="RuntimeError: gone")
        assert em.ops == 1 and em.free_at == pytest.approx(b["start"] + 0.05, abs=_CLOCK)
        events.emit(events.COMM_DONE, **b, end=time.perf_counter())
    assert em.link_time_s == pytest.approx(0.05) and em.slept_s <= em.link_time_s + 1e-9


def test_a_call_that_landed_keeps_its_slot_when_one_ahead_of_it_fails():
    """A, B and C queued in that order; B lands, then A raises: B did use the link, so C is booked
    again behind B's finish, never beside it."""
    em = LinkEmulator(Link("slow", 0.04, 0.0))  # 0.05 s a transfer
    with events.listen(em):
        a, b, c = _issue(), _issue(), _issue()
        b_finish = em.free_at - 0.05  # booked behind A: A's 0.05 s, then its own
        events.emit(events.COMM_DONE, **b, end=time.perf_counter())
        events.emit(events.COMM_FAILED, **a, error="RuntimeError: gone")
        assert em.ops == 2 and em.free_at == pytest.approx(b_finish + 0.05, abs=_CLOCK)
        events.emit(events.COMM_DONE, **c, end=time.perf_counter())
    assert em.link_time_s == pytest.approx(0.1)


def test_a_failure_moves_no_call_later():
    """A, M and L queued; L lands first (waited out of order), then A raises: M, queued between A
    and L, never moves later (L's slot is behind M's)."""
    em = LinkEmulator(Link("slow", 0.04, 0.0))  # 0.05 s a transfer
    with events.listen(em):
        a, m, last = _issue(), _issue(), _issue()
        m_finish = em.free_at - 0.05
        events.emit(events.COMM_DONE, **last, end=time.perf_counter())
        events.emit(events.COMM_FAILED, **a, error="RuntimeError: gone")
        assert em.free_at == pytest.approx(m_finish + 0.05, abs=_CLOCK)  # L's finish: the link's last transfer
        slept = em.slept_s  # L's sleep, up to its booked finish: M's, earlier, has passed
        events.emit(events.COMM_DONE, **m, end=time.perf_counter())
    assert em.ops == 2 and em.link_time_s == pytest.approx(0.1)
    assert em.slept_s == slept  # M was not moved behind L: nothing left to wait for


def test_a_call_that_landed_and_left_the_queue_still_holds_its_slot():
    """A, B and C queued; A lands (the head of the queue, it leaves it), then B raises: C is
    booked again behind A's finish, never beside it, and once C lands the queue holds nothing."""
    em = LinkEmulator(Link("slow", 0.04, 0.0))  # 0.05 s a transfer
    with events.listen(em):
        a, b, c = _issue(), _issue(), _issue()
        a_finish = em.free_at - 0.1
        events.emit(events.COMM_DONE, **a, end=time.perf_counter())
        events.emit(events.COMM_FAILED, **b, error="RuntimeError: gone")
        assert em.ops == 2 and em.free_at == pytest.approx(a_finish + 0.05, abs=_CLOCK)
        events.emit(events.COMM_DONE, **c, end=time.perf_counter())
    assert not em._queue  # bookings that landed are history: the queue keeps none
