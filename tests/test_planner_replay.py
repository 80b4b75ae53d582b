"""The step replay by hand: a few units with round numbers of seconds, every booking checked.

Each case's timeline is in its comment; ``shardlab.planner.step.replay`` must give it."""

import pytest

from shardlab import planner
from shardlab.planner.compute import recompute_flops, unit_flops
from shardlab.planner.step import Unit, replay


def _units(fwd=1.0, bwd=2.0, blocks=2):
    return [Unit("root", 10, fwd, bwd)] + [Unit(f"b{i}", 10, fwd, bwd) for i in range(blocks)]


def test_replay_by_hand_zero3_with_prefetch():
    # Every collective 0.5 s, every forward 1 s, every backward 2 s, root + 2 blocks. Forward:
    # gather root 0-0.5, compute 0.5-3.5 with b0, b1 prefetched in time. Backward: head 3.5-5.5
    # with b1's gather 3.5-4 beside it (prefetched during the root's backward, as the engine's
    # lockstep walk does), b1 5.5-7.5, b0 7.5-9.5 (its gather 5.5-6, prefetched), reduce-scatters
    # of b1 7.5-8, b0 9.5-10 and the root 10-10.5 (exposed). Step 10.5 s, compute 9, link busy 4.
    run = replay(_units(), "zero3", 1, True, lambda kind, params: 0.5)
    assert run.compute_s == 9.0 and run.step_s == pytest.approx(10.5) and run.link_s == pytest.approx(4.0)
    assert run.exposed_comm_s == pytest.approx(1.5)


def test_the_first_backward_gather_hides_under_the_heads_backward():
    # Code review M2: a gather as long as the root's backward (2 s) hides under it entirely.
    # Exposed is only the first forward gather (2 s) and what follows the last backward.
    gather_only = lambda kind, params: 2.0 if kind == "all_gather" else 0.0  # noqa: E731
    run = replay(_units(fwd=3.0), "zero3", 1, True, gather_only)
    # forward: root gather 0-2, then compute 2-11 (prefetches 2-4, 4-6 hide); backward: head
    # 11-13 with b1's gather 11-13, b1 13-15 with b0's gather 13-15, b0 15-17
    assert run.step_s == pytest.approx(17.0) and run.exposed_comm_s == pytest.approx(2.0)


def test_the_last_reduction_cannot_hide():
    # Nothing computes after the last block's backward (the replay books the head's and the
    # embedding's backward first, the root's gradient completes at the end), so the last block's
    # reduction and the root's are exposed whole, however long the backward was: 2r, for any r.
    for r in (0.25, 0.5, 1.0):
        cost = lambda kind, params, r=r: 0.0 if kind == "all_gather" else r  # noqa: E731
        for stage in ("ddp", "zero2", "zero3"):
            run = replay(_units(bwd=4.0), stage, 1, True, cost)
            assert run.exposed_comm_s == pytest.approx(2 * r), (stage, r)


def test_overlap_efficiency_charges_each_hidden_second():
    half = lambda kind, params: 0.5  # noqa: E731
    perfect = replay(_units(), "zero3", 1, True, half)
    slowed = replay(_units(), "zero3", 1, True, half, overlap_efficiency=0.8)
    hidden = perfect.link_s - perfect.exposed_comm_s  # 4 s on the link, 1.5 of them exposed
    assert slowed.step_s == pytest.approx(perfect.step_s + 0.2 * hidden)
    assert slowed.contention_s == pytest.approx(0.2 * hidden) and slowed.exposed_comm_s == pytest.approx(1.5)
    assert replay(_units(), "zero3", 1, True, lambda k, p: 0.0, overlap_efficiency=0.5).step_s == 9.0


def test_replay_limits():
    fast = lambda kind, params: 0.0  # noqa: E731
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        assert replay(_units(), stage, 2, True, fast).step_s == pytest.approx(18.0)  # compute only
    slow = replay(_units(), "zero3", 1, False, lambda kind, params: 0.5)
    hidden = replay(_units(), "zero3", 1, True, lambda kind, params: 0.5)
    assert slow.step_s > hidden.step_s  # prefetch hides gathers
    ddp = replay(_units(), "ddp", 4, True, lambda kind, params: 0.5)
    assert ddp.link_s == pytest.approx(1.5)  # all-reduces only on the last of 4 micro-batches
    zero2 = replay(_units(), "zero2", 4, True, lambda kind, params: 0.5)
    assert zero2.link_s == pytest.approx(4 * 1.5 + 1.5)  # reduce-scatter every micro-batch, then gather


def test_contention_is_its_own_field_and_counts_each_compute_second_once():
    # Code review round 3 L3. HSDP: 3 blocks, forward 1 s and backward 2 s a unit, gathers free,
    # reduce-scatters 1 s on the sharding group's link, all-reduces across replicas 1.5 s on the
    # network. Forward 0-4, head 4-6, b2 6-8, b1 8-10, b0 10-12. Link: b2 8-9, b1 10-11, b0 12-13,
    # root 13-14; network: b2 9-10.5, b1 11-12.5, b0 13-14.5, root 14.5-16. Some transfer runs beside
    # all of 8-12, 4 s of compute, though the two links carried 10 s, 6 of them before t = 12.
    cost = lambda kind, params: 0.0 if kind == "all_gather" else 1.0  # noqa: E731
    run = replay(_units(blocks=3), "zero3", 1, True, cost, lambda params: 1.5, overlap_efficiency=0.5)
    assert run.link_s == pytest.approx(10.0) and run.compute_s == pytest.approx(12.0)
    assert run.contention_s == pytest.approx(0.5 * 4) and run.step_s == pytest.approx(16.0 + 2.0)
    assert run.exposed_comm_s == pytest.approx(4.0)  # waiting for the links only, the contention apart


def test_a_measured_compute_time_includes_recompute():
    # round 2 L8: the units' seconds add up to compute_s, recompute included
    m, c = planner.model("8b"), planner.cluster("h100", 8)
    for how in ("none", "full"):
        plan = planner.Plan("zero3", checkpointing=how)
        assert planner.step_time(m, c, plan, compute_s=2.0).compute_s == pytest.approx(2.0), how
    assert recompute_flops(m, planner.Plan("zero3", checkpointing="full")) > 0.2 * unit_flops(m, 1)["block"]
