"""The numbers other material quotes, recomputed by the planner with their assumptions named.

Two kinds a learner meets elsewhere and should find explained here:

* **The knee** (:func:`knee`): the tokens per GPU per micro-batch below which a data-parallel
  step's communication cannot hide under its compute. For DDP and FSDP the backward pass does
  4 FLOPs per parameter per token (6 with full recompute) while the ring moves a few bytes per
  parameter, so communication hides when ``tokens ≥ m·C/W × (bytes per parameter / 4) ×
  (N−1)/N``, with C the GPU's peak, m the fraction of it reached, W the ring's bus bandwidth.
  "How to Scale Your Model" (ch. 12, bf16 gradients, m = 1) prints C/W: **2,200** tokens per
  H100 inside a node, **2,475** across nodes. Those are the book's published figures, quoted as
  such; the planner's formula is the same with its own m, W and reduce dtype. Latency is not
  in it: at 512+ GPUs the ring's (N−1)·α grows, the replay (``step.py``) counts it and the
  book's formula does not, so the planner's knee sits above the book's there. ZeRO-1 has no
  knee: it reduces after the whole backward (as the engine does), so its reduction never hides.
* **Bytes per parameter** (:func:`bytes_per_param`): 10, 16, 18, 20 and DeepSpeed's 2 + 18/N,
  each from a recipe of weights, gradients and optimizer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlab.instruments import memory_math
from shardlab.instruments.measured import Published
from shardlab.planner.compute import ACHIEVABLE_FRACTION
from shardlab.planner.groups import groups
from shardlab.planner.hardware import GPUCluster
from shardlab.planner.plan import Plan, sharding_degree

#: "How to Scale Your Model" (Austin et al., jax-ml/scaling-book), ch. 12 "How to Think About GPUs":
#: C / W for an H100 at full peak, bf16 (990e12 / 450e9 inside a node, 990e12 / 400e9 across).
BOOK_KNEE_H100 = {span: Published(tokens, source="Austin et al., How to Scale Your Model, ch. 12")
                  for span, tokens in (("inside a node", 2200), ("across nodes", 2475))}


@dataclass(frozen=True)
class Knee:
    tokens: float  # the planner's knee, tokens per GPU per micro-batch; inf where nothing can hide
    formula: str  # how it was computed, with its numbers
    tokens_per_micro_batch: float  # what this plan runs
    book: float | None  # the book's published C/W for this card and span, or None (not an H100)
    book_span: str

    @property
    def hides(self) -> bool:
        return self.tokens_per_micro_batch >= self.tokens


def _backward_bytes_per_param(plan: Plan, param_bytes: int) -> float:
    """Bytes per parameter each GPU's ring moves while backward runs (before the (N−1)/N factor)."""
    row = plan.row
    reduce = plan.reduce_bytes * (1 if row.shards_optimizer_state else 2)  # DDP's all-reduce is RS + AG
    return reduce + (param_bytes if row.shards_params else 0)  # ZeRO-3 regathers every unit in backward


def knee(tokens_per_micro_batch: int, cluster: GPUCluster, plan: Plan, *, fraction: float = ACHIEVABLE_FRACTION) -> Knee:
    """The planner's knee for ``plan`` on ``cluster``, beside the book's figure (see the module docstring).

    ``tokens_per_micro_batch``: the tokens of one micro-batch (micro-batch × sequence).
    """
    shard, _ = groups(cluster, plan)
    n = sharding_degree(plan, cluster.gpus)
    bus = shard.bandwidth_gbps * 1e9 / 8  # bytes/s
    flops = 6 if plan.checkpointing == "full" else 4  # backward FLOPs per parameter per token
    moved = _backward_bytes_per_param(plan, memory_math.recipe(plan.recipe).param_bytes)
    tokens = fraction * cluster.gpu.peak_flops / bus * moved / flops * (n - 1) / max(n, 1)
    formula = (f"m·C/W × ({moved:g} B moved / {flops} FLOPs, per parameter per token) × (N−1)/N = {fraction:g} × {cluster.gpu.peak_flops / 1e12:.0f} TFLOPS"
               f" / {bus / 1e9:.0f} GB/s × {moved / flops:.2f} × {n - 1}/{n}")
    span = "inside a node" if cluster.nodes == 1 or n <= cluster.gpus_per_node else "across nodes"
    book = BOOK_KNEE_H100[span] if cluster.gpu.name in ("h100", "h200") else None
    if not plan.row.reduce_as_ready:  # ZeRO-1: nothing is reduced while backward runs
        formula = (f"none: {plan.stage} reduces after the whole backward (stages.reduce_as_ready is False, "
                   "as in the engine), so no backward compute hides its reduce-scatter at any batch")
        return Knee(math.inf, formula, tokens_per_micro_batch, book, span)
    return Knee(tokens, formula, tokens_per_micro_batch, book, span)


@dataclass(frozen=True)
class BytesRow:
    source: str
    assumption: str
    published: str  # as the source prints it
    recomputed: float  # bytes per parameter, by the planner's formulas


def bytes_per_param(gpus: int = 64) -> list[BytesRow]:
    """The bytes per parameter that the anchors quote, each recomputed from its recipe (DeepSpeed's at ``gpus``)."""
    Recipe = memory_math.Recipe
    rows = [
        ("How to Scale Your Model", "bf16 weights, fp32 Adam moments; no master copy, no gradient", "10",
         Recipe("book", 2, 0, 8)),
        ("ZeRO paper (K = 12)", "bf16 weights and grads; fp32 master, momentum, variance", "16",
         memory_math.RECIPES["mixed-adam"]),
        ("ShardLab's engine", "bf16 weights, gradients kept and reduced in fp32, fp32 master and moments", "18",
         Recipe("shardlab", 2, 4, 12)),
        ("Ultra-Scale Playbook", "ZeRO's 16 plus an fp32 gradient accumulation buffer", "20",
         memory_math.RECIPES["bf16-fp32-grads"]),
    ]
    out = [BytesRow(src, why, pub, float(r.bytes_per_param)) for src, why, pub, r in rows]
    ds = memory_math.deepspeed_estimate(10**9, gpus, 2) / 10**9
    out.append(BytesRow("DeepSpeed's ZeRO-2 estimator", f"2 fp16 weights replicated + 18/N sharded "
                        f"(2 fp16 + 4 fp32 grads, 4 master, 8 Adam), N = {gpus}", "2 + 18/N", ds))
    return out
