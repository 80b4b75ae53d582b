"""The torchrun path: the same engine trained by ``python -m shardlab.train`` outside the notebook.

Multi-node is tested on one machine: two torchrun agents, each a "node" of 2 processes, meet
through c10d rendezvous on loopback. Their final weights must equal those of 1 node x 4
processes, bit for bit (same ranks, same data rows, same reduction order).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support import slowdown

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "shardlab.train", "--size", "tiny", "--stage", "3", "--steps", "3", "--seed", "7",
         "--timeout", str(int(slowdown(60)))]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(procs: list[subprocess.Popen], timeout: float = slowdown(150)) -> list[str]:
    """Wait for every process; on timeout or failure kill them all and show their output."""
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"torchrun exited with {p.returncode}:\n{out[-4000:]}"
    return outs


def _checksum(out: str) -> str:
    lines = [line for line in out.splitlines() if "weights checksum" in line]
    assert lines, f"no checksum line in:\n{out[-2000:]}"
    return lines[-1].rsplit(" ", 1)[-1]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_single_process_runs_without_torchrun(tmp_path):
    """`python -m shardlab train` alone is a world of one: same engine, no launcher needed."""
    out = subprocess.run([sys.executable, "-m", "shardlab", "train", "--size", "tiny", "--stage", "2",
                          "--steps", "2", "--save", str(tmp_path / "one.pt")],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=slowdown(120))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 rank(s) on gloo" in out.stdout and "weights checksum" in out.stdout
    assert set(_load(tmp_path / "one.pt")) >= {"tok.weight", "head.weight"}


def test_the_default_run_visibly_learns(tmp_path):
    """With its defaults, `shardlab train` prints the loss every few steps and the loss falls
    clearly: the counting data (models.counting_batch) is learnable, unlike random tokens."""
    out = subprocess.run([sys.executable, "-m", "shardlab", "train"], env=_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=slowdown(120))
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split("loss")[1].split()[0]) for line in out.stdout.splitlines() if " loss " in line]
    assert len(losses) >= 5, out.stdout  # every few steps, not only the last
    assert abs(losses[0] - math.log(128)) < 0.2  # starts at chance over the tiny GPT's 128 tokens
    assert losses[-1] < 0.6 * losses[0], f"the loss did not fall clearly: {losses}"


def test_two_nodes_on_loopback_match_one_node(tmp_path):
    one, two = tmp_path / "1x4.pt", tmp_path / "2x2.pt"
    [single] = _run([subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "4", *TRAIN, "--save", str(one)],
        env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)])

    # Two agents = two "nodes"; the c10d store lives on the first to reach the endpoint.
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", f"shardlab-test-{os.getpid()}",
         "--local-addr", "127.0.0.1", *TRAIN, "--save", str(two)],
        env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)]
    outs = _run(nodes)

    multi = [out for out in outs if "weights checksum" in out]  # rank 0 prints, on one node
    assert len(multi) == 1, "exactly one node should hold global rank 0"
    assert "4 rank(s) on gloo" in single and "4 rank(s) on gloo" in multi[0]
    assert _checksum(single) == _checksum(multi[0])
    a, b = _load(one), _load(two)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between 1x4 and 2x2"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (run on the workshop cluster: see workshop/README.md)")
def test_nccl_on_gpus_matches_gloo_on_cpu(tmp_path):
    """The instructor's path: NCCL on cuda:LOCAL_RANK gives the weights gloo gives on CPU."""
    gpu, cpu = tmp_path / "gpu.pt", tmp_path / "cpu.pt"
    for backend, path in (("nccl", gpu), ("gloo", cpu)):
        _run([subprocess.Popen(
            [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *TRAIN, "--backend", backend,
             "--save", str(path)],
            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)])
    a, b = _load(gpu), _load(cpu)
    for name in a:  # different kernels, so close rather than bit-identical
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_destroy_process_group_stops_gloos_threads():
    """Regression: creating an optimizer imports torch._dynamo, which, imported after the group
    exists, holds the group past destroy_process_group; its gloo threads then die only in the C++
    static destructors at exit, which aborted a rank now and then ("terminate called without an
    active exception"). launch.init_rank imports it first; destroying the group stops the threads."""
    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from shardlab.launch import init_rank
        threads = lambda: [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        init_rank(0, 1, dist.HashStore(), "gloo", 30, 1)
        p = torch.nn.Parameter(torch.ones(3))
        torch.optim.AdamW([p])                     # what every training script does
        import time
        deadline = time.monotonic() + 30           # threads take their names once running
        while not any("gloo" in t for t in threads()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("gloo" in t for t in threads()), threads()
        dist.destroy_process_group()
        print("left:", [t for t in threads() if "gloo" in t])
        """)
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                          timeout=slowdown(120))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "left: []" in done.stdout, done.stdout
