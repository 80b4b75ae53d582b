"""The small helpers notebooks 05 and 06 run on the ranks, checked without ranks."""

import pytest
import torch

from shardlab.course import measure
from shardlab.instruments.link import LINKS, link_delay

RECORDS = [dict(kind="all_gather", numel=1000, dtype=torch.float32),
           dict(kind="reduce_scatter", numel=1000, dtype=torch.float32),
           dict(kind="all_reduce", numel=500, dtype=torch.bfloat16)]


def test_predicted_link_time_is_the_ring_model_summed():
    link = LINKS["1GbE"]
    expected = sum(link_delay(r["kind"], r["numel"], r["dtype"], 4, link.bandwidth_gbps, link.latency_us)
                   for r in RECORDS)
    assert measure.predicted_link_s(RECORDS, 4, "1GbE") == pytest.approx(expected)
    custom = measure.predicted_link_s(RECORDS, 4, {"bandwidth_gbps": 2.0})
    assert custom == pytest.approx(sum(link_delay(r["kind"], r["numel"], r["dtype"], 4, 2.0, 0) for r in RECORDS))
    assert measure.predicted_link_s(RECORDS, 4, None) == 0.0
    with pytest.raises(ValueError, match="unknown link"):
        measure.predicted_link_s(RECORDS, 4, "2GbE")


def test_a_step_lasts_as_long_as_its_slowest_rank():
    per_rank = [[1.0, 5.0, 2.0], [2.0, 1.0, 2.5]]
    assert measure.slowest(per_rank) == [2.0, 5.0, 2.5]
    assert measure.slowest_median(per_rank) == 2.5
    baseline = [[0.5, 4.0, 1.0], [1.0, 0.5, 1.0]]  # per round: 1.0, 4.0, 1.0
    assert measure.added_median(per_rank, baseline) == 1.0  # rounds paired: 1.0, 1.0, 1.5
    with pytest.raises(ValueError):
        measure.slowest([[1.0], [1.0, 2.0]])


def test_data_is_this_ranks_rows_of_the_same_global_batches():
    model = measure.models.gpt("tiny")
    batches = measure.data(model, batch_size=2, steps=3, seed=1)
    assert len(batches) == 3 and batches[0][0].shape == (2, model.cfg.seq)
    assert torch.equal(batches[0][0], measure.data(model, 2, 1, seed=1)[0][0])  # the same data every call
    assert not torch.equal(batches[0][0], batches[1][0])


def test_collective_times_reports_the_slowest_rank_through_comm():
    """``comm.all_reduce_max`` gives every rank the largest value and emits no event (it is
    bookkeeping); ``collective_times`` therefore hands every rank the same seconds."""
    from instrument_workers import bookkeeping_collectives
    from support import slowdown

    from shardlab.launch import run_ranks

    per_rank = run_ranks(bookkeeping_collectives, 2, timeout=slowdown(90))
    for r in per_rank:
        assert r["worst"] == [1.0, 0.0] and r["events"] == [] and r["ready"]
        assert [row["kind"] for row in r["rows"]] == ["all_gather", "reduce_scatter", "all_reduce"]
        assert all(row["seconds"] > 0 and row["world_size"] == 2 for row in r["rows"])
    assert per_rank[0]["rows"] == per_rank[1]["rows"]
