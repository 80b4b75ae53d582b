"""Every stage trains exactly like one process on the global batch, at every world size.

Each test launches one process group and trains several configurations in it, because
starting ranks costs seconds and training the tiny models costs milliseconds.
"""

from __future__ import annotations

import pytest
import torch
import workers
from support import slowdown

from shardlab.launch import run_ranks

FP32_TOL = 1e-5
# bf16 weights and activations keep 8 significant bits. AdamW moves a weight by about lr
# (1e-3) a step whatever the gradient's size, so 3 bf16 steps may drift up to ~2 * 3 * lr from
# the fp32 run. That bound would hide a wrong gradient scale, which SGD does not: with SGD the
# drift is proportional to the gradient error itself, and its bf16 tolerance is tighter.
BF16_TOL = {"adamw": 6e-3, "sgd": 1e-3}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stages_match_single_process(world_size, parity_log):
    configs = [dict(kind=kind, stage=stage, optimizer=opt)
               for kind in ("gpt", "mlp") for opt in ("adamw", "sgd") for stage in range(4)]
    results = run_ranks(workers.train_many, world_size, configs, timeout=slowdown(240))
    for i, cfg in enumerate(configs):
        ref, _ = workers.reference(cfg["kind"], cfg["optimizer"], world_size, steps=3)
        diffs = [max_diff(results[r][i][0], ref) for r in range(world_size)]
        parity_log(f"ws={world_size} {cfg['kind']:4} stage {cfg['stage']} {cfg['optimizer']:5}", max(diffs))
        assert max(diffs) < FP32_TOL, (cfg, diffs)
        # every rank ends with the same full model
        for r in range(1, world_size):
            assert max_diff(results[r][i][0], results[0][i][0]) == 0.0


def test_stage3_variants_and_mixed_precision(parity_log):
    world_size = 3
    configs = [
        dict(stage=3, reshard_after_forward=False),
        dict(stage=3, prefetch=False),
        dict(stage=3, units=torch.nn.Linear),  # smaller units: every Linear on its own
        dict(stage=3, units=workers.no_units),  # one unit: the root holds everything
        dict(kind="gpt-tied", stage=3),  # tied embedding / head in the root unit
        dict(kind="gpt-tied", stage=0),
        dict(kind="gpt-checkpointed", stage=3),  # recompute in backward must not free the unit
        dict(kind="gpt-checkpointed", stage=3, prefetch=False),
        *[dict(stage=s, mixed_precision=torch.bfloat16) for s in range(4)],
        *[dict(stage=s, mixed_precision=torch.bfloat16, optimizer="sgd") for s in (0, 3)],
    ]
    results = run_ranks(workers.train_many, world_size, configs, timeout=slowdown(240))
    for i, cfg in enumerate(configs):
        optimizer = cfg.get("optimizer", "adamw")
        ref, _ = workers.reference(cfg.get("kind", "gpt"), optimizer, world_size, steps=3)
        diff = max(max_diff(results[r][i][0], ref) for r in range(world_size))
        tol = BF16_TOL[optimizer] if "mixed_precision" in cfg else FP32_TOL
        label = {k: getattr(v, "__name__", v) for k, v in cfg.items()}
        parity_log(f"ws=3 gpt  {label}", diff)
        assert diff < tol, (cfg, diff)
    # bf16 really ran in bf16: it must differ from the fp32 result, if only a little
    assert max_diff(results[0][8][0], results[0][0][0]) > 0


def test_frozen_params_and_different_initial_weights():
    """Ranks start from different weights: all must end as if started from rank 0's weights."""
    world_size = 2
    freeze = ("pos", "blocks.0.ln1")
    configs = [dict(stage=s, different_init=True, freeze=freeze, optimizer="sgd") for s in range(4)]
    results = run_ranks(workers.train_many, world_size, configs, timeout=slowdown(120))
    ref, _ = workers.reference("gpt", "sgd", world_size, steps=3, seed=1, freeze=freeze)  # rank 0: seed 0 + 1
    start = workers.make_model("gpt", 1).state_dict()
    for i in range(len(configs)):
        for r in range(world_size):
            state = results[r][i][0]
            assert max_diff(state, ref) < FP32_TOL
            for name in state:
                if name.startswith(freeze):  # frozen: untouched, and rank 0's value everywhere
                    assert torch.equal(state[name], start[name]), name


def test_no_sync_accumulation_equals_one_double_batch():
    world_size = 2
    configs = [dict(stage=s, accumulate=True, optimizer=o) for s in range(4) for o in ("sgd", "adamw")]
    results = run_ranks(workers.train_many, world_size, configs, timeout=slowdown(120))
    for i, cfg in enumerate(configs):
        ref, _ = workers.reference("gpt", cfg["optimizer"], world_size, steps=3)
        assert max_diff(results[0][i][0], ref) < FP32_TOL, cfg


def test_clip_grad_norm_is_the_unsharded_norm():
    world_size = 3
    configs = [dict(kind="mlp", stage=s, optimizer="sgd", clip=0.05) for s in range(4)]
    results = run_ranks(workers.train_many, world_size, configs, timeout=slowdown(120))
    ref, ref_norms = workers.reference("mlp", "sgd", world_size, steps=3, clip=0.05)
    assert min(ref_norms) > 0.05  # the clip really bites
    for i in range(len(configs)):
        for r in range(world_size):
            state, norms = results[r][i]
            assert norms == pytest.approx(ref_norms, rel=1e-5)
            assert max_diff(state, ref) < FP32_TOL
