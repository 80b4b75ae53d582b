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
        "jupyter": 'echo "jupyter $*"; echo "jupyter saw JUPYTER_TOKEN=${JUPYTER_TOKEN:-unset}" > "$HOME/jupyter-env"',
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
            "SLURM_CPUS_PER_TASK": "16", "HOME": str(tmp_path / "home"),
            "PYTHONPATH": str(ROOT / "src"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # SLURM's tools


@pytest.mark.parametrize("script", ["train.sbatch", "jupyter.sbatch"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(WORKSHOP / script)]).returncode == 0


def test_train_sbatch_starts_one_torchrun_per_node_meeting_at_the_first(tmp_path):
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch"), "--stage", "2"], env=fake_site(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    srun = next(line for line in out.stdout.splitlines() if line.startswith("srun "))
    port = 29500 + 4242 % 1000  # from the job id: two jobs on one node do not collide on 29500
    for part in ("--cpus-per-task=16 torchrun", "--nnodes 2", "--nproc-per-node 4", "--rdzv-backend c10d",
                 f"--rdzv-endpoint node-a:{port}", "-m shardlab.train --backend nccl", "--stage 2"):
        assert part in srun, part


def test_train_sbatch_gives_each_agent_its_cpus(tmp_path):
    """Slurm >= 22.05: srun does not inherit sbatch's --cpus-per-task; the script passes it on,
    as the flag and as SRUN_CPUS_PER_TASK (which srun reads)."""
    site = fake_site(tmp_path)
    (tmp_path / "bin" / "srun").write_text('#!/bin/bash\necho "srun sees SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK"\n')
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch")], env={**site, "SLURM_CPUS_PER_TASK": "12"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "srun sees SRUN_CPUS_PER_TASK=12" in out.stdout and "12 CPUs per node" in out.stdout


def test_train_sbatch_survives_a_long_node_list(tmp_path):
    """A 2000-node list written a line at a time: reading only its first line through a pipe
    (``| head -n 1``) kills scontrol with SIGPIPE, and under ``pipefail`` the job exits 141."""
    many = 'for i in $(seq 0 1999); do echo "node-$i"; done'
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch")], env=fake_site(tmp_path, scontrol=many),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert f"--rdzv-endpoint node-0:{29500 + 4242 % 1000}" in out.stdout


def test_jupyter_sbatch_keeps_the_token_private_and_binds_to_localhost(tmp_path):
    env = {**fake_site(tmp_path), "SLURMD_NODENAME": "gpu-node-17"}
    out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    node, port = "gpu-node-17", 8800 + 4242 % 1000
    # the tunnel ends on the node itself, where the server listens on 127.0.0.1 only
    assert f"ssh -N -L {port}:127.0.0.1:{port} -J learner@login1 learner@{node}" in out.stdout
    jupyter = next(line for line in out.stdout.splitlines() if line.startswith("jupyter "))
    assert "--ip=127.0.0.1" in jupyter and f"--port={port}" in jupyter
    assert "notebooks/00_start_here.ipynb" in jupyter
    # the token: in the environment and in a file only the learner reads; never in the output or argv
    token = (tmp_path / "home" / "jupyter-env").read_text().split("=", 1)[1].strip()
    assert len(token) == 32 and token not in out.stdout and token not in out.stderr and "token" not in jupyter.lower()
    url_file = tmp_path / "home" / ".shardlab" / "jupyter-4242.url"
    assert f"cat {url_file}" in out.stdout
    assert not url_file.exists()  # removed when the job ends (the fake jupyter returned at once)


def test_jupyter_sbatch_url_file_is_private_while_the_job_runs(tmp_path):
    site = fake_site(tmp_path)
    seen = tmp_path / "seen"
    (tmp_path / "bin" / "jupyter").write_text(
        f'#!/bin/bash\nstat -c "%a" "$HOME/.shardlab/jupyter-4242.url" > {seen}\ncat "$HOME/.shardlab/jupyter-4242.url" >> {seen}\n')
    out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env=site, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mode, url = seen.read_text().split()
    assert mode == "600" and url.startswith(f"http://localhost:{8800 + 4242 % 1000}/lab?token=")
