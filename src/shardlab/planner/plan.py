"""How to train: a :class:`Plan` (stage, batch per GPU, checkpointing, prefetch, recipe) and over
how many GPUs it splits the model states (:func:`sharding_degree`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlab.instruments import memory_math, stages

PLANS = ("ddp", "zero1", "zero2", "zero3", "hsdp")
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Plan:
    """How to train: the stage, HSDP's shard group, activation checkpointing, the batch per GPU."""

    stage: str = "zero3"
    micro_batch: int = 1
    grad_accum: int = 1
    checkpointing: str = "none"
    prefetch: bool = True
    shard_group: int = 8  # HSDP only: ZeRO-3 inside groups of this many GPUs, replicas across
    recipe: str = "mixed-adam"

    def __post_init__(self):
        stage = "hsdp" if str(self.stage).lower() == "hsdp" else stages.stage(self.stage).name
        object.__setattr__(self, "stage", stage)
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
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
