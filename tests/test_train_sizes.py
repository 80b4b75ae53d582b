"""`python -m shardlab train` at the sizes where sharding matters, checked on CPU.

What CPU can show: the sizes' parameter counts, the formula the trainer prints beside CUDA's
peak, that out of memory ends in one line naming the stage, its bytes by the formula and the
stage that would fit (the error is raised by a mock: a CPU has no CUDA allocator to exhaust),
and the run's summary (tokens/s, TFLOPS) for workshop/gpu_check.py. What only a GPU can show:
the peak CUDA memory itself, gpt-7b really not fitting at stage 0 on 80 GB and fitting at
stage 3, and real TFLOPS; `workshop/gpu_check.py --record` runs the stages on the first GPU node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import slowdown
from shardlab import models, train
from shardlab.instruments import memory_math

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_the_large_sizes_make_the_reference_example_real():
    psi = memory_math.gpt_param_count(models.SIZES["gpt-7b"])
    assert 6.5e9 < psi < 7e9 and 0.95e9 < memory_math.gpt_param_count(models.SIZES["gpt-1b"]) < 1.1e9
    states = memory_math.model_state_bytes(psi, 8)  # the paper's 16 bytes per parameter
    assert states["ddp"] > 80e9 > states["zero3"]  # ~107 GB at stage 0, ~13 GB per GPU at stage 3
    args = train.parse_args(["--model", "gpt-7b", "--bf16", "--checkpoint", "--batch-size", "1", "--stage", "3"])
    f = train.formula(args, 8)
    assert f["states"] == pytest.approx(18 * psi / 8)  # this engine: 2 + 4 + 12 bytes, all sharded
    assert f["states"] + f["activations"] < 80e9 < f["states_by_stage"]["ddp"]


def test_out_of_memory_is_a_one_line_lesson_with_the_stage_that_fits():
    args = train.parse_args(["--model", "gpt-7b", "--bf16", "--batch-size", "1", "--stage", "0"])
    line = train.oom_lesson(args, 8, 80e9)
    assert "\n" not in line
    assert line.startswith("out of memory at stage 0 (DDP) on a 80 GB device: by the formula it needs 120.8 GB")
    assert "stage 1 (ZeRO-1) would fit" in line and "--stage 1" in line
    big = train.parse_args(["--model", "gpt-7b", "--bf16", "--batch-size", "16", "--stage", "3"])
    assert "no stage fits by the formula" in train.oom_lesson(big, 8, 80e9)  # 16 x 1024 tokens of activations
    assert "--checkpoint" in train.oom_lesson(big, 8, 80e9)


def test_an_out_of_memory_run_ends_with_the_lesson_not_a_traceback(tmp_path):
    """torch.OutOfMemoryError raised inside a real (CPU, world of one) training step."""
    code = textwrap.dedent("""
        import sys, torch
        from shardlab import models, train
        def full(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        models.lm_loss = full
        sys.exit(train.main(["--size", "small", "--stage", "0", "--steps", "2", "--gpu-memory-gb", "0.001",
                             "--json", sys.argv[1]]))
        """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.json")], env=_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=slowdown(120))
    assert out.returncode == 3, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("[rank 0] out of memory at stage 0 (DDP) on a 0 GB device: by the formula")
    assert json.loads((tmp_path / "s.json").read_text())["oom"] in lines[0]


def test_the_summary_has_throughput_and_the_formula(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shardlab", "train", "--model", "tiny", "--stage", "3",
                          "--steps", "3", "--checkpoint", "--json", str(tmp_path / "s.json")],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=slowdown(120))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[rank 0] cpu, gloo for CPU tensors" in out.stdout and "activation checkpointing" in out.stdout
    assert "tokens/s" in out.stdout and "model TFLOPS per rank" in out.stdout
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["tokens_per_s"] > 0 and s["tflops_per_gpu"] > 0 and s["peak_bytes"] == [None]
    cfg = models.SIZES["tiny"]
    assert s["tokens_per_s"] == pytest.approx(16 * cfg.seq / s["step_s"])
    assert s["formula_activations"] == memory_math.activation_bytes(cfg, 16, 4, checkpoint=True)["total"]
    assert len(s["losses"]) == 3 and s["checkpoint"] is True
