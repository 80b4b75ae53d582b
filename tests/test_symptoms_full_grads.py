"""``symptoms.accumulate``'s ``grads``: the whole reduced gradient, assembled from every rank's shard.

Notebook 09 compares ``no_sync`` with syncing every micro-batch on this gradient, so its shards
must come back in the right places: at stage 3, where each rank holds a shard of a padded flat
buffer (3 ranks: Ψ is not a multiple of 3, so the padding is there), it must equal stage 0's,
where every rank holds the whole all-reduced gradient and nothing is gathered.
"""

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
