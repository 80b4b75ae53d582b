"""The workshop's SLURM scripts, dry-run here: fake ``srun``, ``scontrol`` and ``jupyter`` record
what the scripts would start, so a broken flag or a wrong tunnel command fails here, not on the
day. (The real run on a cluster is step 1 of workshop/README.md.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKSHOP = ROOT / "workshop"


def fake_site(tmp_path: Path, scontrol: str = 'printf "node-a\\nnode-b\\n"') -> dict:
    """A SHARDLAB_DIR whose .venv activates a PATH of stubs that print their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": 'echo "srun $*"',
        "scontrol": scontrol,
        "jupyter": 'echo "jupyter $*"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    python_dir = str(Path(sys.executable).parent)
    (venv / "activate").write_text(f'export PATH="{bin_dir}:{python_dir}:$PATH"\n')
    return {**os.environ, "SHARDLAB_DIR": str(tmp_path), "SLURM_SUBMIT_DIR": str(tmp_path),
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_GPUS_ON_NODE": "4", "SLURM_SUBMIT_HOST": "login1", "USER": "learner",
            "PYTHONPATH": str(ROOT / "src"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # SLURM's tools


@pytest.mark.parametrize("script", ["train.sbatch", "jupyter.sbatch"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(WORKSHOP / script)]).returncode == 0


def test_train_sbatch_starts_one_torchrun_per_node_meeting_at_the_first(tmp_path):
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch"), "--stage", "2"], env=fake_site(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    srun = next(line for line in out.stdout.splitlines() if line.startswith("srun "))
    for part in ("torchrun", "--nnodes 2", "--nproc-per-node 4", "--rdzv-backend c10d",
                 "--rdzv-endpoint node-a:29500", "-m shardlab.train --backend nccl", "--stage 2"):
        assert part in srun, part


def test_train_sbatch_survives_a_long_node_list(tmp_path):
    """A 2000-node list written a line at a time: reading only its first line through a pipe
    (``| head -n 1``) kills scontrol with SIGPIPE, and under ``pipefail`` the job exits 141."""
    many = 'for i in $(seq 0 1999); do echo "node-$i"; done'
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch")], env=fake_site(tmp_path, scontrol=many),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert "--rdzv-endpoint node-0:29500" in out.stdout


def test_jupyter_sbatch_prints_the_tunnel_and_starts_jupyter_on_this_node(tmp_path):
    env = {**fake_site(tmp_path), "SLURMD_NODENAME": "gpu-node-17"}
    out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    node, port = "gpu-node-17", 8800 + 4242 % 1000
    assert f"ssh -N -L {port}:{node}:{port} learner@login1" in out.stdout
    assert f"http://localhost:{port}/lab?token=" in out.stdout
    token = out.stdout.split("token=")[1].split()[0]
    jupyter = next(line for line in out.stdout.splitlines() if line.startswith("jupyter "))
    assert f"--ip={node}" in jupyter and f"--port={port}" in jupyter and f"--IdentityProvider.token={token}" in jupyter
    assert "notebooks/00_start_here.ipynb" in jupyter
