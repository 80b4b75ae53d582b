"""The network model (``--network-model nccl``) against published all-reduce curves (all_reduce_bench.py
and nccl-tests) and scaling runs.

α (seconds per ring hop) is fitted on ONE curve, all_reduce_bench.py on 4 nodes × 8 B200 (32
ranks); the other, nccl-tests on one node of 8 H200, is held out from that fit. What the planner
predicts for it is its own one-node bus (370 GB/s) against the published busbw; with the plateau
read off the curve itself only its shape is checked. η (fraction of the line rate) is two
statements of NCCL's maintainer, not fitted on anything here. The scaling runs are predictions
only; every miss is a strict xfail with its reason (``planner.published_network.WHY``).
"""

import pytest

from shardlab import planner
from shardlab.planner import network_model as nm
from shardlab.planner import published_network as pn
from shardlab.planner.groups import group_link
from shardlab.planner.published import TOLERANCE


def test_the_fit_on_the_32_rank_curve_is_the_constant_in_the_code():
    assert nm.fit_alpha_us() == pytest.approx(nm.ALPHA_US, abs=0.05)


@pytest.mark.parametrize("name, n, points, role", nm.CURVES)
def test_each_curves_shape_within_tolerance_from_8_mib(name, n, points, role):
    # the plateau read off the same curve: where it bends, not how high it goes
    ratios = nm.curve_ratios(n, points, start=nm.VALID_FROM)
    assert len(ratios) >= 10
    for size, ratio in ratios:
        assert abs(ratio - 1) <= TOLERANCE, (name, role, size // nm.MiB, round(ratio, 2))


@pytest.mark.parametrize("name, n, points, role", nm.CURVES)
def test_below_4_mib_the_model_is_pessimistic(name, n, points, role):
    # NCCL's LL / LL128 protocols have a lower latency than the one α: the model under-predicts there
    assert all(ratio < 1 for _, ratio in nm.curve_ratios(n, points) if _ < nm.FIT_FROM)


def test_the_held_out_curve_against_the_planners_own_bus():
    # code review round 3 M3: what the planner prices an 8-GPU NVLink 4 node with, not the curve's
    # own plateau. NCCL ran the curve with NVLS (~480 GB/s busbw at 16 GiB), the planner's ring
    # gets 370, so it under-predicts: 0.77-0.88 of the published busbw from 8 MiB up.
    bus = pn.planner_one_node_bus_gbs()
    assert bus == pytest.approx(450 * nm.NVLINK_EFFICIENCY) == pytest.approx(370)
    ratios = [r for _, r in nm.curve_ratios(8, nm.H200_1_NODE, start=nm.VALID_FROM, plateau_gbs=bus)]
    assert len(ratios) == 12 and all(1 - TOLERANCE <= r < 0.9 for r in ratios), [round(r, 3) for r in ratios]
    assert min(ratios) == pytest.approx(0.77, abs=0.01) and max(ratios) == pytest.approx(0.88, abs=0.01)


def test_the_knee_moves_with_the_ring_and_a_tree_would_miss_the_held_out_curve():
    # half the plateau at N·α·plateau bytes: 4× the ring, 4× the size (the latency grows per hop)
    for n in (8, 32):
        plateau = 400.0
        knee = n * nm.ALPHA_US * 1e-6 * plateau * 1e9
        assert nm.busbw_gbs("all_reduce", knee, n, plateau) == pytest.approx(plateau / 2)
    # fitted as a tree (2·(log2 4 nodes + 7) hops at 32 ranks), α would be 62/18 = 3.4× larger and
    # the held-out curve's shape misses by 1.1-3.1× from 8 to 256 MiB, beyond ±25% below 128 MiB
    # (the range network_model's docstring states)
    tree_alpha = nm.ALPHA_US * 62 / 18
    ratio = {size // nm.MiB: r for size, r in nm.curve_ratios(8, nm.H200_1_NODE, tree_alpha)
             if nm.VALID_FROM <= size <= 256 * nm.MiB}
    assert list(ratio) == [8, 16, 32, 64, 128, 256]
    assert 1 / min(ratio.values()) == pytest.approx(3.1, abs=0.05) and 1 / max(ratio.values()) == pytest.approx(1.1, abs=0.05)
    assert all((r < 1 - TOLERANCE) == (size < 128) for size, r in ratio.items())


def test_bus_bandwidth_rises_to_eta_of_the_line_rate():
    c = planner.cluster("a100", 64, "ib-hdr")
    ideal, nccl = group_link(c, 64, 8), group_link(c, 64, 8, "nccl")
    assert nccl.bandwidth_gbps == pytest.approx(ideal.bandwidth_gbps * nm.NIC_EFFICIENCY)
    assert nccl.latency_us == nm.ALPHA_US
    one_node = group_link(c, 8, 8, "nccl")
    assert one_node.bandwidth_gbps == pytest.approx(c.intra.bandwidth_gbps * nm.NVLINK_EFFICIENCY)
    with pytest.raises(ValueError, match="network model"):
        group_link(c, 64, 8, "perfect")


def test_ddp_buckets_pay_their_latency_and_it_grows_with_the_ring():
    m, plan = planner.model("8b"), planner.Plan("ddp", checkpointing="full")

    def exposed(n, bucket_mb):
        return planner.step_time(m, planner.cluster("h100", n), plan, network="nccl",
                                 bucket_mb=bucket_mb).exposed_comm_s

    assert exposed(256, 25) > exposed(256, 1000) and exposed(256, 25) > 10 * exposed(8, 25)
    with pytest.raises(ValueError, match="bucket_mb"):
        exposed(8, 0)
    with pytest.raises(ValueError, match="overlap_efficiency"):
        planner.step_time(m, planner.cluster("h100", 8), plan, network="nccl", overlap_efficiency=0)


_ROWS = {r.case: r for r in pn.scaling_rows()}
_MISSES = {case for case, r in _ROWS.items() if r.why and ("768" in case or "1536" in case or "(roofline)" in case)}


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=_ROWS[case].why)) if case in _MISSES else case
    for case in _ROWS])
def test_scaling_runs_per_gpu_and_their_ratio(case):
    r = _ROWS[case]
    print(f"\n{case}: published {r.published:.4g}, predicted {r.predicted:.4g}, ratio {r.ratio:.3f}")
    assert abs(r.ratio - 1) <= r.tolerance


def test_bus_rows_fitted_and_held_out_are_labelled():
    rows = pn.bus_rows()
    assert {r.kind for r in rows} == {"calibration", "prediction", "shape"} and all(r.within for r in rows)
    predicted = [r for r in rows if r.kind == "prediction"]
    assert len(predicted) == len(pn.SHOWN) and all("H200" in r.case and "planner's bus" in r.case for r in predicted)
    assert all(r.ratio < 0.9 for r in predicted)  # NVLS beats the ring the planner prices
    assert all("plateau read from the curve" in r.case for r in rows if r.kind != "prediction")


def test_published_figures_carry_their_source():
    # round 2 L10: a published figure is cited as published, and a formula's value stays plain
    from shardlab.instruments.measured import kind_of
    from shardlab.planner import anchors
    from shardlab.planner import published as pub

    figures = [pub.MEGATRON[384][1], pub.FSDP[1], pub.TORCHTITAN[8], pub.TORCHTITAN_H100[8],
               pub.TORCHTITAN_A100[0][3], anchors.BOOK_KNEE_H100["inside a node"], nm.B200_4_NODES[0][1],
               nm.H200_1_NODE[-1][1], nm.NIC_PEAK_GBS, nm.NVLINK_EFFECTIVE_GBS]
    assert {kind_of(x) for x in figures} == {"published"} and all(x.source for x in figures)
    assert kind_of(nm.NIC_EFFICIENCY) == kind_of(pub.megatron_tflops(384)) == "plain"
    assert {kind_of(r.predicted) for r in pn.bus_rows() + pub.rows()} == {"plain"}
