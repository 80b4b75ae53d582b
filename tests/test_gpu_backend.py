"""Which backend the ranks join, decided on CPU with the GPU count mocked.

What these tests show: the decision (``auto`` -> gloo without a GPU per rank, ``cpu:gloo,cuda:nccl``
with one), each rank's device and start-up line, the clear error for NCCL without enough GPUs,
and, on real ranks, that a process group built from a device map ("cpu:gloo,cuda:gloo", the
only map a CPU-only torch can build) carries the CPU tensors every notebook uses.

What only a GPU can show: that NCCL really joins (this machine's torch has no NCCL built in),
that CUDA tensors cross it while CPU tensors cross gloo in the same group, and that notebooks
00-05, 07 and the labs pass there. ``workshop/gpu_check.py --record`` checks all three on the
first GPU node (workshop/README.md, step 1).
"""

from __future__ import annotations

import pytest
import torch
from support import slowdown

from shardlab import launch
from shardlab.cluster.core import Cluster, _pick_backend
from shardlab.cluster.on_rank import gpu_index


@pytest.mark.parametrize("gpus, ranks, expected", [
    (0, 4, "gloo"),                   # a laptop
    (2, 4, "gloo"),                   # fewer GPUs than ranks: every rank on CPU, none shares a GPU
    (4, 4, "cpu:gloo,cuda:nccl"),     # a GPU per rank: CPU tensors over gloo, CUDA ones over NCCL
    (8, 4, "cpu:gloo,cuda:nccl"),
    (1, 1, "cpu:gloo,cuda:nccl"),
])
def test_auto_picks_gloo_or_the_mixed_group_by_the_gpu_count(gpus, ranks, expected):
    assert launch.pick_backend("auto", ranks, gpus) == expected
    assert _pick_backend("auto", ranks, gpus=gpus) == expected


def test_the_gpu_count_comes_from_cuda_when_not_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch.gpu_count() == 4
    assert launch.pick_backend("auto", 4) == launch.GPU_BACKEND
    assert launch.pick_backend("auto", 5) == "gloo"
    # and the Cluster decides the same before it starts anything
    assert Cluster(4, "auto", max_ranks_per_core=64).backend == launch.GPU_BACKEND


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("gpus", [0, 3])
def test_nccl_without_a_gpu_per_rank_is_a_clear_error(backend, gpus):
    with pytest.raises(RuntimeError, match=rf"one GPU per rank: 4 rank\(s\) .* {gpus} CUDA device\(s\).*backend='gloo'"):
        launch.pick_backend(backend, 4, gpus)
    with pytest.raises(RuntimeError, match="one GPU per rank"):
        _pick_backend(backend, 4, gpus=gpus)


def test_explicit_choices_are_kept_and_nonsense_is_refused():
    assert launch.pick_backend("gloo", 4, 8) == "gloo"
    assert launch.pick_backend("nccl", 4, 4) == "nccl"
    for bad in ("mpi", "cpu:nccl,cuda", "tpu:gloo", ""):
        with pytest.raises(ValueError, match="backend must be"):
            launch.pick_backend(bad, 2, 2)
    # engines on other machines: their GPUs are not countable here, so no refusal, and auto is gloo
    assert _pick_backend("nccl", 8, engines="slurm", gpus=0) == "nccl"
    assert _pick_backend("auto", 8, engines="slurm", gpus=0) == "gloo"


def test_each_rank_says_its_device_and_which_backend_carries_which_tensors():
    assert launch.carriers("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert launch.device_for("cpu:gloo,cuda:nccl", 2) == torch.device("cuda", 2)
    assert launch.device_for("nccl", 1) == torch.device("cuda", 1)
    assert launch.device_for("gloo", 3) == torch.device("cpu")
    assert launch.device_for("cpu:gloo,cuda:gloo", 3) == torch.device("cpu")  # no NCCL: no GPU needed
    assert (launch.describe(0, "cuda:0", "cpu:gloo,cuda:nccl")
            == "[rank 0] cuda:0, gloo for CPU tensors, nccl for CUDA tensors")
    assert launch.describe(3, "cpu", "gloo") == "[rank 3] cpu, gloo for CPU tensors"


def test_a_kernel_inside_a_slurm_job_gives_rank_r_cuda_r():
    """A notebook inside `sbatch workshop/jupyter.sbatch` has the batch step's SLURM_LOCALID=0 in its
    environment, and the engines it starts inherit it: read there, it would put every rank on
    cuda:0 (NCCL refuses two ranks on one GPU). Only engines SLURM placed take their local id."""
    batch_step = {"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_JOB_ID": "4242"}
    assert [gpu_index(r, 4, False, batch_step) for r in range(4)] == [0, 1, 2, 3]
    placed = [{"SLURM_LOCALID": str(r % 4)} for r in range(8)]  # 2 nodes x 4 tasks, engines="slurm"
    assert [gpu_index(r, 4, True, placed[r]) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [gpu_index(r, 1, True, placed[r]) for r in range(8)] == [0] * 8  # --gpus-per-task=1: each sees one


def test_the_clusters_repr_says_where_ranks_run():
    c = Cluster(4, "gloo", max_ranks_per_core=64)
    c.pool.devices = [f"cuda:{r}" for r in range(4)]  # what the ranks reported when they joined
    c.backend = launch.GPU_BACKEND  # as on a 4-GPU node
    assert "rank r on cuda:r, gloo for CPU tensors, nccl for CUDA tensors" in repr(c)
    c.pool.devices = ["cpu"] * 4
    c.backend = "gloo"
    assert "ranks on cpu, gloo for CPU tensors" in repr(c)


def test_a_device_map_group_carries_the_notebooks_cpu_tensors():
    """Real ranks on a group built from a device map, the same code path as cpu:gloo,cuda:nccl
    on a GPU node, with the collectives the notebooks use on CPU tensors."""
    import shardlab

    with shardlab.start_cluster(2, backend="cpu:gloo,cuda:gloo", quiet=True,
                                timeout=slowdown(20), start_timeout=slowdown(120)) as cluster:
        assert cluster.lines == ["[rank 0] cpu, gloo for CPU tensors, gloo for CUDA tensors",
                                 "[rank 1] cpu, gloo for CPU tensors, gloo for CUDA tensors"]
        cluster.run_cell("from shardlab.engine import comm\n"
                         "full = torch.zeros(4)\n"
                         "comm.all_gather(full, torch.arange(2.) + 2 * rank)\n"
                         "backend = dist.get_backend()")
        assert [f.tolist() for f in cluster.pull("full")] == [[0.0, 1.0, 2.0, 3.0]] * 2
        assert cluster.pull("backend") == ["cpu:gloo,cuda:gloo"] * 2
        # a failure drops the group and the next run rebuilds it with the same device map
        with pytest.raises(Exception, match="on purpose"):
            cluster.run_cell("raise ValueError('on purpose')")
        cluster.run_cell("total = torch.ones(3) * (rank + 1)\ncomm.all_reduce(total)")
        assert [t.tolist() for t in cluster.pull("total")] == [[3.0, 3.0, 3.0]] * 2
