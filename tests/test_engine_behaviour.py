"""State dicts, buffers and the errors that bad input must give (never a hang)."""

from __future__ import annotations

import subprocess
import sys

import behaviour_workers
import pytest
import torch
from support import slowdown

from shardlab.engine.api import MixedPrecision
from shardlab.launch import run_ranks


def test_full_state_dict_round_trip_is_bit_exact():
    configs = [dict(stage=s) for s in range(4)] + [dict(stage=s, mixed_precision=torch.bfloat16) for s in (0, 3)]
    results = run_ranks(behaviour_workers.round_trip, 3, configs, timeout=slowdown(120))
    names = behaviour_workers.make_model("gpt", 0).state_dict().keys()
    for per_rank in results:
        for cfg, (saved, reloaded, same_output) in zip(configs, per_rank):
            assert list(saved) == list(names), "original names, in the original order"
            assert all(torch.equal(saved[k], reloaded[k]) for k in saved), cfg
            assert same_output, cfg


def test_buffers_start_from_rank0():
    scales = run_ranks(behaviour_workers.buffers_from_rank0, 3)
    assert all(torch.equal(s, torch.zeros(3)) for s in scales)


def test_bad_input_gives_clear_errors_on_every_rank():
    per_rank = run_ranks(behaviour_workers.bad_inputs, 2, timeout=slowdown(60))
    for errors in per_rank:
        expect = {
            "stage 5": ("ValueError", "stage must be 0"),
            "not a module": ("TypeError", "nn.Module"),
            "already wrapped": ("ValueError", "already parallelized"),
            "empty model": ("ValueError", "no trainable parameters"),
            "optimizer not a class": ("TypeError", "optimizer_cls"),
            "tied across units": ("ValueError", "blocks.0.0.weight"),
            "different models": ("ValueError", "ranks hold different models"),
            "state dict of a plain model": ("TypeError", "shardlab.parallelize"),
            "missing key": ("KeyError", "head.bias"),
            "units of a wrong type": ("TypeError", "units must be"),
            "stage-3 option at stage 1": ("ValueError", "apply to stage 3 only"),
            "units out of order at stage 3": ("RuntimeError", "in registration order"),
        }
        for case, (kind, words) in expect.items():
            got_kind, message = errors[case]
            assert got_kind == kind and words in message, (case, errors[case])


def test_no_process_group_is_a_clear_error():
    code = "import torch, shardlab; shardlab.parallelize(torch.nn.Linear(2, 2))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=slowdown(60))
    assert done.returncode != 0
    assert "no process group" in done.stderr and "init_process_group" in done.stderr


def test_a_second_backward_on_one_graph_is_reduced_too():
    """loss.backward(retain_graph=True); loss.backward() must equal (2 * loss).backward()."""
    stages = [0, 1, 2, 3]
    for per_rank in run_ranks(behaviour_workers.second_backward_on_one_graph, 2, stages, timeout=slowdown(120)):
        for stage, (twice, doubled) in zip(stages, per_rank):
            assert all(torch.allclose(twice[k], doubled[k], atol=1e-6) for k in twice), stage


def test_clip_scales_what_the_optimizer_steps():
    """Every precision setting: after clipping, the masters' gradient norm is the max norm."""
    bf16_everywhere = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    configs = [dict(stage=s, mixed_precision=mp) for s in range(4)
               for mp in (None, torch.bfloat16, bf16_everywhere)]
    for per_rank in run_ranks(behaviour_workers.clipped_master_norms, 2, configs, timeout=slowdown(120)):
        for cfg, (before, after) in zip(configs, per_rank):
            assert before > 1e-2, cfg  # the clip bites
            assert after == pytest.approx(1e-3, rel=1e-2), cfg
