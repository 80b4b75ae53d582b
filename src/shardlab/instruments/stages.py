"""What each stage shards and what it sends: one torch-free table, read by everything that asks.

The engine says the same thing with class attributes (``shards_optimizer_state``,
``reduce_as_ready``, ``shards_params`` on ``engine/ddp.py`` … ``zero3.py``);
``tests/test_stages_table.py`` checks that the two agree. The formulas (``memory_math``), the
planner (``shardlab.planner``) and the bench (``bench/configs.py``) read this table instead of
testing stage names, so a stage's behaviour is written down once.

A stage's columns, in the ZeRO paper's words: P_os shards the optimizer state, P_g the
gradients, P_p the parameters. ``collectives`` are the elements each rank moves per step, in
multiples of Ψ, as the paper counts them (an all-reduce is a reduce-scatter and an all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One row: a stage's name, number, label, what it shards, and its collectives per step."""

    name: str
    number: int
    label: str
    shards_optimizer_state: bool  # P_os (ZeRO-1 and up)
    shards_grads: bool  # P_g (ZeRO-2 and up): each unit's gradient is reduce-scattered as soon as it is ready
    shards_params: bool  # P_p (ZeRO-3): a unit is gathered before it runs and freed after
    collectives: tuple[tuple[str, int], ...]

    @property
    def reduce_as_ready(self) -> bool:
        """Reduce each unit during backward (DDP's buckets, ZeRO-2/3); ZeRO-1 waits for the whole backward."""
        return self.shards_grads or not self.shards_optimizer_state

    @property
    def reduces_every_micro_batch(self) -> bool:
        """Under gradient accumulation: a sharded gradient has nowhere to add up whole, so ZeRO-2/3
        reduce after every micro-batch; DDP and ZeRO-1 keep full gradients and reduce once a step."""
        return self.shards_grads

    @property
    def gathers_params_after_step(self) -> bool:
        """ZeRO-1/2 all-gather the updated parameter shards after the optimizer step."""
        return self.shards_optimizer_state and not self.shards_params


STAGES = {s.name: s for s in (
    Stage("ddp", 0, "DDP", False, False, False, (("all_reduce grads", 2),)),
    Stage("zero1", 1, "ZeRO-1", True, False, False, (("reduce_scatter grads", 1), ("all_gather params", 1))),
    Stage("zero2", 2, "ZeRO-2", True, True, False, (("reduce_scatter grads", 1), ("all_gather params", 1))),
    Stage("zero3", 3, "ZeRO-3", True, True, True,
          (("all_gather fwd", 1), ("all_gather bwd", 1), ("reduce_scatter grads", 1))),
)}
NAMES = tuple(STAGES)


def stage(stage_) -> Stage:
    """A row by number (0-3) or name ('ddp', 'zero1', 'ZeRO-2', 'zero-3', 'fsdp'; a Stage passes through)."""
    if isinstance(stage_, Stage):
        return stage_
    if isinstance(stage_, int) and not isinstance(stage_, bool) and 0 <= stage_ <= 3:
        return STAGES[NAMES[stage_]]
    key = str(stage_).lower().replace("-", "").replace("_", "")
    key = {"dp": "ddp", "0": "ddp", "1": "zero1", "2": "zero2", "3": "zero3", "fsdp": "zero3"}.get(key, key)
    if key not in STAGES:
        raise ValueError(f"unknown stage {stage_!r}; use 0-3 or one of {NAMES}")
    return STAGES[key]
