"""The machinery behind notebook 06's "recorded" GPU table, tested on temporary files.

No GPU result is committed: the file appears only when ``workshop/gpu_check.py --record`` or
notebook 06 runs on a GPU node. Here the rows are made by the ring model itself, so the tests
check the plumbing (record, load, render, the α-β fit), never a claimed measurement.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import slowdown

from shardlab.course import gpu_results
from shardlab.instruments.link import fit_link, link_delay

ROOT = Path(__file__).resolve().parents[1]
HW = {"gpu": "Test GPU", "gpus_per_host": 4, "host": "node-1", "torch": torch.__version__, "nccl": "2.0.0"}


def model_rows(world=4, bandwidth=800.0, latency=5.0):
    """Collective times exactly as the α-β model predicts them (inputs for the plumbing)."""
    return [dict(kind=k, world_size=world, size_bytes=mb * 2**20,
                 seconds=link_delay(k, mb * 2**18, 4, world, bandwidth, latency), busbw_gbs=1.0)
            for k in ("all_gather", "reduce_scatter", "all_reduce") for mb in (1, 16, 64)]


def test_without_a_file_the_notebook_says_nothing_was_recorded(tmp_path):
    assert gpu_results.load(tmp_path / "none.json") is None
    assert gpu_results.text(tmp_path / "none.json") == gpu_results.NOT_YET
    assert "No GPU run has been recorded yet" in gpu_results.NOT_YET


def test_record_writes_hardware_date_command_and_renders_as_recorded(tmp_path):
    path = tmp_path / "recorded" / "gpu_results.json"
    gpu_results.record("bandwidth", model_rows(), command="python workshop/gpu_check.py --record",
                       hardware_info=HW, path=path, fit={"all_gather": {"bandwidth_gbs": 100.0, "latency_us": 5.0}})
    mem = [dict(stage=s, rank=0, cuda_rest=1.1e6 * (4 - s), tally_rest=1.05e6 * (4 - s), formula_rest=1e6 * (4 - s),
                cuda_peak=3e6, tally_peak=2.5e6) for s in range(4)]
    gpu_results.record("memory", mem, command="notebooks/06_real_gpus.ipynb", hardware_info=HW, path=path)
    data = json.loads(path.read_text())
    assert [r["kind"] for r in data["runs"]] == ["bandwidth", "memory"]
    assert all(r["date"].endswith("+00:00") and r["hardware"] == HW for r in data["runs"])
    text = gpu_results.text(path)
    assert text.count("recorded ") == 2 and "Test GPU" in text and "gpu_check.py --record" in text
    assert "β = 100.0 GB/s" in text and "Gbit" not in text and " 1.10" in text  # one unit; the memory ratio
    assert "nccl-tests bus bandwidth" in text
    assert gpu_results.banner(path).startswith("Recorded on a GPU: Test GPU x4")
    gpu_results.record("memory", mem[:1], command="again", hardware_info=HW, path=path)  # replaces its kind
    assert [len(r["rows"]) for r in gpu_results.load(path)["runs"]] == [9, 1]


def test_the_default_path_follows_the_environment_and_the_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_GPU_RESULTS", str(tmp_path / "x.json"))
    assert gpu_results.default_path() == tmp_path / "x.json"
    monkeypatch.delenv("SHARDLAB_GPU_RESULTS")
    monkeypatch.chdir(ROOT / "notebooks")
    assert gpu_results.default_path() == ROOT / "workshop" / "recorded" / "gpu_results.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_a_cpu_run_is_never_recorded(tmp_path):
    with pytest.raises(RuntimeError, match="no CUDA"):
        gpu_results.record("memory", [{"stage": 0}], command="x", path=tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_bad_input_and_a_malformed_file_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown kind"):
        gpu_results.record("speed", [{}], command="x", hardware_info=HW, path=tmp_path / "r.json")
    with pytest.raises(ValueError, match="rows is empty"):
        gpu_results.record("memory", [], command="x", hardware_info=HW, path=tmp_path / "r.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"kind": "memory"}]}))
    with pytest.raises(ValueError, match="lacks"):
        gpu_results.load(bad)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_fit_link_recovers_the_link_behind_the_times(kind):
    rows = [r for r in model_rows(world=8, bandwidth=400.0, latency=7.0) if r["kind"] == kind]
    for r in rows:
        r["seconds"] = link_delay(kind, r["size_bytes"] // 4, 4, 8, 400.0, 7.0)
    fit = fit_link(kind, [r["size_bytes"] for r in rows], [r["seconds"] for r in rows], 8)
    assert fit.bandwidth_gbps == pytest.approx(400.0, rel=1e-6)
    assert fit.latency_us == pytest.approx(7.0, rel=1e-6)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_link(kind, [1, 1], [1.0, 2.0], 8)
    with pytest.raises(ValueError, match="world_size"):
        fit_link(kind, [1, 2], [1.0, 2.0], 1)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_the_fit_read_back_through_the_ring_model_gives_the_times_sum(kind):
    """What notebook 06 used to assert in its bandwidth cell, where it held for any times at all:
    fed back into link_delay, the fitted α and β give the measured times' sum (a least-squares line
    passes through their mean), or more where α was clamped to 0. It fails only if fit_link and
    link_delay disagree (units, ring factors), so it is a test of the code, here."""
    sizes = [2**20, 8 * 2**20, 32 * 2**20]
    cases = {"positive α": [0.004, 0.009, 0.031], "clamped α": [0.0005, 0.012, 0.050]}
    for what, times in cases.items():
        for world in (2, 4, 8):
            fit = fit_link(kind, sizes, times, world)
            assert (fit.latency_us > 0) == (what == "positive α"), (what, fit)
            back = sum(link_delay(kind, s // 4, 4, world, fit.bandwidth_gbps, fit.latency_us) for s in sizes)
            if fit.latency_us > 0:
                assert back == pytest.approx(sum(times), rel=1e-9), (what, world)
            else:
                assert back >= sum(times) * (1 - 1e-12), (what, world)


def _gpu_check(tmp_path, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "workshop" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=slowdown(timeout), env=env, cwd=tmp_path)


def test_gpu_check_dry_run_runs_every_step_but_cuda(tmp_path):
    """The prepared GPU check end to end on CPU ranks: node, bandwidth through comm with the α-β
    fit, the training script at stages 0-3 with loss parity, notebook 00 headless, and a record
    marked as a dry run, which notebook 06's banner does not count as a GPU run.

    Only a GPU shows the rest: NCCL joining and its bus bandwidth, the topology and P2P lines,
    peak CUDA memory against the formula, the notebooks on the cpu:gloo,cuda:nccl group."""
    out = tmp_path / "dry.json"
    proc = _gpu_check(tmp_path, "--dry-run", "--notebooks", "00", "--record", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    text = proc.stdout
    assert "DRY RUN on CPU ranks" in text and "2 of 2 ranks answered an all-reduce" in text
    assert "busbw (GB/s)" in text and "Gbit" not in text
    for stage in range(4):
        assert f"stage {stage}: loss" in text and "NOT EQUAL" not in text
    assert "00_start_here.ipynb: passed" in text and text.rstrip().endswith("OK: every step passed")
    data = gpu_results.load(out)
    assert [r["kind"] for r in data["runs"]] == ["node", "bandwidth", "stages", "notebooks"]
    assert all(r["hardware"]["dry_run"] for r in data["runs"])
    stages = data["runs"][2]["rows"]
    assert [r["stage"] for r in stages] == [0, 1, 2, 3] and all(r["parity"] for r in stages)
    assert all(r["backend"] == "gloo" and r["tokens_per_s"] > 0 for r in stages)
    assert {r["kind"] for r in data["runs"][1]["rows"]} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert gpu_results.gpu_runs(out) == [] and gpu_results.banner(out).startswith("NO GPU RUN HAS BEEN RECORDED")
    assert "DRY RUN on CPU ranks, not a GPU result" in gpu_results.text(out)
    assert not (ROOT / "workshop" / "recorded" / "gpu_results.json").exists()


def test_gpu_check_on_one_rank_skips_bandwidth_and_still_trains(tmp_path):
    """One GPU is the most common machine: no collective to time, the stages still run."""
    proc = _gpu_check(tmp_path, "--dry-run", "--ranks", "1", "--notebooks", "", timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "one rank: a collective needs two" in proc.stdout
    assert proc.stdout.count(": loss ") == 4 and "OK: every step passed" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_check_without_a_gpu_points_to_the_dry_run(tmp_path):
    proc = _gpu_check(tmp_path, "--record", timeout=60)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
