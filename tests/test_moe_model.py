"""The notebook's MoE model: routing is a function of the data, and a skipped expert gets no gradient."""

import pytest
import torch

from shardlab.models import MoE, moe_batch


def test_a_batch_reaches_exactly_its_experts_and_skipped_ones_get_no_grad():
    torch.manual_seed(0)
    model = MoE()
    for experts in ([0], [0, 1], [1, 2], [0, 1, 2]):
        tokens, targets = moe_batch(model, experts, 6, seed=3)
        assert model.experts_used(tokens) == experts
        assert tokens.max() < model.embed.num_embeddings
        model.zero_grad(set_to_none=True)
        ((model(tokens) - targets) ** 2).mean().backward()
        assert model.router.weight.grad is not None and model.router.weight.grad.abs().sum() > 0
        for i, expert in enumerate(model.experts):
            assert (expert.weight.grad is None) == (i not in experts)


def test_moe_batch_is_deterministic_and_rejects_bad_experts():
    model = MoE()
    a, b = moe_batch(model, [0, 2], 8, seed=5), moe_batch(model, [0, 2], 8, seed=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="subset of range"):
        moe_batch(model, [3], 4, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        moe_batch(model, [0, 1, 2], 2, seed=0)
