"""Install PyTorch into this environment, choosing the small CPU build when there is no NVIDIA GPU.

Run by ``make lab`` / ``make test`` before the package itself, so that the package's
``torch>=2.9`` is already met. On Linux, plain ``pip install torch`` fetches the CUDA build
(about 20 ``nvidia-*`` packages, several GB) even on a laptop without a GPU, so::

    torch already importable            -> leave it alone (whatever build it is)
    TORCH_INDEX given (pip arguments)   -> use them as given
    Linux, no nvidia-smi or no /dev/nvidia*
      and the CPU index answers         -> the CPU build from download.pytorch.org/whl/cpu
    otherwise                           -> the default index (CUDA on Linux with a GPU; macOS
                                           and Windows wheels there are CPU/MPS builds anyway)

It prints one line saying what it chose. ``--dry-run`` prints the line and installs nothing.
The decision is :func:`choose`, a pure function (tests/test_install_torch.py checks it).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import shlex
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def nvidia_gpu() -> bool:
    """An NVIDIA GPU is usable here: the driver's tool and its device files are both present."""
    return shutil.which("nvidia-smi") is not None and bool(glob.glob("/dev/nvidia[0-9]*"))


def reachable(url: str, timeout: float = 5.0) -> bool:
    """The package index answers (honours the same proxy variables as pip)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except Exception:  # noqa: BLE001 - any failure means: do not rely on it
        return False


def choose(*, installed: str | None, override: str, platform: str, gpu: bool,
           cpu_index_up) -> tuple[list[str] | None, str]:
    """(pip arguments for the index, or None to install nothing; the one line to print).

    ``cpu_index_up`` is a callable, asked only when the CPU build is the choice.
    """
    if installed:
        return None, f"torch {installed} is already installed: leaving it alone"
    if override.strip():
        return shlex.split(override), f"torch: installing with TORCH_INDEX={override.strip()}"
    if not platform.startswith("linux"):
        return [], f"torch: installing the default build from PyPI ({platform} wheels there carry no CUDA)"
    if gpu:
        return [], "torch: NVIDIA GPU found, installing the default (CUDA) build from PyPI"
    if cpu_index_up():
        return ["--index-url", CPU_INDEX], f"torch: no NVIDIA GPU found, installing the CPU build from {CPU_INDEX}"
    return [], (f"torch: no NVIDIA GPU found, but {CPU_INDEX} is unreachable: installing from the "
                "default index (on Linux that is the larger CUDA build)")


def installed_version() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return None
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="torch>=2.9", help="the requirement to install (default torch>=2.9)")
    p.add_argument("--index", default="", help="pip index arguments to use as given (TORCH_INDEX)")
    p.add_argument("--dry-run", action="store_true", help="print the choice, install nothing")
    args = p.parse_args(argv)
    index, line = choose(installed=installed_version(), override=args.index, platform=sys.platform,
                         gpu=nvidia_gpu(), cpu_index_up=lambda: reachable(CPU_INDEX + "/"))
    print(line, flush=True)
    if index is None or args.dry_run:
        return 0
    return subprocess.call([sys.executable, "-m", "pip", "install", *index, args.spec])


if __name__ == "__main__":
    sys.exit(main())
