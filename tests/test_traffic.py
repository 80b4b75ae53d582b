"""Measured communication per training step against the ZeRO paper's 2Ψ / 2Ψ / 2Ψ / 3Ψ.

Only one steady-state step is counted (not the start-up broadcasts). Ψ is the padded parameter
count: the collectives move whole padded flat buffers.
"""

from __future__ import annotations

import pytest
import torch
from instrument_workers import measured

import shardlab
from shardlab.engine import events
from shardlab.instruments.traffic import Ledger, ring_bytes, volume

WORLD_SIZES = (2, 3, 4)


def _psi_and_root(m):
    return sum(m["padded"]), m["padded"][m["unit_names"].index("root")]


def _elements(m, phase, kind):
    return m["ledger"].get(phase, {}).get(kind, {}).get("elements", 0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_moves_two_psi(world_size):
    for rank_results in measured(world_size):
        m = rank_results[0]
        psi, _ = _psi_and_root(m)
        assert m["ledger_elements"] == 2 * psi == _elements(m, "backward", "all_reduce")
        assert m["ledger"]["backward"]["all_reduce"]["calls"] == len(m["padded"])  # one per unit


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero1_and_zero2_move_two_psi(world_size, stage):
    """Reduce-scatter the gradients (Ψ), all-gather the updated shards (Ψ). ZeRO-1 and ZeRO-2
    differ only in when the reduce-scatters start (end of backward, or as each unit is ready)."""
    for rank_results in measured(world_size):
        m = rank_results[stage]
        psi, _ = _psi_and_root(m)
        assert _elements(m, "backward", "reduce_scatter") == psi
        assert _elements(m, "step", "all_gather") == psi
        assert m["ledger_elements"] == 2 * psi


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero3_moves_three_psi_less_the_root_kept_for_backward(world_size):
    """All-gather in forward (Ψ), again in backward, reduce-scatter (Ψ): 3Ψ, as in the paper,
    except the root unit, which FSDP keeps gathered from forward to backward (not re-gathered)."""
    for rank_results in measured(world_size):
        m = rank_results[3]
        psi, root = _psi_and_root(m)
        assert _elements(m, "forward", "all_gather") == psi
        assert _elements(m, "backward", "all_gather") == psi - root
        assert _elements(m, "backward", "reduce_scatter") == psi
        assert m["ledger_elements"] == 3 * psi - root


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_collective_goes_through_comm(world_size):
    """Every call that reached the process group during the step was booked by the ledger."""
    for rank_results in measured(world_size):
        for m in rank_results:
            assert sum(m["pg_calls"].values()) == m["ledger_calls"], (m["stage"], m["pg_calls"])


@pytest.mark.parametrize("world_size", (2, 4))
def test_ring_bytes_are_n_minus_1_over_n_of_the_volume(world_size):
    for m in measured(world_size)[0][:4]:
        for kinds in m["ledger"].values():
            for row in kinds.values():
                assert row["ring_bytes"] == pytest.approx((world_size - 1) / world_size * row["elements"] * 4)
                assert row["seconds"] > 0


def _emit(kind, numel, phase, unit="u", world_size=4, dtype=torch.float32):
    fields = dict(kind=kind, numel=numel, dtype=dtype, world_size=world_size, unit=unit, start=1.0, phase=phase)
    events.emit("comm", **fields)
    events.emit("comm_done", **fields, end=1.5)


def test_ledger_books_calls_by_kind_and_phase():
    with shardlab.count_comm() as ledger:
        _emit("all_gather", 100, "forward")
        _emit("all_reduce", 100, "backward", dtype=torch.bfloat16)
        _emit("reduce_scatter", 100, "backward")
    assert ledger.calls() == 3 and ledger.elements() == 400
    assert ledger.elements(kind="all_reduce") == 200 and ledger.elements(phase="forward") == 100
    assert ledger.ring_bytes(kind="all_reduce") == 0.75 * 200 * 2
    assert ledger.seconds() == pytest.approx(1.5)
    assert ledger.as_dict()["backward"]["reduce_scatter"]["calls"] == 1
    assert ledger.summary(params=100)["total"]["psi"] == 4.0
    table = ledger.table(params=100)
    assert "all_reduce" in table and "× Ψ" in table and str(ledger) == ledger.table()
    assert len(ledger.records) == 3 and all("end" in r for r in ledger.records)


def test_a_failed_call_is_taken_off_the_ledger():
    """A call that raises instead of landing (``comm_failed``) is no call: a row it alone made goes."""
    with shardlab.count_comm() as ledger:
        _emit("all_gather", 100, "forward")
        failed = dict(kind="reduce_scatter", numel=100, dtype=torch.float32, world_size=4, unit="u",
                      start=2.0, phase="backward")
        events.emit(events.COMM, **failed)
        events.emit(events.COMM_FAILED, **failed, error="RuntimeError: gone")
    assert ledger.calls() == 1 and ledger.elements() == 100 and len(ledger.records) == 1
    assert ledger.ring_bytes() == ring_bytes("all_gather", 100, 4, 4)
    assert list(ledger.as_dict()) == ["forward"] and "reduce_scatter" not in ledger.table()


class _CountingWire:
    """A wire whose every reading finds 100 more bytes written."""

    def __init__(self):
        self.written = 0

    def read(self) -> int:
        self.written += 100
        return self.written


def test_a_failed_calls_row_stays_while_it_holds_measured_bytes():
    """The bytes a failed call was in flight for were written: its row keeps them (with no call),
    alone or in a reading it shared with another row's call; the ring formula owes nothing."""
    ledger = Ledger(wire=_CountingWire())
    alone = dict(kind="reduce_scatter", numel=100, dtype=torch.float32, world_size=4, unit="u",
                 start=1.0, phase="backward")
    with events.listen(ledger.on_event):
        events.emit(events.COMM, **alone)
        events.emit(events.COMM_FAILED, **alone, error="RuntimeError: gone")  # 100 bytes, its own
    row = ledger.rows[("backward", "reduce_scatter")]
    assert (row["calls"], row["elements"], row["ring_bytes"], row["wire_bytes"]) == (0, 0, 0, 100)

    ledger = Ledger(wire=_CountingWire())
    good = {**alone, "kind": "all_gather", "phase": "forward", "start": 2.0}
    with events.listen(ledger.on_event):
        events.emit(events.COMM, **good)
        events.emit(events.COMM, **alone)
        events.emit(events.COMM_FAILED, **alone, error="RuntimeError: gone")  # 100 bytes, shared
        events.emit(events.COMM_DONE, **good, end=2.5)
    assert ("backward", "reduce_scatter") in ledger.rows and ledger.calls() == 1
    assert ledger.shared == {(("backward", "reduce_scatter"), ("forward", "all_gather")): 100}


def test_ledger_refuses_unknown_names():
    ledger = Ledger()
    with pytest.raises(ValueError, match="field"):
        ledger.total("bananas")
    with pytest.raises(ValueError, match="kind"):
        ledger.calls(kind="all_to_all")
    with pytest.raises(ValueError, match="phase"):
        ledger.calls(phase="warmup")
    with pytest.raises(ValueError, match="collective"):
        volume("send", 10)
    assert ring_bytes("all_gather", 8, 1, 4) == 0  # one rank sends nothing


def test_a_recorded_call_uses_the_ledgers_ring_formula():
    """One ring formula: ``Call.ring_bytes`` is ``traffic.ring_bytes`` (broadcast (N-1)/N, not 1.0)."""
    import torch

    from shardlab.course.labs.watch import traffic
    from shardlab.instruments.collectives import Call
    from shardlab.instruments.traffic import ring_bytes

    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
        call = Call(kind, "op", 1200, 300, torch.float32, 3)
        assert call.ring_bytes == round(ring_bytes(kind, 1200, 3, 4)) == traffic(1200, 4, 3, [kind])
    assert Call("broadcast", "op", 1200, 1200, torch.float32, 3).ring_bytes == 3200  # 2/3 × 1200 × 4
