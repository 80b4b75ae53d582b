"""``symptoms.accumulate``'s ``grads``: the whole reduced gradient, assembled from every rank's shard.

Notebook 09 compares ``no_sync`` with syncing every micro-batch on this gradient, so its shards
must come back in the right places: at stage 3, where each rank holds a shard of a padded flat
buffer (3 ranks: Ψ is not a multiple of 3, so the padding is there), it must equal stage 0's,
where every rank holds the whole all-reduced gradient and nothing is gathered.
"""

import pytest
import torch
from support import slowdown

from shardlab.course import symptoms
from shardlab.launch import run_ranks


def _both_stages():
    ddp, fsdp = symptoms.accumulate(dict(stage=0)), symptoms.accumulate(dict(stage=3))
    worst = max(((fsdp["grads"][k] - g).abs().max() / g.abs().max()).item() for k, g in ddp["grads"].items())
    shapes = {k: tuple(g.shape) for k, g in fsdp["grads"].items()}
    return worst, list(ddp["grads"]), list(fsdp["grads"]), shapes, {k: tuple(w.shape) for k, w in fsdp["weights"].items()}


def test_the_gathered_gradient_at_stage_3_is_the_all_reduced_one_of_stage_0():
    out = run_ranks(_both_stages, 3, timeout=slowdown(180))
    for worst, ddp_keys, fsdp_keys, shapes, weight_shapes in out:
        assert ddp_keys == fsdp_keys == list(weight_shapes)     # every trainable tensor, in state_dict order
        assert shapes == weight_shapes                          # whole tensors, not shards
        assert worst < 1e-5                                     # the same sums, up to fp32 rounding


class _Block(torch.nn.Module):
    """8 weights, 4 of them (``u``) unused when ``spare``: at 2 ranks the unit's padded flat
    buffer is 8, and rank 1's shard is ``u`` alone."""

    def __init__(self, spare: bool):
        super().__init__()
        self.spare = spare
        self.w, self.u = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))

    def forward(self, h):
        return h * self.w if self.spare else h * self.w + self.u


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(spare=True), _Block(spare=False)])

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return h.square().sum()


def _grads_with_a_shard_no_rank_used(stage: int):
    import shardlab

    torch.manual_seed(0)
    reference = _Net()
    reference(torch.ones(4)).backward()
    expected = {k: p.grad for k, p in reference.named_parameters() if p.grad is not None}
    torch.manual_seed(0)
    model, optimizer = shardlab.parallelize(_Net(), stage=stage, optimizer_cls=torch.optim.SGD, lr=0.0)
    model(torch.ones(4)).backward()  # the same batch on every rank: the mean is the reference's
    optimizer.step()
    here = [unit.master.grad is None for unit in symptoms.engine_of(model).units]
    with shardlab.count_comm() as ledger:  # bookkeeping after the step: no unit's traffic
        grads = symptoms._full_grads(model)
    units = [r["unit"] for r in ledger.records]
    return here, {k: g.shape for k, g in grads.items()}, \
        max((grads[k] - g).abs().max().item() for k, g in expected.items() if k in grads), list(expected), units


@pytest.mark.parametrize("stage", [2, 3])
def test_a_shard_no_rank_gave_a_gradient_is_gathered_on_every_rank_and_left_out(stage):
    """blocks.0.u is unused: rank 1's shard of blocks.0 is u alone, so its master gradient is None
    there and not on rank 0. Every rank must still take part in that unit's all-gather (else the
    gathers pair across units, or hang); the param no rank gave a gradient is left out."""
    out = run_ranks(_grads_with_a_shard_no_rank_used, 2, stage, timeout=slowdown(60))
    (none_0, *_), (none_1, *_) = out
    assert none_0[:1] == [False] and none_1[:1] == [True]  # the case: None on rank 1 only
    for _, shapes, worst, expected, units in out:
        assert units == [None, None]  # one gather per unit, booked as no unit's
        assert list(shapes) == expected == ["blocks.0.w", "blocks.1.w", "blocks.1.u"]
        assert all(shape == (4,) for shape in shapes.values())
        assert worst < 1e-6
