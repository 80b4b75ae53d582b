"""The install's choice of PyTorch build (scripts/install_torch.py): the decision, not the download."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from support import slowdown

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("install_torch", ROOT / "scripts" / "install_torch.py")
install_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install_torch)
choose = install_torch.choose


def _never():
    raise AssertionError("the CPU index must only be probed when the CPU build is the choice")


def test_an_installed_torch_is_left_alone():
    index, line = choose(installed="2.13.0+cpu", override="", platform="linux", gpu=False, cpu_index_up=_never, installed_cuda=None)
    assert index is None and line == "torch 2.13.0+cpu is already installed: leaving it alone"


def test_linux_without_a_gpu_gets_the_cpu_build():
    index, line = choose(installed=None, override="", platform="linux", gpu=False, cpu_index_up=lambda: True, installed_cuda=None)
    assert index == ["--index-url", "https://download.pytorch.org/whl/cpu"]
    assert "no NVIDIA GPU" in line and "CPU build" in line and "\n" not in line


def test_an_unreachable_cpu_index_falls_back_to_the_default():
    index, line = choose(installed=None, override="", platform="linux", gpu=False, cpu_index_up=lambda: False, installed_cuda=None)
    assert index == [] and "unreachable" in line and "default index" in line


def test_a_gpu_or_another_os_gets_the_default_index():
    for platform, gpu in (("linux", True), ("darwin", False), ("win32", False)):
        index, line = choose(installed=None, override="", platform=platform, gpu=gpu, cpu_index_up=_never, installed_cuda=None)
        assert index == [], (platform, gpu)
        assert "default" in line


def test_torch_index_wins_over_detection():
    index, line = choose(installed=None, override="--index-url=https://example.org/simple", platform="linux",
                         gpu=False, cpu_index_up=_never, installed_cuda=None)
    assert index == ["--index-url=https://example.org/simple"] and "TORCH_INDEX" in line


@pytest.mark.parametrize(("smi", "devices", "expected"), [
    (None, [], False), ("/usr/bin/nvidia-smi", [], False), (None, ["/dev/nvidia0"], False),
    ("/usr/bin/nvidia-smi", ["/dev/nvidia0"], True)])
def test_a_gpu_needs_both_the_driver_tool_and_a_device(monkeypatch, smi, devices, expected):
    monkeypatch.setattr(install_torch.shutil, "which", lambda name: smi if name == "nvidia-smi" else None)
    monkeypatch.setattr(install_torch.glob, "glob", lambda pattern: devices)
    assert install_torch.nvidia_gpu() is expected


def test_a_cpu_build_on_a_gpu_node_is_replaced_and_a_cuda_build_kept():
    """The environment built on a login node (no GPU: CPU build), then installed on a GPU node."""
    index, line = choose(installed="2.13.0+cpu", override="", platform="linux", gpu=True, cpu_index_up=_never,
                         installed_cuda=None)
    assert index == [] and "CPU build" in line and "replacing it with the CUDA build" in line
    index, line = choose(installed="2.13.0+cu128", override="", platform="linux", gpu=True, cpu_index_up=_never,
                         installed_cuda="12.8")
    assert index is None and "leaving it alone" in line


def test_a_gpu_job_on_cpu_torch_is_refused_with_the_fixing_command():
    refusal = install_torch.refusal
    message = refusal(installed="2.13.0+cpu", cuda=None, gpu=True, home="/shared/shardlab")
    assert "CPU build" in message and "make -C /shared/shardlab install" in message and "srun --gpus" in message
    assert "no torch" in refusal(installed=None, cuda=None, gpu=True, home=".")
    assert refusal(installed="2.13.0+cu128", cuda="12.8", gpu=True, home=".") is None
    assert refusal(installed="2.13.0+cpu", cuda=None, gpu=False, home=".") is None  # a CPU job: fine


def test_check_here_passes_without_a_gpu():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_torch.py"), "--check"],
                          capture_output=True, text=True, timeout=slowdown(60))
    assert done.returncode == 0, done.stderr
    assert "fits this node" in done.stdout


def test_dry_run_here_prints_one_line_and_installs_nothing():
    """This environment has torch: the script says so in one line (as make prints it)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_torch.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=slowdown(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "already installed: leaving it alone" in done.stdout
