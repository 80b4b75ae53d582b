"""Memory per GPU of a plan: model states, activations, and at ZeRO-3 / HSDP the gathered units.

**Memory per GPU** = model states (:func:`memory_math.model_state_bytes`, the ZeRO paper) +
activations (Korthikanti et al. 2022, §4: ``s·b·h·(34 + 5·a·s/h)`` bytes a layer without
recompute, ``34·s·b·h`` with selective recompute, ``2·s·b·h`` with full, plus one layer's
``34·s·b·h`` while backward recomputes it) + the fp32 logits the loss keeps (``4·s·b·V``) + at
ZeRO-3 the gathered units (the root stays gathered, plus one or two blocks and a block's
gradient: :func:`memory_math.gathered_unit_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.instruments import memory_math
from shardlab.planner.hardware import GPUCluster
from shardlab.planner.plan import Plan, sharding_degree
from shardlab.planner.transformer import Transformer, need_transformer


def korthikanti_layer_bytes(model: Transformer, micro_batch: int, checkpointing: str = "none",
                            attention: str = "eager") -> float:
    """Activation bytes one layer keeps for backward (Korthikanti et al. 2022, eq. 1 and §5).

    ``s·b·h·(34 + 5·a·s/h)`` with 16-bit activations and 1-byte dropout masks, no tensor
    parallelism: 34·s·b·h for the matmul and norm inputs, 5·a·s²·b for the attention scores,
    their softmax and dropout. Selective recompute drops the attention part (recomputed in
    backward); full recompute keeps only the layer's input, 2·s·b·h.

    ``attention="fused"`` (SDPA, FlashAttention: what every current stack runs) never stores the
    scores, so "none" keeps 34·s·b·h too and selective recompute has nothing left to drop. The
    paper's own count, the default here, is ``"eager"``. (The course's own count for its GPT,
    ``memory_math.activation_bytes``, is 16 elements = 32 bytes of s·b·h without dropout masks
    and with a fused attention.)
    """
    s, b, h, a = model.seq, micro_batch, model.hidden, model.heads
    if checkpointing == "full":
        return 2 * s * b * h
    if checkpointing == "selective" or attention == "fused":
        return 34 * s * b * h
    return s * b * h * (34 + 5 * a * s / h)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU, by kind, against the card."""

    model_states: float
    activations: float
    gathered: float
    card: float

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.gathered

    @property
    def fits(self) -> bool:
        return self.total <= self.card

    def parts(self) -> dict[str, float]:
        return {"model states": self.model_states, "activations": self.activations, "gathered units": self.gathered}


def plan_state_bytes(params, gpus: int, plan: Plan) -> float:
    """Per-GPU model states of a plan (HSDP: ZeRO-3's over its shard group), by its recipe."""
    n = sharding_degree(plan, gpus)
    return memory_math.model_state_bytes(params, n, plan.recipe)[plan.row.name]


def memory(model: Transformer, cluster: GPUCluster, plan: Plan) -> Memory:
    """Memory per GPU: model states + activations (+ logits) + gathered units at ZeRO-3 / HSDP."""
    m, r = need_transformer(model), memory_math.recipe(plan.recipe)
    states = plan_state_bytes(m.params, cluster.gpus, plan)
    acts = m.layers * korthikanti_layer_bytes(m, plan.micro_batch, plan.checkpointing, plan.attention)
    if plan.checkpointing == "full":  # backward recomputes one layer at a time, and keeps all of it
        acts += korthikanti_layer_bytes(m, plan.micro_batch, "none", plan.attention)
    acts += 4 * m.seq * plan.micro_batch * m.vocab  # fp32 log-softmax the loss keeps (as memory_math counts)
    gathered = 0.0
    if plan.row.shards_params:
        gathered = m.root_params * r.param_bytes + memory_math.gathered_unit_bytes(
            m.block_params, r, prefetch=plan.prefetch, include_grad=True)
    return Memory(states, acts, gathered, cluster.gpu.memory_bytes)
