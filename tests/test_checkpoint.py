"""Sharded checkpoints: resume exactly, reshard to other world sizes and stages, survive a crash.

"Resumed" = a fresh model that loads the checkpoint after step 2 and trains steps 3-4;
"uninterrupted" = the model that was saved and simply kept training. Both see the same global
batch at every world size (checkpoint_workers.GLOBAL_BATCH rows).
"""

from __future__ import annotations

import json

import checkpoint_workers
import pytest
import torch
from support import SLOWDOWN

from shardlab.launch import RankError, run_ranks
from shardlab.models import gpt

FP32_TOL = 1e-5  # as in test_engine_parity: only the order of the gradient sums differs


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bit_exact(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved at 4 ranks, stage 3, after 2 AdamW steps (and the full state dict)."""
    root = tmp_path_factory.mktemp("ckpt")
    path, full_path = root / "ckpt", root / "full.pt"
    results = run_ranks(checkpoint_workers.save_and_resume, 4, str(path), str(full_path), stage=3,
                        timeout=120 * SLOWDOWN)
    return path, full_path, results


def test_resume_is_bit_exact_at_the_same_world_size_and_stage(saved):
    path, full_path, results = saved
    full = torch.load(full_path, weights_only=True)
    for r in results:
        assert bit_exact(r["loaded"], full), "the loaded weights are the saved ones"
        assert bit_exact(r["resumed"], r["uninterrupted"]), "training resumes as if it never stopped"
        assert not bit_exact(r["resumed"], full), "and the two steps after the load changed the weights"
    assert r["files"] == ["metadata.json", "replicated.pt"] + [f"shard-0000{i}-of-00004.pt" for i in range(4)]
    meta = json.loads((path / "metadata.json").read_text())
    assert (meta["world_size"], meta["stage"], meta["step"]) == (4, 3, 2.0)
    assert meta["optimizer"]["cls"] == "torch.optim.adamw.AdamW"
    assert meta["optimizer"]["param_groups"][0]["lr"] == 1e-3
    for unit in meta["units"]:
        assert unit["padded_numel"] == 4 * unit["shard_numel"] == unit["numel"] + unit["padding"]
        assert sorted(unit["state_tensors"]) == ["exp_avg", "exp_avg_sq"]
    names = [p["name"] for u in meta["units"] for p in u["params"]]
    assert sorted(names) == sorted(n for n, p in gpt("tiny").named_parameters())


def test_each_rank_writes_only_its_shard(saved):
    path, _, _ = saved
    meta = json.loads((path / "metadata.json").read_text())
    for rank in range(4):
        shard = torch.load(path / f"shard-0000{rank}-of-00004.pt", weights_only=True)
        for unit in meta["units"]:
            saved_unit = shard["units"][unit["name"]]
            assert saved_unit["weights"].shape == (unit["shard_numel"],)
            assert all(t.shape == (unit["shard_numel"],) for t in saved_unit["state"].values())


@pytest.mark.parametrize("world_size, configs", [
    (2, [dict(stage=2), dict(stage=0), dict(stage=2, mixed_precision=torch.bfloat16)]),
    (3, [dict(stage=3), dict(stage=1), dict(stage=3, units=torch.nn.Linear),
         dict(stage=3, mixed_precision=torch.bfloat16)]),
])
def test_reshard_to_other_world_sizes_and_stages(saved, world_size, configs, parity_log):
    """Save at 4 ranks stage 3, load at 2 or 3 ranks (3 needs other padding), any stage, any unit split."""
    path, full_path, results = saved
    full, uninterrupted = torch.load(full_path, weights_only=True), results[0]["uninterrupted"]
    per_rank = run_ranks(checkpoint_workers.load_and_continue, world_size, str(path), str(full_path), configs,
                         timeout=120 * SLOWDOWN)
    for i, cfg in enumerate(configs):
        for r in range(world_size):
            assert bit_exact(per_rank[r][i]["loaded"], full), (cfg, "loading moves data, it computes nothing")
            assert per_rank[r][i]["same_output"], (cfg, "forward computes with the loaded weights")
        if "mixed_precision" in cfg:
            continue  # bf16 steps differ from fp32 ones; the exact load above is what is checked
        diff = max(max_diff(per_rank[r][i]["resumed"], uninterrupted) for r in range(world_size))
        parity_log(f"checkpoint 4 ranks stage 3 -> {world_size} ranks {cfg}", diff)
        assert diff < FP32_TOL, (cfg, diff)


def test_stage0_sgd_momentum_and_frozen_params_resume_bit_exact(tmp_path):
    """The fresh model's frozen embedding differs too: rank 0 saved it once, every rank loads it."""
    results = run_ranks(checkpoint_workers.save_and_resume, 2, str(tmp_path / "c"), str(tmp_path / "f.pt"),
                        optimizer="sgd", freeze=("pos",), stage=0, timeout=120 * SLOWDOWN)
    full = torch.load(tmp_path / "f.pt", weights_only=True)
    for r in results:
        assert bit_exact(r["loaded"], full)
        assert bit_exact(r["resumed"], r["uninterrupted"])
        assert r["meta"]["units"][0]["state_tensors"] == {"momentum_buffer": "float32"}
        assert list(r["meta"]["replicated"]) == ["pos.weight"]


def test_full_checkpoint_loads_into_a_plain_model(saved):
    _, full_path, results = saved
    plain = gpt("tiny")
    plain.load_state_dict(torch.load(full_path, weights_only=True))  # strict: every key, every shape
    with torch.no_grad():
        logits = plain(results[0]["x"])
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    path, full_dir = tmp_path / "ckpt", tmp_path / "full"
    full_dir.mkdir()
    with pytest.raises(RankError) as info:
        run_ranks(checkpoint_workers.crash_mid_save, 2, str(path), str(full_dir), timeout=60 * SLOWDOWN)
    assert "exit code 3" in str(info.value)
    assert any(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir()), "the half-written save"
    results = run_ranks(checkpoint_workers.load_then_save, 2, str(path), timeout=60 * SLOWDOWN)
    step1, step2 = (torch.load(full_dir / f"step{i}.pt", weights_only=True) for i in (1, 2))
    for loaded, trained, step in results:
        assert step == 1.0 and bit_exact(loaded, step1), "the previous checkpoint, intact"
        assert bit_exact(trained, step2), "a fresh process group resumes bit for bit"
    # the save that followed replaced the checkpoint and swept the crashed save's leftovers away
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "full"]
    assert json.loads((path / "metadata.json").read_text())["step"] == 2.0


def test_bad_input_gives_clear_errors_on_every_rank(tmp_path):
    per_rank = run_ranks(checkpoint_workers.bad_inputs, 2, str(tmp_path), timeout=90 * SLOWDOWN)
    expect = {
        "no such path": ("CheckpointError", "failed on ranks 0, 1: checkpoint", "nowhere does not exist"),
        "missing shard": ("CheckpointError", "missing shard-00001-of-00002.pt"),
        "truncated shard": ("CheckpointError", "shard-00000-of-00002.pt has 100 bytes"),
        "corrupt shard, one rank": ("CheckpointError", "on rank 1: cannot read"),
        "not a checkpoint": ("CheckpointError", "metadata.json is missing"),
        "different model": ("CheckpointError", "different model"),
        "different shape": ("CheckpointError", "'blocks.1.fc.weight' has shape (128, 32) in the checkpoint, (130, 32)"),
        "other optimizer": ("CheckpointError", "not of torch.optim.sgd.SGD"),
        "torch optimizer": ("TypeError", "the optimizer that shardlab.parallelize returned"),
        "plain model": ("TypeError", "shardlab.parallelize"),
        "replace a non-checkpoint": ("CheckpointError", "refusing to replace"),
        "weights only, loaded with an optimizer": ("CheckpointError", "load it with optimizer=None"),
    }
    for errors, untouched, weights_only in per_rank:
        assert weights_only, "optimizer=None saves and loads the weights"
        for case, (kind, *words) in expect.items():
            got_kind, message = errors[case]
            assert got_kind == kind and all(w in message for w in words), (case, errors[case])
        assert untouched, "a failed load changes nothing"


def test_each_parameter_keeps_its_own_step_count_and_version_1_still_loads(tmp_path, parity_log):
    """Expert 0 of a one-unit MoE block skipped step 0: its AdamW step count (1) is not its unit's
    (2). The checkpoint (format version 2) keeps it per parameter, so training resumed at other
    stages and another unit split still matches one process. A version-1 checkpoint (one count per
    unit, crafted from the same shard files) still loads: each parameter takes its unit's count."""
    import unused_workers as uw

    configs = [dict(stage=3), dict(stage=0), dict(stage=1, units=None)]  # None: each expert its own unit
    per_rank = run_ranks(checkpoint_workers.moe_steps_survive, 2, str(tmp_path / "ckpt"), configs,
                         timeout=120 * SLOWDOWN)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["version"] == 2 and meta["step"] == 2.0
    saved_steps = {p["name"]: p["state"]["step"]["value"] for u in meta["units"] for p in u["params"]}
    assert {n for n, s in saved_steps.items() if s == 1.0} == {"blocks.1.experts.0.weight", "blocks.1.experts.0.bias"}
    assert set(saved_steps.values()) == {1.0, 2.0}
    one_process = uw.reference("moe-unit-late", "adamw", 2)[-1]
    for i, run in enumerate(per_rank[0]):
        steps = {n: s for r in per_rank for n, s in r[i]["steps"].items()}  # each rank holds some pieces
        assert all(bit_exact(r[i]["loaded"], per_rank[0][i - i % 2]["loaded"]) for r in per_rank), run["cfg"]
        if run["version"] == 2:
            assert steps == saved_steps, run["cfg"]
            diff = max_diff(run["resumed"], one_process)
            parity_log(f"checkpoint moe-unit-late, stage 3 -> {run['cfg']}", diff)
            assert diff < FP32_TOL, (run["cfg"], diff)
        else:
            assert run["meta"]["version"] == 1
            assert steps == dict.fromkeys(saved_steps, 2.0), run["cfg"]  # the MoE unit's count, for expert 0 too
