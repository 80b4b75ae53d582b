"""ShardLab's stage 3 and PyTorch's ``fully_shard`` issue the same collectives per unit, laid out differently.

One step of each on the tiny GPT (2 blocks + the root), recorded at the dispatcher on live
ranks, at a world size that divides every parameter's dim 0 (2) and one that does not (3).
Where they must agree: the units, the all-gathers and reduce-scatters per unit, the dtype,
and the volume up to padding. Where they differ on purpose (torch 2.13's source says why, see
``shardlab/instruments/fsdp2.py`` and ``schedule.py``): the padding (one flat buffer against
each parameter's dim 0), the free before the reduce-scatter, the forward prefetch, the reduce
op, and the root's second gather when ``reshard_after_forward=True`` is said explicitly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch_workers
from support import slowdown

from shardlab.engine.flat import padded_numel
from shardlab.instruments.fsdp2 import dim0_padded_numel
from shardlab.instruments.schedule import (
    Schedule,
    differences,
    free_before_reduce_scatter,
    prefetched,
    reductions,
    side_by_side,
)
from shardlab.launch import run_ranks

BLOCKS = ("blocks.0", "blocks.1")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"ws{n}")
def run(request):
    """Every rank's schedules (one run per world size; each test only reads it)."""
    n = request.param
    return n, run_ranks(torch_workers.schedules, n, timeout=slowdown(300))


def count(schedule, unit, kind):
    return len(schedule.calls(unit, kind))


def real(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


# -- where they must agree ----------------------------------------------------------------------
def test_same_units_and_collectives_per_unit(run):
    n, ranks = run
    for r in ranks:
        ours, theirs = r["ours"], r["theirs"]
        assert sorted(ours.units()) == sorted(theirs.units()) == sorted(["root", *BLOCKS])
        for unit in ours.units():
            for kind in ("all_gather", "reduce_scatter"):
                assert count(ours, unit, kind) == count(theirs, unit, kind), (n, unit, kind)
        for unit in BLOCKS:  # gather in forward, gather in backward, reduce-scatter once
            assert (count(ours, unit, "all_gather"), count(ours, unit, "reduce_scatter")) == (2, 1)
        assert (count(ours, "root", "all_gather"), count(ours, "root", "reduce_scatter")) == (1, 1)
        assert {c["kind"] for c in ours.records + theirs.records} == {"all_gather", "reduce_scatter"}
        assert {c["dtype"] for c in ours.records + theirs.records} == {torch.float32}


def test_volume_agrees_up_to_each_layouts_padding(run):
    n, ranks = run
    shapes = ranks[0]["shapes"]
    most = {unit: (n - 1) * sum(math.prod(s[1:]) for s in unit_shapes)  # < N rows of each parameter
            for unit, unit_shapes in shapes.items()}
    for r in ranks:
        ours, theirs = r["ours"], r["theirs"]
        for unit, unit_shapes in shapes.items():
            for c in ours.calls(unit):
                assert 0 <= c["numel"] - real(unit_shapes) < n             # one flat buffer: < N elements
            for c in theirs.calls(unit):
                assert 0 <= c["numel"] - real(unit_shapes) <= most[unit]   # per parameter: < N rows
        unpadded = sum(real(shapes[c["unit"]]) for c in ours.records)
        assert ours.numel() - unpadded < n * len(ours.records)
        assert theirs.numel() - unpadded <= sum(most[c["unit"]] for c in theirs.records)


def test_every_rank_issues_the_same_schedule(run):
    _, ranks = run
    for side in ("ours", "theirs"):
        first = [(c["kind"], c["unit"], c["numel"]) for c in ranks[0][side].records]
        for r in ranks[1:]:
            assert [(c["kind"], c["unit"], c["numel"]) for c in r[side].records] == first, side


# -- where they differ on purpose -----------------------------------------------------------------
def test_layouts_flat_padded_buffer_against_per_parameter_dim0(run):
    n, ranks = run
    shapes = ranks[0]["shapes"]
    for r in ranks:
        for unit, unit_shapes in shapes.items():
            assert {c["numel"] for c in r["ours"].calls(unit)} == {padded_numel(real(unit_shapes), n)}
            assert {c["numel"] for c in r["theirs"].calls(unit)} == {dim0_padded_numel(unit_shapes, n)}
    uneven = any(s[0] % n for unit_shapes in shapes.values() for s in unit_shapes)
    assert uneven == (n == 3)  # the tiny GPT's dims are even: only 3 ranks pad per parameter
    more = ranks[0]["theirs"].numel() > ranks[0]["ours"].numel()
    assert more == uneven


def test_fully_shard_frees_before_its_reduce_scatter(run):
    _, ranks = run
    for r in ranks:
        for unit in BLOCKS:
            assert free_before_reduce_scatter(r["ours"], unit) is False
            assert free_before_reduce_scatter(r["theirs"], unit) is True


def test_prefetch_forward_in_shardlab_backward_in_both(run):
    _, ranks = run
    for r in ranks:
        assert prefetched(r["ours"], "forward") == list(BLOCKS)   # the next block, while one computes
        assert prefetched(r["theirs"], "forward") == []           # CPU, no forward prefetch set
        assert prefetched(r["ours"], "backward") == prefetched(r["theirs"], "backward") == list(reversed(BLOCKS))


def test_reduce_op_sum_and_divide_against_avg(run):
    _, ranks = run
    for r in ranks:
        assert reductions(r["ours"]) == ["float32 SUM"]   # the course's rule: SUM, then divide
        assert reductions(r["theirs"]) == ["float32 AVG"]  # torch 2.13: AVG for fp32 (_get_gradient_divide_factors)


def test_root_is_gathered_once_unless_reshard_is_said_explicitly(run):
    _, ranks = run
    for r in ranks:
        assert count(r["ours"], "root", "all_gather") == count(r["theirs"], "root", "all_gather") == 1
        assert count(r["explicit"], "root", "all_gather") == 2  # the root resharded after forward too


def test_parameters_are_dtensors_sharded_on_dim0(run):
    n, ranks = run
    names = [row["name"] for row in ranks[0]["shards"]]
    for rank, r in enumerate(ranks):
        for row in r["shards"]:
            assert row["type"] == "DTensor" and row["placements"] == ("Shard(dim=0)",), row
            rows = [len(c) for c in torch.arange(row["shape"][0]).chunk(n)] + [0] * n
            assert row["local"] == (rows[rank], *row["shape"][1:]), (rank, row)
    shapes_differ = [name for i, name in enumerate(names) if len({r["shards"][i]["local"] for r in ranks}) > 1]
    assert bool(shapes_differ) == (n == 3), shapes_differ  # uneven shards only where dim 0 does not divide


def test_the_printed_table_and_differences_read_the_records(run):
    n, ranks = run
    r = ranks[0]
    rows = {line.split()[0]: line.split(" | ")[1:] for line in side_by_side(r["ours"], r["theirs"]).splitlines()[3:]}
    for unit in BLOCKS:
        assert f"2×{r['ours'].calls(unit)[0]['numel']:,}" in rows[unit][0]
        assert f"2×{r['theirs'].calls(unit)[0]['numel']:,}" in rows[unit][1]
    named = {what: (a, b) for what, a, b in differences(r["ours"], r["theirs"])}
    assert named["reduce-scatter dtype and op"] == ("float32 SUM", "float32 AVG")
    assert named["backward: free and reduce-scatter"] == ("reduce-scatter, then free", "free, then reduce-scatter")
    with pytest.raises(ValueError, match="world size"):
        side_by_side(r["ours"], Schedule(r["ours"].records, [], n + 1))


def test_a_wire_column_appears_when_records_carry_wire_bytes(run):
    """The printer's contract with the ledger: records with ``wire_bytes`` get a wire column (here the
    ring formula stands in for the measurement; the printer only adds what it is given)."""
    n, ranks = run
    ours, theirs = ranks[0]["ours"], ranks[0]["theirs"]
    assert "wire" not in side_by_side(ours, theirs)
    wired = Schedule([dict(c, wire_bytes=c["ring_bytes"]) for c in ours.records], ours.stream, n)
    assert wired.wire() == sum(c["ring_bytes"] for c in ours.records)
    assert "wire KB" in side_by_side(wired, theirs)


def test_free_order_without_a_backward_mark_is_not_seen():
    """No backward mark for a unit (FSDP2's repeated pre-backward, a record without events): the
    forward's free must not be read as the backward's. Hand-built streams; no ranks."""
    def schedule(stream):
        phases = iter(["forward", "backward", "backward"])
        records = [{"kind": w, "unit": u, "numel": 8, "dtype": torch.float32, "phase": next(phases),
                    "reduce_op": "SUM"} for w, u in stream if w in ("all_gather", "reduce_scatter")]
        return Schedule(records, stream, 2)

    forward = [("all_gather", "blocks.0"), ("forward", "blocks.0"), ("free", "blocks.0")]
    unmarked = schedule([*forward, ("all_gather", "blocks.0"), ("reduce_scatter", "blocks.0"), ("free", "blocks.0")])
    marked = schedule([*forward, ("all_gather", "blocks.0"), ("backward", "blocks.0"),
                       ("reduce_scatter", "blocks.0"), ("free", "blocks.0")])
    assert free_before_reduce_scatter(unmarked, "blocks.0") is None
    assert free_before_reduce_scatter(marked, "blocks.0") is False
    named = {what: (a, b) for what, a, b in differences(unmarked, marked, root="none")}
    assert named["backward: free and reduce-scatter"][0].startswith("not seen for blocks.0")
    assert named["backward: free and reduce-scatter"][1] == "reduce-scatter, then free"
