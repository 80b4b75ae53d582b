"""The workshop's SLURM scripts, dry-run here: fake ``srun``, ``scontrol`` and ``jupyter`` record
what the scripts would start, so a broken flag or a wrong tunnel command fails here, not on the
day, in a second and without SLURM. tests/test_slurm.py submits the same scripts to a real SLURM
(under CI); the run on a GPU cluster is step 1 of workshop/README.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import slowdown

ROOT = Path(__file__).resolve().parents[1]
WORKSHOP = ROOT / "workshop"


# The fake jupyter records what a real one records of where it listens (jpserver-<pid>.json in
# its runtime folder, the port it bound), then stays up a moment as a server would.
FAKE_JUPYTER = ('echo "jupyter $*"; echo "jupyter saw JUPYTER_TOKEN=${JUPYTER_TOKEN:-unset}" > "$HOME/jupyter-env"\n'
                'port=$(printf "%s\\n" "$@" | sed -n "s/^--port=//p")\n'
                'echo "{\\"port\\": ${JUPYTER_STUB_PORT:-$port}}" > "$JUPYTER_RUNTIME_DIR/jpserver-$$.json"\n'
                'eval "${JUPYTER_STUB_EXTRA:-}"\nsleep 1')


def fake_site(tmp_path: Path, scontrol: str = 'printf "node-a\\nnode-b\\n"') -> dict:
    """A course checkout (SHARDLAB_HOME) whose .venv activates a PATH of stubs that print their
    arguments; its workshop/ and scripts/ are the real ones."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": 'echo "srun $*"',
        "scontrol": scontrol,
        "jupyter": FAKE_JUPYTER,
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    python_dir = str(Path(sys.executable).parent)
    (venv / "activate").write_text(f'export PATH="{bin_dir}:{python_dir}:$PATH"\n')
    (tmp_path / "workshop").symlink_to(WORKSHOP)
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_start_here.ipynb").write_text("{}")
    return {**os.environ, "SHARDLAB_HOME": str(tmp_path), "SLURM_SUBMIT_DIR": str(tmp_path),
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_GPUS_ON_NODE": "4", "SLURM_SUBMIT_HOST": "login1", "USER": "learner",
            "SLURM_CPUS_PER_TASK": "16", "HOME": str(tmp_path / "home"),
            "PYTHONPATH": str(ROOT / "src"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # SLURM's tools


@pytest.mark.parametrize("script", ["train.sbatch", "jupyter.sbatch"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(WORKSHOP / script)]).returncode == 0


def test_train_sbatch_starts_one_torchrun_per_node_meeting_at_the_first(tmp_path):
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch"), "--stage", "2"], env=fake_site(tmp_path),
                         capture_output=True, text=True, timeout=slowdown(60))
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
                         capture_output=True, text=True, timeout=slowdown(60))
    assert out.returncode == 0, out.stderr
    assert "srun sees SRUN_CPUS_PER_TASK=12" in out.stdout and "12 CPUs per node" in out.stdout


def test_train_sbatch_survives_a_long_node_list(tmp_path):
    """A 2000-node list written a line at a time: reading only its first line through a pipe
    (``| head -n 1``) kills scontrol with SIGPIPE, and under ``pipefail`` the job exits 141."""
    many = 'for i in $(seq 0 1999); do echo "node-$i"; done'
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch")], env=fake_site(tmp_path, scontrol=many),
                         capture_output=True, text=True, timeout=slowdown(60))
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert f"--rdzv-endpoint node-0:{29500 + 4242 % 1000}" in out.stdout


def test_jupyter_sbatch_keeps_the_token_private_and_binds_to_localhost(tmp_path):
    env = {**fake_site(tmp_path), "SLURMD_NODENAME": "gpu-node-17"}
    out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env=env, capture_output=True, text=True, timeout=slowdown(120))
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
    url = tmp_path / "home" / ".shardlab" / "jupyter-4242.url"
    wait = f'for i in $(seq 100); do [ -f {url} ] && break; sleep 0.1; done; stat -c "%a" {url} > {seen}; cat {url} >> {seen}'
    out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env={**site, "JUPYTER_STUB_EXTRA": wait},
                         capture_output=True, text=True, timeout=slowdown(120))
    assert out.returncode == 0, out.stderr
    mode, url = seen.read_text().split()
    assert mode == "600" and url.startswith(f"http://localhost:{8800 + 4242 % 1000}/lab?token=")


def test_the_tunnel_names_the_port_the_server_bound(tmp_path):
    """What the server records as its port is what the tunnel and the URL use, even were it not
    the port asked for (port_retries=0 makes them equal; the check does not rely on it)."""
    site = fake_site(tmp_path)
    out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env={**site, "JUPYTER_STUB_PORT": "9999"},
                         capture_output=True, text=True, timeout=slowdown(120))
    assert out.returncode == 0, out.stderr
    jupyter = next(line for line in out.stdout.splitlines() if line.startswith("jupyter "))
    assert "--ServerApp.port_retries=0" in jupyter
    assert "ssh -N -L 9999:127.0.0.1:9999" in out.stdout and "127.0.0.1:9999 of" in out.stdout


def test_jupyter_sbatch_needs_no_user_and_allows_root_only_as_root(tmp_path):
    site = {k: v for k, v in fake_site(tmp_path).items() if k != "USER"}
    out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env=site, capture_output=True, text=True,
                         timeout=slowdown(120))
    assert out.returncode == 0, out.stderr
    me = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    assert f"-J {me}@login1 {me}@" in out.stdout
    jupyter = next(line for line in out.stdout.splitlines() if line.startswith("jupyter "))
    assert ("--allow-root" in jupyter) == (os.getuid() == 0)


def test_the_scripts_refuse_a_missing_environment_or_working_copy(tmp_path):
    site = fake_site(tmp_path)
    for script in ("jupyter.sbatch", "train.sbatch"):
        out = subprocess.run(["bash", str(WORKSHOP / script)], env={**site, "SHARDLAB_ENV": str(tmp_path / "nope")},
                             capture_output=True, text=True, timeout=slowdown(60))
        assert out.returncode == 1 and f"no environment at {tmp_path / 'nope'}" in out.stderr
        assert "make -C" in out.stderr and "install" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    for copy, says in ((tmp_path / "gone", "does not exist"), (empty, "holds no copy of the course")):
        out = subprocess.run(["bash", str(WORKSHOP / "jupyter.sbatch")], env={**site, "SHARDLAB_DIR": str(copy)},
                             capture_output=True, text=True, timeout=slowdown(60))
        assert out.returncode == 1 and says in out.stderr and "seat.sh" in out.stderr, out.stderr


def test_the_site_hook_runs_before_the_environment(tmp_path):
    """SHARDLAB_SETUP (module load, conda activate) is sourced first; SHARDLAB_ENV=none then
    uses the environment it activated."""
    site = fake_site(tmp_path)
    hook = tmp_path / "site.sh"
    hook.write_text(f'export PATH="{tmp_path / "bin"}:{Path(sys.executable).parent}:$PATH"; echo "site hook ran"\n')
    out = subprocess.run(["bash", str(WORKSHOP / "train.sbatch")],
                         env={**site, "SHARDLAB_SETUP": str(hook), "SHARDLAB_ENV": "none"},
                         capture_output=True, text=True, timeout=slowdown(60))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("site hook ran") and "srun " in out.stdout


def fake_slurm(tmp_path: Path, queued: str = "") -> dict:
    """seat.sh's view of SLURM: an sbatch that records its arguments and answers job 4242, and a
    squeue that knows one job, ``queued``: asked about a job id, it lists it if it is that one;
    asked about a user or a job name, it lists ``queued`` whatever the name or room."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path / "sbatch-calls"}\necho 4242\n')
    (bin_dir / "squeue").write_text(
        '#!/bin/bash\njob=""\nwhile [ $# -gt 0 ]; do [ "$1" = -j ] && job=$2; shift; done\n'
        f'[ -n "{queued}" ] || exit 0\n'
        f'if [ -n "$job" ]; then [ "$job" != "{queued}" ] || echo RUNNING; else echo {queued}; fi\nexit 0\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SHARDLAB_ENV": sys.prefix,
            "HOME": str(tmp_path / "home"), "USER": "ada"}


def seat(tmp_path: Path, *args: str, env: dict, room: str = "room",
         script: Path = WORKSHOP / "seat.sh") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), "--room", str(tmp_path / room), "--no-wait", *args],
                          env=env, capture_output=True, text=True, timeout=slowdown(120))


def fake_kit(tmp_path: Path) -> Path:
    """A shared checkout whose notebook holds an instructor's outputs (no committed notebook has
    any): workshop/seat.sh, and notebooks/06_real_gpus.ipynb with one code cell run as In [3]."""
    kit = tmp_path / "kit"
    for folder in ("workshop", "notebooks", "labs", "docs"):
        (kit / folder).mkdir(parents=True)
    (kit / "workshop" / "seat.sh").write_text((WORKSHOP / "seat.sh").read_text())
    output = {"output_type": "stream", "name": "stdout", "text": ["the instructor's answer\n"]}
    book = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": 3, "source": ["print(1)"],
         "outputs": [output]}]}
    (kit / "notebooks" / "06_real_gpus.ipynb").write_text(json.dumps(book))
    return kit


def test_seat_sh_refuses_to_seat_someone_else_under_your_account(tmp_path):
    """Seated under the caller's account, another learner could neither tunnel nor read the URL,
    and their terminal would be a shell as the caller: a name that is not the caller's is refused."""
    env = fake_slurm(tmp_path)
    out = seat(tmp_path, "grace", env=env)
    assert out.returncode == 2 and "'grace' is not your account (ada)" in out.stderr and "--shared-account" in out.stderr
    assert not (tmp_path / "sbatch-calls").exists()
    out = seat(tmp_path, "--shared-account", "grace", env=env)  # a dry run's seats: allowed, when asked for
    assert out.returncode == 0, out.stderr
    assert "--job-name=shardlab-grace" in (tmp_path / "sbatch-calls").read_text()


def test_seat_sh_seats_the_caller_with_a_time_counted_to_the_end_of_the_day(tmp_path):
    import datetime

    env = fake_slurm(tmp_path)
    end = datetime.datetime.now() + datetime.timedelta(minutes=90)
    if end.date() != datetime.date.today():
        pytest.skip("--until names a time today; too close to midnight to test it")
    out = seat(tmp_path, "--until", end.strftime("%H:%M"), "--", "--partition=cpu", env=env)
    assert out.returncode == 0, out.stderr
    call = (tmp_path / "sbatch-calls").read_text()
    minutes = int(call.split("--time=")[1].split()[0])
    assert 89 <= minutes <= 91 and "--job-name=shardlab-ada" in call
    assert call.index("--time=") < call.index("--partition=cpu")  # the learner's own arguments come last, and win
    copy = tmp_path / "room" / "ada"
    assert (copy / "notebooks" / "00_start_here.ipynb").is_file() and f"--chdir={copy}" in call
    out = seat(tmp_path, "--until", "00:00", env=env)
    assert out.returncode == 2 and "has already passed today" in out.stderr


def test_seat_sh_run_again_reuses_the_queued_job_of_that_copy_only(tmp_path):
    """A second run while the job this copy submitted is queued or running submits nothing: no
    second server. A job of the same name from another room is another copy's server: the seat in
    this room gets a job of its own, whose working copy is this one."""
    env = fake_slurm(tmp_path, queued="4242")
    first = seat(tmp_path, env=env)
    assert first.returncode == 0 and "seated ada: job 4242, working copy" in first.stdout, first.stdout
    again = seat(tmp_path, env=env)
    assert again.returncode == 0 and "seated ada: job 4242 again" in again.stdout, again.stderr
    assert len((tmp_path / "sbatch-calls").read_text().splitlines()) == 1
    elsewhere = seat(tmp_path, env=env, room="scratch")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert f"seated ada: job 4242, working copy {tmp_path / 'scratch' / 'ada'}" in elsewhere.stdout
    calls = (tmp_path / "sbatch-calls").read_text().splitlines()
    assert len(calls) == 2 and f"--chdir={tmp_path / 'scratch' / 'ada'}" in calls[1]


def test_seat_sh_copies_start_without_outputs(tmp_path):
    """An instructor who ran a notebook in the shared checkout saved its outputs and predictions
    there: a learner's fresh copy must not start with them."""
    env = fake_slurm(tmp_path)
    out = seat(tmp_path, env=env, script=fake_kit(tmp_path) / "workshop" / "seat.sh")
    assert out.returncode == 0, out.stderr
    book = json.loads((tmp_path / "room" / "ada" / "notebooks" / "06_real_gpus.ipynb").read_text())
    assert [(c["outputs"], c["execution_count"]) for c in book["cells"]] == [([], None)]
    assert "warning" not in out.stderr


def test_seat_sh_says_so_when_it_cannot_clear_the_outputs(tmp_path):
    env = fake_slurm(tmp_path)
    broken = tmp_path / "slurm-bin" / "python3"
    broken.write_text("#!/bin/bash\nexit 127\n")
    broken.chmod(0o755)
    out = seat(tmp_path, env=env, script=fake_kit(tmp_path) / "workshop" / "seat.sh")
    assert out.returncode == 0, out.stderr
    assert "warning: could not clear the notebooks' outputs" in out.stderr


def test_room_memory_skips_a_process_that_ends_while_it_is_read():
    """An engine that exits between the listing and the reading of its command line is left out,
    not a NoSuchProcess that ends the sizing run."""
    import importlib.util
    from types import SimpleNamespace

    import psutil

    spec = importlib.util.spec_from_file_location("room_memory", WORKSHOP / "room_memory.py")
    room_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(room_memory)

    class Ending:
        pid = 4242

        def memory_full_info(self):
            return SimpleNamespace(rss=10**6, pss=0, uss=0)

        def cmdline(self):
            raise psutil.NoSuchProcess(self.pid)

    class Running(Ending):
        def cmdline(self):
            return ["python", "-m", "engine"]

    assert room_memory._sum([Ending(), Running()]) == {"rss": 10**6, "pss": 0, "uss": 0}
