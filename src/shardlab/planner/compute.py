"""A step's FLOPs, and how fast a GPU runs them.

Compute takes FLOPs / (``ACHIEVABLE_FRACTION`` × peak): one efficiency number for every GPU,
model and micro-batch (see notebook 08 for where that is wrong).
"""

from __future__ import annotations

from shardlab.planner.plan import Plan
from shardlab.planner.transformer import Transformer

#: The one efficiency number: the fraction of a GPU's dense bf16 peak that a large transformer's
#: matmuls reach. Round, and set from the range well-tuned large runs report (40-60% of peak:
#: Megatron-LM's PTD-P 44-52% on A100, Narayanan et al. 2021, Table 1; Llama 3 38-43% on H100,
#: Dubey et al. 2024). It is the same for every GPU and every case; it is never fitted to one.
ACHIEVABLE_FRACTION = 0.5


def unit_flops(model: Transformer, micro_batch: int) -> dict[str, float]:
    """Forward FLOPs of one micro-batch: a block's and the root's (the output head).

    A block: 2 FLOPs per weight per token for its matmuls, plus 4·b·s²·h for attention's two
    batched matmuls (Narayanan et al. 2021, eq. 3, which counts the full s×s; h is the query
    width, heads × head size, which is the hidden size unless a config gives ``head_dim``).
    Backward costs twice its forward.
    """
    tokens = micro_batch * model.seq
    attention = 4 * micro_batch * model.seq**2 * model.q_dim
    return {"block": 2 * model.block_matmul_params * tokens + attention, "attention": attention,
            "root": 2 * model.vocab * model.hidden * tokens}


def recompute_flops(model: Transformer, plan: Plan) -> float:
    """Forward FLOPs a block's backward redoes: none, attention (selective), or the block (full).

    With fused attention selective recompute has nothing to redo: the kernel keeps no scores
    (its own recompute of them inside backward is part of the kernel, not counted here)."""
    f = unit_flops(model, plan.micro_batch)
    selective = 0.0 if plan.attention == "fused" else f["attention"]
    return {"none": 0.0, "selective": selective, "full": f["block"]}[plan.checkpointing]


def step_flops(model: Transformer, plan: Plan) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per GPU per step; hardware adds what recompute redoes."""
    f = unit_flops(model, plan.micro_batch)
    model_flops = 3 * (model.layers * f["block"] + f["root"])
    return plan.grad_accum * model_flops, plan.grad_accum * (model_flops + model.layers * recompute_flops(model, plan))
