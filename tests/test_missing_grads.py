"""``missing_grads.is_missing`` reads ``-0.0`` from the bits: the same answer as the IEEE test
``(t == 0) & t.signbit()`` for every float width and layout a gradient can have."""

import pytest
import torch

from shardlab.engine.missing_grads import is_missing

VALUES = [-0.0, 0.0, 1.0, -1.0, -1e-30, float("nan"), float("-inf"), float("inf"), -2.0**-149]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_is_missing_is_the_ieee_test_at_every_width_and_layout(dtype):
    flat = torch.tensor(VALUES * 4, dtype=dtype)
    shapes = {
        "flat": flat,
        "zero-dim": flat[0],
        "empty": flat[:0],
        "sliced": flat[1::3],
        "transposed": flat[:36].view(6, 6).t(),
        "expanded": flat[:1].expand(5),
    }
    for name, t in shapes.items():
        assert torch.equal(is_missing(t), (t == 0) & t.signbit()), (dtype, name)
    assert is_missing(torch.tensor(-0.0, dtype=dtype)).item()


def test_integer_tensors_have_no_minus_zero():
    assert not is_missing(torch.tensor([0, -1, 2])).any()
