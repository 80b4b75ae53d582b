"""The formulas of notebook 07 (HSDP, offload, tensor / pipeline / context parallelism) and the
seed's tip as arithmetic (``memory_math.first_fitting_stage``), checked against the sources'
printed numbers and against the limits where two plans must agree."""

import pytest

from shardlab.instruments import memory_math as mm
from shardlab.instruments import parallelism_math as pm
from shardlab.models import GPTConfig

SHAPE = pm.Shape(params=7e9, layers=32, hidden=4096, seq=4096, batch=32)


def test_first_fitting_stage_follows_the_seed_example():
    """7B × 16 B = 112 GB: no stage-0 replica fits 80 GB; ZeRO-1 on 8 GPUs (38.5 GB) does."""
    gb = mm.GB
    assert mm.first_fitting_stage(1e9, 8, 80 * gb) == "ddp"  # 16 GB: stay on DDP
    assert mm.first_fitting_stage(7e9, 8, 80 * gb) == "zero1"  # 28 + 10.5 GB
    assert mm.first_fitting_stage(7e9, 8, 80 * gb, reserve_bytes=45 * gb) == "zero2"  # 14 + 12.25 GB
    assert mm.first_fitting_stage(7e9, 8, 16 * gb) == "zero3"  # 14 GB, the seed's figure
    assert mm.first_fitting_stage(70e9, 8, 80 * gb) is None  # 140 GB even at ZeRO-3


def test_zero3_is_memory_math():
    p = pm.zero3(SHAPE, 8)
    assert p.model_states == mm.model_state_bytes(7e9, 8)["zero3"] == 14e9
    assert p.sent == mm.ring_bytes_per_rank("zero3", 7e9, 8, 2)
    assert p.activations == 16 * 32 * (32 // 8) * 4096 * 4096 * 2


def test_hsdp_limits_and_the_fsdp_papers_cross_host_traffic():
    """G = N is ZeRO-3 with nothing across groups; G = 1 replicates: DDP's 2Ψ(N−1)/N across.
    Across groups each GPU moves the paper's 2M(W−1)/(GW) bytes, M = 2Ψ, W hosts of G GPUs."""
    full = pm.hsdp(SHAPE, 8, 8)
    assert full.model_states == pm.zero3(SHAPE, 8).model_states
    assert full.extra["sent_across_groups"] == 0 and full.sent == pytest.approx(pm.zero3(SHAPE, 8).sent)
    replicated = pm.hsdp(SHAPE, 8, 1)
    assert replicated.model_states == 16 * 7e9
    assert replicated.extra["sent_across_groups"] == pytest.approx(mm.ring_bytes_per_rank("ddp", 7e9, 8, 2))
    hosts, g = 4, 8
    h = pm.hsdp(SHAPE, hosts * g, g)
    m = 2 * 7e9
    assert h.extra["sent_across_groups"] == pytest.approx(2 * m * (hosts - 1) / (g * hosts))
    assert h.extra["sent_across_groups"] < pm.zero3(SHAPE, hosts * g).sent / 10
    with pytest.raises(ValueError, match="must divide"):
        pm.hsdp(SHAPE, 8, 3)


def test_offload_keeps_two_bytes_on_the_gpu_and_moves_four_over_pcie():
    """ZeRO-Offload, single GPU: the 2 + 2 + 12 bytes split as 2 on GPU, 14 on CPU, 4Ψ over PCIe."""
    one = pm.cpu_offload(SHAPE, 1)
    assert one.model_states == 2 * 7e9
    assert one.extra == {"cpu_bytes": 14 * 7e9, "pcie_bytes": 4 * 7e9}
    assert pm.cpu_offload(SHAPE, 8).extra["cpu_bytes"] == 14 * 7e9 / 8


def test_tensor_parallel_activations_at_degree_one_are_the_course_count():
    """At N = 1 the (4 + 12/N) split is the course's 16·b·s·h per block (memory_math)."""
    cfg = GPTConfig(vocab=1000, d=64, n_layer=4, n_head=4, seq=32)
    shape = pm.Shape(params=1e6, layers=cfg.n_layer, hidden=cfg.d, seq=cfg.seq, batch=8)
    assert pm.tensor_parallel(shape, 1, act_bytes=4).activations == mm.activation_bytes(cfg, 8, 4)["blocks"]
    tp = pm.tensor_parallel(SHAPE, 8)
    assert tp.model_states == 16 * 7e9 / 8
    assert tp.activations == 32 * (4 + 12 / 8) * SHAPE.bsh * 2
    assert tp.sent == 8 * 32 * SHAPE.bsh * 7 / 8 * 2  # 4 all-reduces of B·s·h per layer
    with pytest.raises(ValueError, match="hidden"):
        pm.tensor_parallel(SHAPE, 3)


def test_pipeline_first_stage_holds_one_micro_batch_of_the_whole_model():
    pp = pm.pipeline_parallel(SHAPE, 4, micro_batches=8)
    assert pp.activations == 32 * 16 * (SHAPE.bsh // 8) * 2  # L layers of one micro-batch
    assert pp.extra["bubble"] == pytest.approx(3 / 11)
    assert pp.sent == 2 * SHAPE.bsh * 2
    few = pm.pipeline_parallel(SHAPE, 4, micro_batches=2)  # m < N: only m micro-batches in flight
    assert few.activations == 2 * 8 * 16 * (SHAPE.bsh // 2) * 2
    with pytest.raises(ValueError, match="layers"):
        pm.pipeline_parallel(SHAPE, 5, micro_batches=8)


def test_context_parallel_splits_activations_not_weights():
    cp = pm.context_parallel(SHAPE, 8)
    assert cp.activations == pytest.approx(pm.zero3(SHAPE, 1).activations / 8)
    assert cp.model_states == 16 * 7e9  # weights whole: combine with ZeRO to shard them
    assert cp.extra["sent_kv"] == pytest.approx(6 * 32 * SHAPE.bsh * 7 / 8 * 2)
    assert pm.context_parallel(SHAPE, 1).sent == 0


def test_compare_and_table():
    plans = pm.compare(SHAPE, 8)
    assert [p.name.split(" ")[0] for p in plans] == ["ZeRO-3", "HSDP", "ZeRO-2", "tensor", "pipeline", "context"]
    text = pm.table(plans)
    assert "ZeRO-3 / FSDP" in text and text.count("\n") == len(plans) + 1
    on_one = pm.compare(SHAPE, 1)  # one GPU: ZeRO-3 sends nothing, so no multiple of it
    one = pm.table(on_one)
    assert "—" in one and "inf" not in one and one.count("\n") == len(on_one) + 1
    with pytest.raises(ValueError, match="batch"):
        pm.Shape(params=1e9, layers=2, hidden=8, seq=8, batch=0)
