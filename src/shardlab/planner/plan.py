"""How to train: a :class:`Plan` (stage, batch per GPU, checkpointing, prefetch, recipe) and over
how many GPUs it splits the model states (:func:`sharding_degree`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlab.instruments import memory_math, stages

PLANS = ("ddp", "zero1", "zero2", "zero3", "hsdp")
CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("fused", "eager")
REDUCE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Plan:
    """How to train: the stage, HSDP's shard group, activation checkpointing, the batch per GPU.

    The defaults are today's common stack (PyTorch FSDP2 / torchtitan), and each is one flag of
    ``python -m shardlab plan`` away from the alternative:

    * ``attention="fused"``: SDPA / FlashAttention keeps no s×s scores for backward; ``"eager"``
      is Korthikanti et al.'s unfused attention, whose scores dominate long sequences.
    * ``reduce_dtype="fp32"``: gradients are reduced in fp32, as ShardLab's engine and
      torchtitan do under bf16 mixed precision; ``"bf16"`` halves those bytes.
    * ``overlap_param_gather=False``: ZeRO-1/2's all-gather of the updated parameters waits
      after the step; ``True`` hides it under the next forward, as Megatron-LM's
      ``--overlap-param-gather`` does.
    * HSDP all-reduces across replicas on the last micro-batch only; in FSDP2 that needs
      ``module.set_requires_all_reduce(False)`` on the other micro-batches.
    """

    stage: str = "zero3"
    micro_batch: int = 1
    grad_accum: int = 1
    checkpointing: str = "none"
    prefetch: bool = True
    shard_group: int = 8  # HSDP only: ZeRO-3 inside groups of this many GPUs, replicas across
    recipe: str = "mixed-adam"
    attention: str = "fused"
    reduce_dtype: str = "fp32"
    overlap_param_gather: bool = False  # ZeRO-1/2 only

    def __post_init__(self):
        stage = "hsdp" if str(self.stage).lower() == "hsdp" else stages.stage(self.stage).name
        object.__setattr__(self, "stage", stage)
        for name, allowed in (("checkpointing", CHECKPOINTING), ("attention", ATTENTION),
                              ("reduce_dtype", tuple(REDUCE_BYTES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("micro_batch", "grad_accum", "shard_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Plan.{name} must be a positive integer, got {value!r}")
        memory_math.recipe(self.recipe)

    @property
    def label(self) -> str:
        base = f"HSDP (shard {self.shard_group})" if self.stage == "hsdp" else self.row.label
        return base + ("" if self.checkpointing == "none" else f", {self.checkpointing} ckpt")

    @property
    def row(self) -> stages.Stage:
        """What this plan shards and sends (:data:`stages.STAGES`): HSDP is ZeRO-3 inside its group."""
        return stages.STAGES["zero3" if self.stage == "hsdp" else self.stage]

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element on the wire when it is reduced."""
        return REDUCE_BYTES[self.reduce_dtype]

    def with_(self, **changes) -> Plan:
        return replace(self, **changes)


def sharding_degree(plan: Plan, gpus: int) -> int:
    """Over how many GPUs the model states are split: all of them, or HSDP's shard group."""
    if plan.stage == "hsdp":
        if plan.shard_group > gpus or gpus % plan.shard_group:
            raise ValueError(f"HSDP's shard group {plan.shard_group} must divide the {gpus} GPUs; "
                             "pick a divisor, e.g. the GPUs of one node")
        return plan.shard_group
    return gpus
