"""Install PyTorch into this environment, choosing the small CPU build when there is no NVIDIA GPU.

Run by ``make lab`` / ``make test`` before the package itself, so that the package's
``torch>=2.9`` is already met. On Linux, plain ``pip install torch`` fetches the CUDA build
(about 20 ``nvidia-*`` packages, several GB) even on a laptop without a GPU, so::

    torch already importable            -> leave it alone, unless it is the CPU build and this
                                           node has an NVIDIA GPU: then replace it (below)
    TORCH_INDEX given (pip arguments)   -> use them as given
    Linux, no nvidia-smi or no /dev/nvidia*
      and the CPU index answers         -> the CPU build from download.pytorch.org/whl/cpu
    otherwise                           -> the default index (CUDA on Linux with a GPU; macOS
                                           and Windows wheels there are CPU/MPS builds anyway)

It prints one line saying what it chose. ``--dry-run`` prints the line and installs nothing.
The decision is :func:`choose`, a pure function (tests/test_install_torch.py checks it).

``--check`` installs nothing: the workshop's sbatch scripts run it before a job starts, and it
fails (exit 1) when this node has an NVIDIA GPU but the environment's torch is the CPU build,
naming the command that fixes it (:func:`refusal`). An environment built on a login node
without a GPU would otherwise run GPU jobs on CPU torch: ``--backend nccl`` fails and notebook
06 quietly says "no GPU here".

``WHEELHOUSE`` (a folder of wheels, for compute nodes without internet) is read by pip itself
through ``PIP_FIND_LINKS`` and ``PIP_NO_INDEX``, which ``make install WHEELHOUSE=...`` sets.
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


FIX = ("rebuild the environment where the GPUs are, e.g. inside a GPU job: "
       "srun --gpus-per-node=1 --cpus-per-task=4 --time=00:30:00 make -C {home} install")


def choose(*, installed: str | None, override: str, platform: str, gpu: bool,
           cpu_index_up, installed_cuda: str | None) -> tuple[list[str] | None, str]:
    """(pip arguments for the index, or None to install nothing; the one line to print).

    ``cpu_index_up`` is a callable, asked only when the CPU build is the choice.
    ``installed_cuda`` is the installed torch's ``torch.version.cuda``: None on a CPU build. A CPU build
    found on a Linux node with a GPU is replaced (``main`` uninstalls it first): that is the
    environment built on a login node and then run where the GPUs are.
    """
    if installed and not (gpu and platform.startswith("linux") and installed_cuda is None):
        return None, f"torch {installed} is already installed: leaving it alone"
    if installed:
        index = shlex.split(override) if override.strip() else []
        return index, (f"torch: {installed} is the CPU build but this node has an NVIDIA GPU: "
                       "replacing it with the CUDA build")
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


def refusal(*, installed: str | None, cuda: str | None, gpu: bool, home: str) -> str | None:
    """The message that stops a GPU job on a CPU build of torch, or None when all is well."""
    if not gpu:
        return None
    if installed is None:
        return f"this environment has no torch: {FIX.format(home=home)}"
    if cuda is None:  # torch.version.cuda: None on the CPU build
        return (f"this node has an NVIDIA GPU but this environment's torch ({installed}) is the CPU build, "
                f"so GPU jobs would run on the CPU; {FIX.format(home=home)}")
    return None


def installed_version() -> tuple[str | None, str | None]:
    """(torch.__version__, torch.version.cuda) of the installed torch, or (None, None)."""
    if importlib.util.find_spec("torch") is None:
        return None, None
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None, None
    version, cuda = done.stdout.split()
    return version, None if cuda == "None" else cuda


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="torch>=2.9", help="the requirement to install (default torch>=2.9)")
    p.add_argument("--index", default="", help="pip index arguments to use as given (TORCH_INDEX)")
    p.add_argument("--dry-run", action="store_true", help="print the choice, install nothing")
    p.add_argument("--check", action="store_true",
                   help="install nothing; exit 1 if this node has an NVIDIA GPU and torch is the CPU build")
    p.add_argument("--home", default=".", help="the course checkout named in --check's fix (default .)")
    args = p.parse_args(argv)
    installed, cuda = installed_version()
    if args.check:
        message = refusal(installed=installed, cuda=cuda, gpu=nvidia_gpu(), home=args.home)
        print(f"error: {message}" if message else f"torch {installed}: fits this node", flush=True,
              file=sys.stderr if message else sys.stdout)
        return 1 if message else 0
    index, line = choose(installed=installed, override=args.index, platform=sys.platform, gpu=nvidia_gpu(),
                         cpu_index_up=lambda: reachable(CPU_INDEX + "/"), installed_cuda=cuda)
    print(line, flush=True)
    if index is None or args.dry_run:
        return 0
    if installed:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-y", "torch"])
    return subprocess.call([sys.executable, "-m", "pip", "install", *index, args.spec])


if __name__ == "__main__":
    sys.exit(main())
