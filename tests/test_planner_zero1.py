"""The planner's ZeRO-1 is the engine's: it reduces after the whole backward, never as gradients
become ready (``stages.Stage.reduce_as_ready``, held to the engine by test_stages_table.py), so
its reduction cannot hide under backward and it has no knee."""

import math

import pytest

from shardlab import planner
from shardlab.instruments import stages
from shardlab.planner.anchors import knee
from shardlab.planner.report import assumptions
from shardlab.planner.step import Unit, replay


def _units(fwd=1.0, bwd=2.0, blocks=2):
    return [Unit("root", 10, fwd, bwd)] + [Unit(f"b{i}", 10, fwd, bwd) for i in range(blocks)]


def test_the_planner_reads_the_stage_table_for_when_to_reduce():
    assert not stages.stage("zero1").reduce_as_ready and stages.stage("zero2").reduce_as_ready


def test_replay_by_hand_zero1_reduces_after_the_backward():
    # Every collective 0.5 s, forward 1 s, backward 2 s, root + 2 blocks, no gathers before the
    # step. Forward 0-3; backward: head 3-5, b1 5-7, b0 7-9. ZeRO-1: reduce-scatters of b1, b0,
    # root 9-10.5 (all exposed), then the updated parameters' all-gathers 10.5-12: step 12 s.
    # ZeRO-2 issues b1's at 7 (7-7.5, hidden under b0), b0's and the root's at 9 (9-10): step 11.5 s.
    cost = lambda kind, params: 0.5  # noqa: E731
    z1, z2 = (replay(_units(), s, 1, True, cost) for s in ("zero1", "zero2"))
    assert z1.step_s == pytest.approx(12.0) and z1.exposed_comm_s == pytest.approx(3.0)
    assert z2.step_s == pytest.approx(11.5) and z2.exposed_comm_s == pytest.approx(2.5)
    assert z1.link_s == pytest.approx(z2.link_s)  # the same bytes, later


def test_zero1_exposes_more_than_zero2_on_a_real_model():
    m, c = planner.model("8b"), planner.cluster("h100", 64)
    z1, z2 = (planner.step_time(m, c, planner.Plan(s)) for s in ("zero1", "zero2"))
    assert z1.link_s == pytest.approx(z2.link_s) and z1.exposed_comm_s > z2.exposed_comm_s


def test_zero1_has_no_knee_and_says_why():
    c = planner.cluster("h100", 64)
    z1, z2 = (knee(4096, c, planner.Plan(s)) for s in ("zero1", "zero2"))
    assert math.isinf(z1.tokens) and not z1.hides and "after the whole backward" in z1.formula
    assert math.isfinite(z2.tokens) and knee(10**9, c, planner.Plan("zero2")).hides
    rows = {what: value for what, value, _ in assumptions(planner.Plan("zero1"))}
    assert "cannot hide" in rows["gradient reduction"]
    assert "as each unit" in dict((w, v) for w, v, _ in assumptions(planner.Plan("zero2")))["gradient reduction"]
