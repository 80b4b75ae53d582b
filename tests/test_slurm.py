"""The workshop kit's own scripts, submitted to a real SLURM: ``sbatch`` runs them as a cluster would.

``.ci/slurm start`` makes a one-node cluster on this machine (munge, slurmctld, slurmd; no GPUs)
and ``.ci/run`` does so before the suite. Outside CI these tests skip, in one line, where
``sbatch`` is absent; under ``CI=true`` they fail instead, so CI cannot pass them unrun.

What they show: ``train.sbatch`` trains on CPU ranks under ``srun`` + ``torchrun`` and saves its
state; ``jupyter.sbatch``'s server answers on the port its job printed, with the token from its
URL file, and another token is refused; two learners of one account on one node each reach
their own server; a port already taken is refused with a clear error, never silently swapped
for the next one (Jupyter's default ``port_retries=50`` did that); ``workshop/seat.sh`` seats
its caller with one command, under the caller's account, and a rerun reuses the job; with
``--shared-account`` it seats three names of a roster (a dry run), each in a working copy of its
own. What they cannot show: GPUs (this node has none), a login host in front of the nodes, a
second account, and ssh itself (the tunnel ``-L P:127.0.0.1:P`` ends at 127.0.0.1:P of the node,
which is what is checked here).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support import slowdown

ROOT = Path(__file__).resolve().parents[1]
WORKSHOP = ROOT / "workshop"
SMALL = ["--cpus-per-task=1", "--mem=1G", "--time=00:10:00"]  # several jobs share the 2-core node

pytestmark = pytest.mark.timeout(slowdown(600))


@pytest.fixture(scope="module", autouse=True)
def slurm():
    """A SLURM that answers, or a skip (a failure under CI=true) in one line."""
    missing = shutil.which("sbatch") is None
    reason = "sbatch not found: these tests need a SLURM cluster (`.ci/slurm start` makes one, as root)"
    if not missing:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=slowdown(30))
        missing = done.returncode != 0 or not re.search(r"idle|mixed|allocated", done.stdout)
        reason = f"SLURM does not answer (sinfo: {(done.stderr or done.stdout).strip()[:100]}): `.ci/slurm start`"
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"under CI=true the SLURM tests must run: {reason}")
        pytest.skip(reason)


def job_env(tmp_path: Path, **extra: str) -> dict:
    """What a learner's job sees: this checkout's scripts, this interpreter's environment, and a
    home of its own (the URL files). The working copy is the checkout unless a test gives one."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "SHARDLAB_HOME": str(ROOT), "SHARDLAB_ENV": sys.prefix, "SHARDLAB_DIR": str(ROOT),
           "PYTHONPATH": str(ROOT / "src"), "HOME": str(home)}
    env.pop("USER", None)  # as on sites whose jobs get no USER: the scripts must not need it
    env.pop("JUPYTER_PORT", None)
    return {**env, **extra}


def sbatch(script: str, *args: str, env: dict, cwd: Path, script_args: tuple = ()) -> str:
    done = subprocess.run(["sbatch", "--parsable", f"--chdir={cwd}", *args, str(WORKSHOP / script), *script_args],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=slowdown(30))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def state(job: str) -> str:
    done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return done.stdout.strip()


def wait_for(out: Path, job: str, pattern: str, seconds: float) -> str:
    """The job's output once it holds ``pattern`` (a regex); fails if the job ends first."""
    deadline = time.monotonic() + slowdown(seconds)
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        if re.search(pattern, text):
            return text
        if not state(job):
            time.sleep(1)  # the last lines may still be on their way to the file
            text = out.read_text() if out.exists() else ""
            assert re.search(pattern, text), f"job {job} ended without {pattern!r}:\n{text[-3000:]}"
            return text
        time.sleep(0.5)
    raise AssertionError(f"job {job} ({state(job) or 'gone'}) printed no {pattern!r} in {slowdown(seconds)} s:\n"
                         f"{out.read_text()[-3000:] if out.exists() else '(no output yet)'}")


def wait_gone(job: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + slowdown(seconds)
    while state(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not state(job), f"job {job} still {state(job)}"


def cancel(*jobs: str) -> None:
    subprocess.run(["scancel", *jobs], capture_output=True)
    for job in jobs:
        wait_gone(job)


def status_code(port: int, token: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=slowdown(10)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def tunnel_and_token(text: str) -> tuple[int, str, Path]:
    """The port of the printed ``ssh -N -L P:127.0.0.1:P ...`` and the token in the printed URL file."""
    match = re.search(r"ssh -N -L (\d+):127\.0\.0\.1:(\d+) -J (\S+)@\S+ (\S+)@\S+", text)
    assert match, text[-2000:]
    assert match[1] == match[2], "the tunnel must end on the port it opens"
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    assert match[3] == match[4] == user, "the tunnel's user is the job's, found without USER"
    url_file = Path(re.search(r"cat (\S+\.url)", text)[1])
    url = url_file.read_text().strip()
    assert url.startswith(f"http://localhost:{match[1]}/lab?token="), url
    assert oct(url_file.stat().st_mode & 0o777) == "0o600"
    return int(match[1]), url.split("token=", 1)[1], url_file


TUNNEL = r"ssh -N -L \d+"


def test_train_sbatch_trains_on_cpu_ranks_and_saves_its_state(tmp_path):
    """The GPU job's script as shipped, with CPU overrides: 2 gloo ranks, 3 steps of the tiny GPT."""
    env = job_env(tmp_path, GPUS_PER_NODE="2", SHARDLAB_DIR=str(tmp_path))  # --save writes there
    job = sbatch("train.sbatch", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--mem=2G",
                 "--time=00:10:00", env=env, cwd=tmp_path,
                 script_args=("--backend", "gloo", "--size", "tiny", "--steps", "3"))
    out = tmp_path / f"shardlab-{job}.out"
    text = wait_for(out, job, r"saved the full state dict|Error|error", 300)
    wait_gone(job)
    assert f"job {job}: 1 nodes x 2 GPUs, 2 CPUs per node" in text, text[-2000:]
    assert re.search(r"step +3/3 +loss \d+\.\d{4}", text), text[-2000:]
    assert re.search(r"weights checksum \S+", text) and "saved the full state dict" in text, text[-2000:]
    import torch

    state_dict = torch.load(tmp_path / f"shardlab-{job}.pt", map_location="cpu")
    assert state_dict and all(torch.isfinite(t).all() for t in state_dict.values() if t.is_floating_point())


def test_two_learners_on_one_node_each_reach_their_own_server(tmp_path):
    """One account, one node, two jobs: two ports, two tokens, each tunnel to its own server."""
    env = job_env(tmp_path)
    jobs = [sbatch("jupyter.sbatch", *SMALL, env=env, cwd=tmp_path) for _ in range(2)]
    try:
        seen = [tunnel_and_token(wait_for(tmp_path / f"shardlab-jupyter-{j}.out", j, TUNNEL, 240)) for j in jobs]
        (port_a, token_a, _), (port_b, token_b, _) = seen
        assert port_a != port_b and token_a != token_b
        assert status_code(port_a, token_a) == 200 and status_code(port_b, token_b) == 200
        assert status_code(port_a, token_b) == 403 and status_code(port_b, token_a) == 403
    finally:
        cancel(*jobs)
    assert not any(url.exists() for _, _, url in seen), "the URL files (tokens) outlive their jobs"


def test_a_taken_port_is_refused_not_silently_moved(tmp_path):
    """JUPYTER_PORT names a port something already listens on (another learner's server). Jupyter's
    default port_retries=50 would bind the next port while the job printed the taken one: the
    tunnel then leads to the other server. The job must refuse, naming the port, and print no tunnel."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        env = job_env(tmp_path, JUPYTER_PORT=str(port))
        job = sbatch("jupyter.sbatch", *SMALL, env=env, cwd=tmp_path)
        out = tmp_path / f"shardlab-jupyter-{job}.out"
        try:
            text = wait_for(out, job, rf"{TUNNEL}|port {port} is already in use", 240)
        finally:
            cancel(job)
    assert not re.search(TUNNEL, text), f"a tunnel was printed for a port this job does not serve:\n{text[-2000:]}"
    assert f"error: port {port} is already in use" in text


def test_a_learner_seats_themselves_with_one_command_and_a_rerun_reuses_the_job(tmp_path):
    """workshop/seat.sh with no name: the caller's own seat, under their account (the tunnel's user),
    with a walltime counted to --until; run again while the job runs, it hands out the same lines
    and submits nothing."""
    import datetime

    end = datetime.datetime.now() + datetime.timedelta(minutes=20)
    if end.date() != datetime.date.today():
        pytest.skip("--until names a time today; too close to midnight to test it")
    me = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    env = job_env(tmp_path, SEAT_WAIT=str(int(slowdown(300))))
    env.pop("SHARDLAB_DIR")  # seat.sh sets it
    command = [str(WORKSHOP / "seat.sh"), "--room", str(tmp_path / "room"), "--until", end.strftime("%H:%M"),
               "--", "--cpus-per-task=1", "--mem=1G"]
    first = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=slowdown(400))
    jobs = re.findall(r"seated \S+: job (\d+)", first.stdout)
    try:
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        assert jobs and f"seated {me}: job {jobs[0]}, working copy" in first.stdout
        seat = (tmp_path / "room" / me / "SEAT.txt").read_text()
        port, token, _ = tunnel_and_token(seat)  # the tunnel's user is the caller, the job's owner
        assert status_code(port, token) == 200
        limit = subprocess.run(["squeue", "-h", "-j", jobs[0], "-o", "%l"], capture_output=True, text=True).stdout
        assert limit.strip() in {"19:00", "20:00", "21:00"}, limit  # counted from now to --until
        again = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=slowdown(120))
        assert again.returncode == 0 and f"seated {me}: job {jobs[0]} again" in again.stdout, again.stdout + again.stderr
        assert seat in again.stdout
        # this copy's jobs only: another run's job of the same name has another working copy
        queued = subprocess.run(["squeue", "-h", "-u", me, "-n", f"shardlab-{me}", "-o", "%i %Z"],
                                capture_output=True, text=True).stdout.splitlines()
        copy = str((tmp_path / "room" / me).resolve())
        assert [line.split()[0] for line in queued if line.split()[1:] == [copy]] == [jobs[0]], \
            "a rerun submitted a second server"
    finally:
        cancel(*jobs)


def test_the_dry_run_seats_three_names_under_one_account_when_asked(tmp_path):
    """workshop/seat.sh --shared-account from a roster (the instructor's dry run): a working copy and
    a server each, each told its tunnel and URL file. Without --shared-account it would refuse them."""
    names = [f"{name}-{os.getpid()}" for name in ("ada", "grace", "linus")]  # no other run's job of that name
    roster = tmp_path / "room.txt"
    roster.write_text(f"# the room\n{names[0]}\n{names[1]}\n\n{names[2]}  (late)\n")
    env = job_env(tmp_path, SEAT_WAIT=str(int(slowdown(300))))
    env.pop("SHARDLAB_DIR")  # seat.sh sets it per learner
    done = subprocess.run([str(WORKSHOP / "seat.sh"), "--shared-account", "--roster", str(roster),
                           "--room", str(tmp_path / "room"), "--", *SMALL], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=slowdown(400))
    jobs = re.findall(r"seated \S+: job (\d+)", done.stdout)
    try:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert len(jobs) == 3, done.stdout
        ports = set()
        for name in names:
            copy = tmp_path / "room" / name
            assert (copy / "notebooks" / "00_start_here.ipynb").is_file() and (copy / "labs").is_dir()
            seat = (copy / "SEAT.txt").read_text()
            assert seat in done.stdout
            port, token, _ = tunnel_and_token(seat)
            assert status_code(port, token) == 200
            ports.add(port)
            # the server is rooted in the learner's own copy
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}",
                                        timeout=slowdown(10)) as r:
                assert "SEAT.txt" in r.read().decode()
        assert len(ports) == 3
    finally:
        cancel(*jobs)
