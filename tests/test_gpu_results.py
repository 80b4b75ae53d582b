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
    gpu_results.record("bandwidth", model_rows(), command="torchrun gpu_check.py --record",
                       hardware_info=HW, path=path, fit={"all_gather": {"bandwidth_gbps": 800.0, "latency_us": 5.0}})
    mem = [dict(stage=s, rank=0, cuda_rest=1.1e6 * (4 - s), tally_rest=1.05e6 * (4 - s), formula_rest=1e6 * (4 - s),
                cuda_peak=3e6, tally_peak=2.5e6) for s in range(4)]
    gpu_results.record("memory", mem, command="notebooks/06_real_gpus.ipynb", hardware_info=HW, path=path)
    data = json.loads(path.read_text())
    assert [r["kind"] for r in data["runs"]] == ["bandwidth", "memory"]
    assert all(r["date"].endswith("+00:00") and r["hardware"] == HW for r in data["runs"])
    text = gpu_results.text(path)
    assert text.count("recorded ") == 2 and "Test GPU" in text and "gpu_check.py --record" in text
    assert "β = 800 Gbit/s" in text and " 1.10" in text  # the memory ratio column
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


def test_gpu_check_dry_run_on_cpu_records_nothing(tmp_path):
    """The pre-flight runs on gloo without GPUs and refuses to record a CPU run as a GPU result."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU node this would record for real")
    out = tmp_path / "gpu_results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "workshop" / "gpu_check.py"), "--sizes-mb", "1,8", "--iters", "2",
                           "--record", str(out)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK: 2 of 2 ranks answered" in proc.stdout
    assert "all_gather" in proc.stdout and "nothing recorded" in proc.stdout
    assert not out.exists()
