"""Bring your own optimizer (issue 8 §3): the FSDP2 habit at stage 3, a clear error at 1-2."""

from __future__ import annotations

import own_optimizer_workers as ow
import torch
from support import slowdown

from shardlab.launch import run_ranks


def test_fsdp2_loop_equals_the_returned_optimizer_bit_for_bit():
    """torch.optim.AdamW(model.parameters()) at stage 3 steps the same elements with the same
    arithmetic as the returned optimizer (one tensor per parameter piece too), so equal."""
    configs = [dict(), dict(optimizer="sgd"), dict(clip=0.05), dict(mixed_precision=torch.bfloat16)]
    for per_rank in run_ranks(ow.fsdp2_loop_vs_returned, 3, configs, timeout=slowdown(180)):
        for cfg, (returned, own) in zip(configs, per_rank):
            assert all(torch.equal(returned[k], own[k]) for k in returned), cfg
            start = ow.make_model("gpt", 0).state_dict()
            assert not torch.equal(own["head.weight"], start["head.weight"]), cfg  # it trained


def test_stage3_grads_are_this_ranks_piece_of_the_mean_gradient():
    for mixed in (None, torch.bfloat16):
        per_rank = run_ranks(ow.grads_after_backward, 3, mixed, timeout=slowdown(120))
        for name in per_rank[0]:
            rows = [r[name] for r in per_rank]
            assert sum(row["param_shape"][0] for row in rows) == rows[0]["full_numel"], name  # pieces tile it
            for row in rows:
                assert row["param_dtype"] == torch.float32  # at rest: the fp32 master's piece
                assert row["grad"] is not None, name  # every param gets one, an empty piece too
                if row["param_shape"] == (0,):  # a rank holding no element of this parameter
                    assert row["grad"].shape == (0,) and row["grad"].dtype == torch.float32, name
                    continue
                assert row["grad"].shape == row["param_shape"] and row["grad"].dtype == torch.float32, name
                tol = 1e-6 if mixed is None else 2e-2 * row["expected"].abs().max().item() + 1e-6
                assert torch.allclose(row["grad"], row["expected"], atol=tol), (name, mixed)


def test_a_user_optimizer_that_would_train_nothing_raises():
    for errors in run_ranks(ow.user_optimizer_errors, 2, timeout=slowdown(120)):
        for label in ("stage 1", "stage 2", "stage 0 bf16"):
            message, _ = errors[label]
            assert "optimizer shardlab.parallelize returned" in message and "train nothing" in message, label
        for label in ("stage 0", "stage 3"):
            message, trained = errors[label]
            assert message == "no error" and trained, label


def test_memory_report_counts_every_byte_once_with_either_optimizer():
    for returned, own, layout in run_ranks(ow.memory_with_each_optimizer, 3, timeout=slowdown(120)):
        for category in ("params", "grads", "gathered", "frozen", "buffers"):
            assert returned[category] == own[category], category  # p and p.grad are views: no new bytes
        assert returned["params"] == 4 * layout["shard"]
        # AdamW: two fp32 moments per element it steps, plus one 4-byte step per tensor. Both step
        # one tensor per parameter piece, so no padding; the returned optimizer skips empty pieces,
        # yours steps them too (each has its empty gradient), so it keeps a step per parameter
        assert returned["optimizer"] == 8 * layout["real"] + 4 * layout["pieces"]
        assert own["optimizer"] == 8 * layout["real"] + 4 * layout["params"]
        for report in (returned, own):
            assert report["total"] == sum(v for k, v in report.items() if k not in ("total", "padding"))
