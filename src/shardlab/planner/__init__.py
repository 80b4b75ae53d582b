"""The planner: memory per GPU and step time of DDP, ZeRO-1/2/3 and HSDP, from 8 to 4096 GPUs.

Everything the course measures runs on a few CPU ranks, where sharding never runs out of
memory and a gather costs little. The planner asks the same questions at cluster scale, with
the course's own formulas, so a learner can check each answer against a published run
(``tests/test_planner_published.py``) and against this machine (:mod:`shardlab.bench.planner_calibrate`)::

    from shardlab.planner import Plan, cluster, model, predict
    p = predict(model("70b"), cluster("h100", 256, "ib-ndr"), Plan("zero3", micro_batch=1))
    p.memory.total / 2**30, p.timing.step_s, p.timing.tflops_per_gpu

Read it in this order:

1. ``transformer.py``: the model (:class:`Transformer`), by name, shape or ``config.json``;
2. ``hardware.py``: GPUs, networks and a :class:`GPUCluster`;
3. ``plan.py``: how to train (:class:`Plan`);
4. ``memory.py``: bytes per GPU;
5. ``compute.py``, ``roofline.py``, ``network_model.py`` and ``step.py``: a step's FLOPs, their
   time (one fraction of peak, or each kernel against the roofline), the bus NCCL gives a
   collective (``--network-model nccl``), and the step replayed on two clocks;
6. ``anchors.py``: the knee and the bytes per parameter other material quotes, recomputed;
7. ``report.py``, ``cli.py`` (``python -m shardlab plan``) ``published.py`` and ``published_network.py`` (the runs it is checked on).

Every answer is a formula's value, not a measurement: notebook 08 sets it beside published runs.
Left out, on purpose: the optimizer step, kernel launch gaps, stragglers, tensor / pipeline
parallelism (so no pipeline bubble), and how well one implementation overlaps compared with
another. That last one is where published runs differ most (see notebook 08).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlab.instruments.memory_math import STAGES
from shardlab.planner.compute import ACHIEVABLE_FRACTION, step_flops, unit_flops
from shardlab.planner.groups import groups
from shardlab.planner.hardware import GPU, GPUS, GPUCluster, cluster, gpu, network
from shardlab.planner.memory import Memory, korthikanti_layer_bytes, memory, plan_state_bytes
from shardlab.planner.plan import CHECKPOINTING, PLANS, Plan, sharding_degree
from shardlab.planner.step import Timing, step_time
from shardlab.planner.transformer import MODELS, Transformer, model, need_transformer

__all__ = ["ACHIEVABLE_FRACTION", "CHECKPOINTING", "GPU", "GPUS", "MODELS", "PLANS", "GPUCluster", "Memory",
           "Plan", "Prediction", "Timing", "Transformer", "candidates", "cluster", "compare", "gpu", "groups",
           "korthikanti_layer_bytes", "memory", "model", "network", "plan_state_bytes", "predict",
           "sharding_degree", "step_flops", "step_time", "unit_flops"]


@dataclass(frozen=True)
class Prediction:
    """One plan's answer: its memory per GPU and its step time, with what it was asked."""

    model: Transformer
    cluster: GPUCluster
    plan: Plan
    memory: Memory
    timing: Timing
    notes: list = field(default_factory=list)


def predict(model_: Transformer, cluster_: GPUCluster, plan: Plan, *, fraction: float = ACHIEVABLE_FRACTION,
            compute: str = "fraction", **network) -> Prediction:
    """Memory per GPU and step time of one plan (``compute``: "fraction" or "roofline"; ``network``,
    ``bucket_mb``, ``overlap_efficiency``: the network model, see :func:`step_time`)."""
    m = need_transformer(model_)
    timing = step_time(m, cluster_, plan, fraction=fraction, compute=compute, **network)
    return Prediction(m, cluster_, plan, memory(m, cluster_, plan), timing)


def candidates(cluster_: GPUCluster, plan: Plan) -> list[Plan]:
    """``plan`` at every stage, least sharded first, HSDP with a node as its shard group."""
    out = [plan.with_(stage=s) for s in STAGES]
    if cluster_.nodes > 1:
        out.insert(3, plan.with_(stage="hsdp", shard_group=min(cluster_.gpus_per_node, cluster_.gpus)))
    return out


def compare(model_: Transformer, cluster_: GPUCluster, plan: Plan, *, fraction: float = ACHIEVABLE_FRACTION,
            compute: str = "fraction", **network) -> dict:
    """Every stage with the same batch and checkpointing: which first fits, which is fastest that fits."""
    preds = [predict(model_, cluster_, p, fraction=fraction, compute=compute, **network)
             for p in candidates(cluster_, plan)]
    fitting = [p for p in preds if p.memory.fits]
    return {"predictions": preds,
            "first_fit": fitting[0] if fitting else None,
            "fastest": min(fitting, key=lambda p: p.timing.step_s) if fitting else None}
