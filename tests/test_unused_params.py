"""Issue 13: parameters that get no gradient on some ranks, or on all of them.

Every rank must issue the same collectives in the same order whatever its control flow (else
the ranks drift apart, gloo aborts, or stage 3 hangs), and a parameter no rank used must not
move (its ``grad`` stays None, as with DDP). Each case trains 4 steps at every stage and must
match one process on the concatenated batch at fp32 tolerance, with the ranks' full weights
bit-identical after every step. ``run_ranks``' timeout turns a hang into a failure in minutes
(the process group's own timeout is 0.8 of it, far below torch's default of 30 minutes).
"""

from __future__ import annotations

import pytest
import unused_workers as uw
from support import slowdown

from shardlab.launch import run_ranks

FP32_TOL = 1e-5


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _check(configs, results, world_size, parity_log, label=""):
    for i, cfg in enumerate(configs):
        ref = uw.reference(cfg["case"], cfg["optimizer"], world_size)
        for step, ref_state in enumerate(ref):
            for r in range(1, world_size):  # the ranks never drift apart, not even by one bit
                assert max_diff(results[r][i][step], results[0][i][step]) == 0.0, (cfg, step, r)
            diff = max_diff(results[0][i][step], ref_state)
            assert diff < FP32_TOL, (cfg, step, diff)
        parity_log(f"ws={world_size} {label}{cfg['case']:16} stage {cfg['stage']} {cfg['optimizer']:5}", diff)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameters_match_one_process_and_ranks_agree(world_size, parity_log):
    configs = [dict(case=case, stage=stage, optimizer=opt)
               for case in uw.CASES for stage in range(4) for opt in ("adamw", "sgd")]
    results = run_ranks(uw.train_many, world_size, configs, timeout=slowdown(240))
    _check(configs, results, world_size, parity_log)


def test_unused_parameters_with_your_own_optimizer_at_stage_3(parity_log):
    """The FSDP2 habit, torch.optim.X(model.parameters()), on the same cases: per-parameter
    optimizer state, so a parameter that skips steps keeps its own AdamW step count."""
    configs = [dict(case=case, stage=3, optimizer=opt, own_optimizer=True)
               for case in uw.CASES for opt in ("adamw", "sgd")]
    results = run_ranks(uw.train_many, 2, configs, timeout=slowdown(240))
    _check(configs, results, 2, parity_log, label="own optimizer ")


def test_a_param_back_from_skipped_steps_in_a_shared_unit_matches_adamw(parity_log):
    """Expert 0 is unused by every rank at step 0, then trains. Inside a one-unit MoE block
    (``moe-unit-late``) it shares its unit's flat master, but the optimizer steps one piece per
    parameter, so its AdamW step count (bias correction) is its own, as in one process: no drift,
    and nothing to warn about. (With one step count per unit shard it drifted by 4.8e-4.)"""
    configs = [dict(case=case, stage=stage, optimizer=opt)
               for case in ("moe-unit-late", "moe-late") for stage in range(4) for opt in ("adamw", "sgd")]
    configs.append(dict(case="spare", stage=2, optimizer="adamw"))
    results = run_ranks(uw.train_warned, 2, configs, timeout=slowdown(240))
    for i, cfg in enumerate(configs):
        states = results[0][i][0]
        warned = [m for r in range(2) for m in results[r][i][1]]
        diff = max(max_diff(s, ref) for s, ref in zip(states, uw.reference(cfg["case"], cfg["optimizer"], 2)))
        parity_log(f"ws=2 {cfg['case']:16} stage {cfg['stage']} {cfg['optimizer']:5} warned={bool(warned)}", diff)
        assert diff < FP32_TOL and not warned, (cfg, diff, warned)


def test_sharded_optimizer_leaves_params_without_grad_alone_as_zero_redundancy_does(parity_log):
    """Under DDP a param no rank used keeps ``grad = None``; ZeroRedundancyOptimizer's inner
    optimizer skips it, and so must ShardedOptimizer (AdamW's weight decay used to move it). A
    param back from skipped steps ('odd', AdamW) keeps its own step count, as there."""
    configs = [dict(case=case, system=system, optimizer=opt) for case in ("spare", "odd")
               for system in ("zero_redundancy", "sharded_optimizer") for opt in ("adamw", "sgd")]
    results = run_ranks(uw.train_ddp, 2, configs, timeout=slowdown(240))
    for i, cfg in enumerate(configs):
        states = results[0][i][0]
        for r in range(1, 2):
            assert max_diff(results[r][i][0][-1], states[-1]) == 0.0, cfg
        warned = [m for r in range(2) for m in results[r][i][1]]
        diff = max(max_diff(s, ref) for s, ref in zip(states, uw.reference(cfg["case"], cfg["optimizer"], 2)))
        parity_log(f"ws=2 DDP + {cfg['system']:17} {cfg['case']:5} {cfg['optimizer']:5} warned={bool(warned)}", diff)
        assert diff < FP32_TOL and not warned, (cfg, diff, warned)


def test_a_never_used_parameter_keeps_grad_none_and_its_value():
    per_rank = run_ranks(uw.spare_after_one_step, 2, timeout=slowdown(120))
    for stage_results in per_rank:
        for stage, (grad_is_none, unchanged) in enumerate(stage_results):
            assert unchanged, stage
            if stage in (0, 3):  # the stages whose p.grad is the real gradient
                assert grad_is_none, stage


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_gradient_rounded_to_zero_still_counts_as_used_on_every_rank(world_size):
    """Rank 0 alone gives ``p`` a gradient so tiny that a narrowing cast (the fp16 pack, the
    bf16 master) or the ÷N rounds it to zero with the sign of a "no gradient" ``-0.0``
    (``uw.TINY``; in one backward, or in one of two synced ones). One rank used p, so every
    rank must call it used and step it (AdamW's weight decay moves each element), and the ranks'
    models must stay bit-identical. Before the fix the rank that used p stepped it and the
    others skipped it: stage 0's replicas drifted apart, at stages 1-3 only rank 0's piece of p
    moved, and with p used in the first micro-batch only, no rank stepped it."""
    configs = [dict(case=case, stage=stage) for case in uw.TINY for stage in range(4)]
    results = run_ranks(uw.train_tiny_many, world_size, configs, timeout=slowdown(240))
    for i, cfg in enumerate(configs):
        for r in range(world_size):
            used, before, after = results[r][i]
            assert used, (cfg, r)
            assert (after["p"] != before["p"]).all(), (cfg, r, before["p"], after["p"])
            assert max_diff(after, results[0][i][2]) == 0.0, (cfg, r)
