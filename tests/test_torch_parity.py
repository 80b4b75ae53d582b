"""ShardLab equals PyTorch's own implementations on the same model and data."""

from __future__ import annotations

import pytest
import torch_workers
from support import slowdown
from test_engine_parity import FP32_TOL, max_diff

from shardlab.launch import run_ranks

PAIRS = [
    ("stage 0 vs DDP", dict(stage=0), dict(system="ddp")),
    ("stage 1 vs DDP + ZeroRedundancyOptimizer", dict(stage=1), dict(system="ddp+zero")),
    ("stage 3 vs fully_shard", dict(stage=3), dict(system="fully_shard")),
    ("stage 3 kept weights vs fully_shard(reshard_after_forward=False)",
     dict(stage=3, reshard_after_forward=False), dict(system="fully_shard", reshard_after_forward=False)),
    ("DDP + shardlab.ShardedOptimizer vs stage 1",
     dict(stage=1), dict(system="ddp+sharded_optimizer")),
]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_matches_pytorch(optimizer, parity_log):
    world_size = 3  # uneven: every flat buffer and every FSDP2 shard is padded
    pairs = [({**ours, "optimizer": optimizer}, {**theirs, "optimizer": optimizer}) for _, ours, theirs in PAIRS]
    results = run_ranks(torch_workers.shardlab_and_torch, world_size, pairs, timeout=slowdown(240))
    for (label, _, _), (ours, theirs) in zip(PAIRS, results[0]):
        diff = max_diff(ours, theirs)
        parity_log(f"ws=3 {optimizer:5} {label}", diff)
        assert diff < FP32_TOL, (label, diff)
