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
    index, line = choose(installed="2.13.0+cpu", override="", platform="linux", gpu=False, cpu_index_up=_never)
    assert index is None and line == "torch 2.13.0+cpu is already installed: leaving it alone"


def test_linux_without_a_gpu_gets_the_cpu_build():
    index, line = choose(installed=None, override="", platform="linux", gpu=False, cpu_index_up=lambda: True)
    assert index == ["--index-url", "https://download.pytorch.org/whl/cpu"]
    assert "no NVIDIA GPU" in line and "CPU build" in line and "\n" not in line


def test_an_unreachable_cpu_index_falls_back_to_the_default():
    index, line = choose(installed=None, override="", platform="linux", gpu=False, cpu_index_up=lambda: False)
    assert index == [] and "unreachable" in line and "default index" in line


def test_a_gpu_or_another_os_gets_the_default_index():
    for platform, gpu in (("linux", True), ("darwin", False), ("win32", False)):
        index, line = choose(installed=None, override="", platform=platform, gpu=gpu, cpu_index_up=_never)
        assert index == [], (platform, gpu)
        assert "default" in line


def test_torch_index_wins_over_detection():
    index, line = choose(installed=None, override="--index-url=https://example.org/simple", platform="linux",
                         gpu=False, cpu_index_up=_never)
    assert index == ["--index-url=https://example.org/simple"] and "TORCH_INDEX" in line


@pytest.mark.parametrize(("smi", "devices", "expected"), [
    (None, [], False), ("/usr/bin/nvidia-smi", [], False), (None, ["/dev/nvidia0"], False),
    ("/usr/bin/nvidia-smi", ["/dev/nvidia0"], True)])
def test_a_gpu_needs_both_the_driver_tool_and_a_device(monkeypatch, smi, devices, expected):
    monkeypatch.setattr(install_torch.shutil, "which", lambda name: smi if name == "nvidia-smi" else None)
    monkeypatch.setattr(install_torch.glob, "glob", lambda pattern: devices)
    assert install_torch.nvidia_gpu() is expected


def test_dry_run_here_prints_one_line_and_installs_nothing():
    """This environment has torch: the script says so in one line (as make prints it)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_torch.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=slowdown(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "already installed: leaving it alone" in done.stdout
