"""The planner's pieces: presets against their papers, memory by its parts, the ring over nodes,
the scaling it must show, the knee and the anchors' bytes. The replay by hand is in
``test_planner_replay.py``, ``python -m shardlab plan`` in ``test_planner_cli.py``."""

import json

import pytest

from shardlab import planner
from shardlab.instruments import memory_math as mm

GIB = 2**30


@pytest.mark.parametrize("name, published", [
    ("gpt3-175b", 174.6e9),  # Megatron-LM Table 2: 174.6B
    ("megatron-1t", 1008.0e9),  # Megatron-LM Table 1: 1008.0B
    ("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9), ("llama3-405b", 405.85e9),  # Llama 3 model cards
    ("gpt3-125m", 125e6), ("gpt3-13b", 12.85e9),
])
def test_named_models_have_their_published_sizes(name, published):
    assert planner.model(name).params == pytest.approx(published, rel=0.005)


def test_the_course_gpt_counts_as_memory_math_does():
    from shardlab import models
    from shardlab.bench.planner_calibrate import transformer

    for size in ("tiny", "small", "gpt-13m"):
        assert transformer(size).params == mm.gpt_param_count(models.SIZES[size])
        assert transformer(size).params == sum(p.numel() for p in models.gpt(size).parameters())


def test_names_and_bad_inputs():
    assert planner.model("70B") is planner.model("llama3-70b") and planner.gpu("H100").peak_flops == 989e12
    for bad, fn in (("71b", planner.model), ("tpu", planner.gpu), ("wifi", planner.network)):
        with pytest.raises(ValueError, match="choose one of"):
            fn(bad)
    with pytest.raises(ValueError, match="whole nodes"):
        planner.cluster("h100", 12, "ib-ndr")
    with pytest.raises(ValueError, match="checkpointing"):
        planner.Plan("zero3", checkpointing="some")
    with pytest.raises(ValueError, match="must divide"):
        planner.memory(planner.model("8b"), planner.cluster("h100", 16), planner.Plan("hsdp", shard_group=3))
    assert planner.Plan(3).stage == "zero3" and planner.Plan("HSDP").stage == "hsdp"


def test_memory_is_the_sum_of_its_formulas():
    m, c = planner.model("8b"), planner.cluster("h100", 64, "ib-ndr")
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        mem = planner.memory(m, c, planner.Plan(stage, micro_batch=2, checkpointing="selective"))
        assert mem.model_states == mm.model_state_bytes(m.params, 64)[stage]
        assert mem.activations == m.layers * 34 * m.seq * 2 * m.hidden + 4 * m.seq * 2 * m.vocab
        expect = m.root_params * 2 + mm.gathered_unit_bytes(m.block_params, "mixed-adam", include_grad=True)
        assert mem.gathered == (expect if stage == "zero3" else 0)
    hsdp = planner.memory(m, c, planner.Plan("hsdp", shard_group=8))
    assert hsdp.model_states == 16 * m.params / 8  # sharded over the group, not all 64
    assert planner.memory(m, c, planner.Plan("zero3", prefetch=False)).gathered < planner.memory(m, c, planner.Plan("zero3")).gathered


def test_activations_do_not_shrink_with_more_gpus():
    m, plan = planner.model("70b"), planner.Plan("zero3", checkpointing="selective")
    small, big = (planner.memory(m, planner.cluster("h100", n), plan) for n in (64, 1024))
    assert small.activations == big.activations and big.model_states == small.model_states / 16


def test_rings_across_nodes_share_the_nodes_nics():
    c = planner.cluster("a100", 64, "ib-hdr")  # 8 HDR NICs a node: 200 GB/s a node
    whole = planner.groups(c, planner.Plan("zero3"))[0]
    assert whole.bandwidth_gbps == pytest.approx(1600) and whole.latency_us == c.inter.latency_us
    shard, reps = planner.groups(c, planner.Plan("hsdp", shard_group=8))
    assert shard.bandwidth_gbps == c.intra.bandwidth_gbps and shard.size == 8  # inside the node
    assert reps.size == 8 and reps.bandwidth_gbps == pytest.approx(200)  # one GPU's share of the NICs
    eth = planner.cluster("h100", 64, "100gbe")
    assert eth.nics_per_node == 1 and planner.groups(eth, planner.Plan("zero3"))[0].bandwidth_gbps == pytest.approx(100)


def test_zero3_collapses_when_the_link_is_the_limit():
    """Fixed global batch on a slow network: per-GPU traffic stays 3Ψ while compute halves."""
    m = planner.model("175b")
    tflops = [planner.step_time(m, planner.cluster("a100", n, "100gbe"), planner.Plan("zero3", micro_batch=mb, checkpointing="full"))
              .tflops_per_gpu for n, mb in ((384, 4), (768, 2), (1536, 1))]
    assert tflops[1] / tflops[0] == pytest.approx(0.5, abs=0.05) and tflops[2] / tflops[1] == pytest.approx(0.5, abs=0.05)


def test_compute_bound_runs_at_the_fraction_of_peak():
    t = planner.step_time(planner.model("70b"), planner.cluster("h100", 64), planner.Plan("zero3", micro_batch=1, checkpointing="full"))
    assert t.tflops_per_gpu * 1e12 == pytest.approx(planner.ACHIEVABLE_FRACTION * 989e12, rel=0.01)
    model_flops, hardware = planner.step_flops(planner.model("175b"), planner.Plan(micro_batch=1, checkpointing="full"))
    b, s, h, L, V = 1, 2048, 12288, 96, 51200  # Megatron-LM eq. 3, with recompute: 96·B·s·l·h²(1 + s/6h + V/16lh)
    assert hardware == pytest.approx(96 * b * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-3)
    assert model_flops == pytest.approx(72 * b * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)), rel=1e-3)


def test_compare_names_first_fit_and_fastest():
    out = planner.compare(planner.model("70b"), planner.cluster("h100", 64), planner.Plan(checkpointing="full"))
    labels = [p.plan.label for p in out["predictions"]]
    assert labels[0].startswith("DDP") and "HSDP" in labels[3] and labels[-1].startswith("ZeRO-3")
    assert not out["predictions"][0].memory.fits and out["first_fit"].plan.stage == "zero3"
    assert out["fastest"].memory.fits


def test_widget_falls_back_to_the_cli_text(monkeypatch, capsys):
    from shardlab.course import planner_widget

    monkeypatch.setenv("SHARDLAB_NO_WIDGETS", "1")
    planner_widget.show(model="8b", gpus=64, network="100gbe", stage="hsdp", checkpointing="selective")
    out = capsys.readouterr().out
    words, _ = planner_widget.report(model="8b", gpus=64, network="100gbe", stage="hsdp", checkpointing="selective")
    assert "plan: HSDP (shard 8), selective ckpt" in words and words in out  # the CLI's text, whole
    words, fig = planner_widget.report("70b", 64, "h100", "ib-ndr", "zero3", "full")
    mem_ax, time_ax = fig.axes[:2]
    assert len(mem_ax.patches) == 3 * 5 and len(time_ax.patches) == 2 * 5  # 3 kinds, 2 parts, 5 plans
    assert mem_ax.get_ylim()[1] < 1067 and "1,067 GiB" in " ".join(t.get_text() for t in mem_ax.texts)


def test_widget_redraws_on_a_change():
    pytest.importorskip("ipywidgets")
    from shardlab.course import planner_widget

    box = planner_widget.widget(model="70b", gpus=64, checkpointing="none")
    table = box.children[-1]
    assert "DOES NOT FIT" in table.value
    checkpointing = box.children[0].children[1].children[1]
    checkpointing.value = "full"
    assert "fits" in table.value and "DOES NOT FIT" not in table.value


def test_one_table_of_networks_for_the_emulator_and_the_planner():
    from shardlab.instruments.link import LINKS, emulate_link, find_link

    assert find_link("ib-ndr") is find_link("InfiniBand") is LINKS["InfiniBand"]
    with emulate_link("ib-ndr") as em:
        assert em.link.bandwidth_gbps == 400.0
    ten = planner.cluster("h100", 16, "10GbE")
    assert ten.inter is LINKS["10GbE"] and ten.nics_per_node == 1  # Ethernet: one NIC a node
    assert planner.cluster("v100", 8).intra.name == "NVLink 2 (V100)"


def test_fused_attention_is_the_default_and_eager_one_flag_away():
    m, c = planner.model("8b"), planner.cluster("h100", 8)
    fused, eager = (planner.memory(m, c, planner.Plan("zero3", attention=a)) for a in ("fused", "eager"))
    assert fused.fits and not eager.fits  # Llama 3 8B at 8,192 tokens trains on 8 H100s with FSDP
    s, h = m.seq, m.hidden
    assert eager.activations - fused.activations == pytest.approx(m.layers * 5 * m.heads * s * s)  # the s×s term
    assert fused.activations == m.layers * 34 * s * h + 4 * s * m.vocab


@pytest.mark.parametrize("name, published", [
    ("7b", 6.74e9), ("llama2-13b", 13.02e9), ("llama2-70b", 68.98e9),  # Llama 2 model cards: 6.7B, 13B, 70B
    ("gpt3-760m", 760e6), ("gpt3-2.7b", 2.65e9), ("gpt3-6.7b", 6.66e9),  # Brown et al. 2020, Table 2.1
])
def test_more_presets_have_their_published_sizes(name, published):
    assert planner.model(name).params == pytest.approx(published, rel=0.02)


def test_a_shape_and_a_config_json_become_models(tmp_path):
    llama = planner.model("8b")
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 131072, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    from_disk = planner.model(str(path))
    assert from_disk.params == llama.params and from_disk.seq == 8192  # capped: what it trains on, not reads
    from shardlab.planner.transformer import from_shape

    custom = from_shape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192)
    assert custom.params == llama.params
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                                "n_positions": 1024, "vocab_size": 50257}))
    assert planner.model(str(gpt2)).params == pytest.approx(124.4e6, rel=0.001)  # GPT-2 small: 124M


def test_a_config_json_without_a_field_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 10}))
    with pytest.raises(ValueError, match="has no 'num_attention_heads'"):
        planner.model(str(path))


def test_the_knee_is_m_c_over_w_and_the_same_for_ddp_and_zero3():
    """anchors.md §3.7 (a), (b): with bf16 reductions the knee is m·C/W·(N−1)/N for DDP and ZeRO-3."""
    from shardlab.planner.anchors import knee

    node, big = planner.cluster("h100", 8), planner.cluster("a100", 256, "ib-hdr")
    for c, bus in ((node, 450e9), (big, 200e9)):
        n = c.gpus
        want = 0.5 * c.gpu.peak_flops / bus * (n - 1) / n
        for stage in ("ddp", "zero3"):
            assert knee(8192, c, planner.Plan(stage, reduce_dtype="bf16")).tokens == pytest.approx(want)
    fp32 = knee(8192, node, planner.Plan("zero3")).tokens  # fp32 reduce-scatter: (2 + 4) / 4 bytes per FLOP
    assert fp32 == pytest.approx(1.5 * 0.5 * 989e12 / 450e9 * 7 / 8)
    assert knee(8192, node, planner.Plan("zero3")).book == 2200 and knee(8192, big, planner.Plan()).book is None


def test_the_bytes_per_parameter_of_the_anchors():
    from shardlab.planner.anchors import bytes_per_param

    rows = bytes_per_param(gpus=64)
    assert [r.recomputed for r in rows[:4]] == [10, 16, 18, 20] and [r.published for r in rows[:4]] == ["10", "16", "18", "20"]
    assert rows[4].recomputed == pytest.approx(2 + 18 / 64)


def test_reduce_dtype_overlap_param_gather_and_accumulation():
    m, c = planner.model("8b"), planner.cluster("h100", 64)
    fp32, bf16 = (planner.step_time(m, c, planner.Plan("ddp", reduce_dtype=d)) for d in ("fp32", "bf16"))
    alpha = (m.layers + 1) * 2 * 63 * c.inter.latency_us * 1e-6  # each unit's all-reduce: 2(N−1) hops
    assert fp32.link_s - alpha == pytest.approx(2 * (bf16.link_s - alpha))  # twice the bytes, the same hops
    for stage in ("zero1", "zero2"):
        exposed, hidden = (planner.step_time(m, c, planner.Plan(stage, overlap_param_gather=o)) for o in (False, True))
        assert hidden.step_s < exposed.step_s and hidden.link_s == pytest.approx(exposed.link_s)
    z1, z2 = (planner.step_time(m, c, planner.Plan(s, grad_accum=4)) for s in ("zero1", "zero2"))
    assert z2.link_s > 2 * z1.link_s  # ZeRO-2 reduces all 4 micro-batches, ZeRO-1 the last
