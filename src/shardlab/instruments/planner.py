"""The planner: memory per GPU and step time of DDP, ZeRO-1/2/3 and HSDP, from 8 to 4096 GPUs.

Everything the course measures runs on a few CPU ranks, where sharding never runs out of
memory and a gather costs little. The planner asks the same questions at cluster scale, with
the course's own formulas, so a learner can check each answer against a published run
(``tests/test_planner_published.py``) and against this machine (:mod:`shardlab.bench.planner_calibrate`)::

    from shardlab.instruments import planner, planner_presets as pp
    p = planner.predict("70b", pp.cluster("h100", 256, "ib-ndr"), planner.Plan("zero3", micro_batch=1))
    p.memory.total / 2**30, p.timing.step_s, p.timing.tflops_per_gpu

**Memory per GPU** = model states (:func:`memory_math.model_state_bytes`, the ZeRO paper) +
activations (Korthikanti et al. 2022, §4: ``s·b·h·(34 + 5·a·s/h)`` bytes a layer without
recompute, ``34·s·b·h`` with selective recompute, ``2·s·b·h`` with full, plus one layer's
``34·s·b·h`` while backward recomputes it) + the fp32 logits the
loss keeps (``4·s·b·V``) + at ZeRO-3 the gathered units (the root stays gathered, plus one or
two blocks and a block's gradient: :func:`memory_math.gathered_unit_bytes`).

**Step time** replays one step, unit by unit, on two clocks: the GPU computes, and the link
carries one collective at a time (what ``emulate_link`` does on this machine, and what one NCCL
stream does on a GPU). Compute takes FLOPs / (``ACHIEVABLE_FRACTION`` × peak). A collective
takes the α-β ring time (:func:`link.link_delay`) at the group's bus bandwidth: NVLink inside a
node; across nodes NCCL's rings share all the node's NICs, so a ring with p GPUs on each node
gets p/G of the node's NIC bandwidth (nccl-tests reach ~90% of that). With prefetch the next
unit's gather runs while this unit computes; reduce-scatters and DDP's all-reduces run while
earlier units compute backward; what cannot hide (the first gather, the last reduce-scatter,
anything slower than compute) is the exposed communication.

Left out, on purpose: the optimizer step, kernel launch gaps, stragglers, tensor / pipeline
parallelism (so no pipeline bubble), and how well one implementation overlaps compared with
another. That last one is where published runs differ most (see notebook 08).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardlab.instruments import memory_math as mm
from shardlab.instruments import planner_presets as pp
from shardlab.instruments.planner_step import GroupLink, Unit, group_link, replay

#: The one efficiency number: the fraction of a GPU's dense bf16 peak that a large transformer's
#: matmuls reach. Round, and set from the range well-tuned large runs report (40-60% of peak:
#: Megatron-LM's PTD-P 44-52% on A100, Narayanan et al. 2021, Table 1; Llama 3 38-43% on H100,
#: Dubey et al. 2024). It is the same for every GPU and every case; it is never fitted to one.
ACHIEVABLE_FRACTION = 0.5

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
        stage = "hsdp" if str(self.stage).lower() == "hsdp" else mm.stage_name(self.stage)
        object.__setattr__(self, "stage", stage)
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
        for name in ("micro_batch", "grad_accum", "shard_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Plan.{name} must be a positive integer, got {value!r}")
        mm.recipe(self.recipe)

    @property
    def label(self) -> str:
        base = f"HSDP (shard {self.shard_group})" if self.stage == "hsdp" else mm.STAGE_LABELS[self.stage]
        return base + ("" if self.checkpointing == "none" else f", {self.checkpointing} ckpt")

    def with_(self, **changes) -> Plan:
        return replace(self, **changes)


# ---------------------------------------------------------------------------------- memory
def korthikanti_layer_bytes(model: pp.Transformer, micro_batch: int, checkpointing: str = "none") -> float:
    """Activation bytes one layer keeps for backward (Korthikanti et al. 2022, eq. 1 and §5).

    ``s·b·h·(34 + 5·a·s/h)`` with 16-bit activations and 1-byte dropout masks, no tensor
    parallelism: 34·s·b·h for the matmul and norm inputs, 5·a·s²·b for the attention scores,
    their softmax and dropout. Selective recompute drops the attention part (recomputed in
    backward); full recompute keeps only the layer's input, 2·s·b·h. (The course's own count
    for its GPT, ``memory_math.activation_bytes``, is 16 elements = 32 bytes of s·b·h without
    dropout masks and with a fused attention that keeps no scores.)
    """
    s, b, h, a = model.seq, micro_batch, model.hidden, model.heads
    if checkpointing == "full":
        return 2 * s * b * h
    if checkpointing == "selective":
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


def sharding_degree(plan: Plan, gpus: int) -> int:
    """Over how many GPUs the model states are split: all of them, or HSDP's shard group."""
    if plan.stage == "hsdp":
        if plan.shard_group > gpus or gpus % plan.shard_group:
            raise ValueError(f"HSDP's shard group {plan.shard_group} must divide the {gpus} GPUs; "
                             "pick a divisor, e.g. the GPUs of one node")
        return plan.shard_group
    return gpus


def model_state_bytes(params, gpus: int, stage) -> float:
    """Per-GPU model states of a stage (HSDP: ZeRO-3's over its shard group), mixed-precision Adam."""
    plan = stage if isinstance(stage, Plan) else Plan(stage)
    n = sharding_degree(plan, gpus)
    return mm.model_state_bytes(params, n, plan.recipe)["zero3" if plan.stage == "hsdp" else plan.stage]


def memory(model, cluster: pp.Cluster, plan: Plan) -> Memory:
    """Memory per GPU: model states + activations (+ logits) + gathered units at ZeRO-3 / HSDP."""
    m, r = pp.model(model), mm.recipe(plan.recipe)
    states = model_state_bytes(m.params, cluster.gpus, plan)
    acts = m.layers * korthikanti_layer_bytes(m, plan.micro_batch, plan.checkpointing)
    if plan.checkpointing == "full":  # backward recomputes one layer at a time; a fused attention
        acts += korthikanti_layer_bytes(m, plan.micro_batch, "selective")  # kernel keeps no s×s scores
    acts += 4 * m.seq * plan.micro_batch * m.vocab  # fp32 log-softmax the loss keeps (as memory_math counts)
    gathered = 0.0
    if plan.stage in ("zero3", "hsdp"):
        gathered = m.root_params * r.param_bytes + mm.gathered_unit_bytes(
            m.block_params, r, prefetch=plan.prefetch, include_grad=True)
    return Memory(states, acts, gathered, cluster.gpu.memory_bytes)


# ----------------------------------------------------------------------------------- FLOPs
def unit_flops(model: pp.Transformer, micro_batch: int) -> dict[str, float]:
    """Forward FLOPs of one micro-batch: a block's and the root's (the output head).

    A block: 2 FLOPs per weight per token for its matmuls, plus 4·b·s²·h for attention's two
    batched matmuls (Narayanan et al. 2021, eq. 3, which counts the full s×s). Backward costs
    twice its forward.
    """
    tokens = micro_batch * model.seq
    block = 2 * model.block_matmul_params * tokens + 4 * micro_batch * model.seq**2 * model.hidden
    return {"block": block, "attention": 4 * micro_batch * model.seq**2 * model.hidden,
            "root": 2 * model.vocab * model.hidden * tokens}


def step_flops(model, plan: Plan) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per GPU per step; hardware adds what recompute redoes."""
    m = pp.model(model)
    f = unit_flops(m, plan.micro_batch)
    model_flops = 3 * (m.layers * f["block"] + f["root"])
    redo = {"none": 0.0, "selective": f["attention"], "full": f["block"]}[plan.checkpointing]
    return plan.grad_accum * model_flops, plan.grad_accum * (model_flops + m.layers * redo)


# ------------------------------------------------------------------------------ collectives
def groups(cluster: pp.Cluster, plan: Plan) -> tuple[GroupLink, GroupLink | None]:
    """The sharding group's link, and HSDP's replica group's link (None for the other plans)."""
    n, g = cluster.gpus, sharding_degree(plan, cluster.gpus)
    per_node = min(g, cluster.gpus_per_node)
    shard = group_link(cluster, g, per_node)
    if plan.stage != "hsdp" or g == n:
        return shard, None
    reps = n // g
    reps_per_node = max(1, cluster.gpus_per_node // g) if g < cluster.gpus_per_node else 1
    return shard, group_link(cluster, reps, reps_per_node)


# ------------------------------------------------------------------------------ step time
@dataclass(frozen=True)
class Timing:
    """One step on one GPU: its seconds, split, and the rates the papers report."""

    step_s: float
    compute_s: float
    exposed_comm_s: float
    link_s: float
    tokens: float  # per GPU per step
    model_flops: float  # per GPU per step, no recompute (for MFU)
    hardware_flops: float  # per GPU per step, recompute included (Megatron-LM's TFLOPS)
    peak_flops: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_s / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.peak_flops


def step_time(model, cluster: pp.Cluster, plan: Plan, *, fraction: float = ACHIEVABLE_FRACTION,
              compute_s: float | None = None) -> Timing:
    """Replay one step (:func:`planner_step.replay`) and report it.

    ``compute_s``: a measured compute time for one micro-batch's forward and backward (e.g. a
    step on this machine with no slow link); the units keep their FLOP shares of it, instead
    of FLOPs / (``fraction`` × peak).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction of peak must be in (0, 1], got {fraction!r}")
    m, r = pp.model(model), mm.recipe(plan.recipe)
    f = unit_flops(m, plan.micro_batch)
    redo = {"none": 0.0, "selective": f["attention"], "full": f["block"]}[plan.checkpointing]
    rate = fraction * cluster.gpu.peak_flops
    if compute_s is not None:
        if not compute_s > 0:
            raise ValueError(f"compute_s must be a positive number of seconds, got {compute_s!r}")
        rate = 3 * (m.layers * f["block"] + f["root"]) / compute_s  # FLOP/s this machine reached
    units = [Unit("root", m.root_params, f["root"] / rate, 2 * f["root"] / rate)]
    units += [Unit(f"block{i}", m.block_params, f["block"] / rate, (2 * f["block"] + redo) / rate)
              for i in range(m.layers)]
    shard, replicas = groups(cluster, plan)
    g = sharding_degree(plan, cluster.gpus)

    def cost(kind, params):
        return shard.seconds(kind, params, r.param_bytes)

    def cross(params):  # HSDP: each GPU all-reduces its 1/g shard of the unit across replicas
        return replicas.seconds("all_reduce", params / g, r.param_bytes)

    run = replay(units, plan.stage, plan.grad_accum, plan.prefetch, cost, cross if replicas else None)
    model_flops, hardware_flops = step_flops(m, plan)
    return Timing(run.step_s, run.compute_s, run.exposed_comm_s, run.link_s,
                  plan.grad_accum * plan.micro_batch * m.seq, model_flops, hardware_flops, cluster.gpu.peak_flops)


@dataclass(frozen=True)
class Prediction:
    model: pp.Transformer
    cluster: pp.Cluster
    plan: Plan
    memory: Memory
    timing: Timing
    notes: list = field(default_factory=list)


def predict(model, cluster: pp.Cluster, plan: Plan, *, fraction: float = ACHIEVABLE_FRACTION) -> Prediction:
    """Memory per GPU and step time of one plan."""
    m = pp.model(model)
    return Prediction(m, cluster, plan, memory(m, cluster, plan), step_time(m, cluster, plan, fraction=fraction))


def candidates(cluster: pp.Cluster, plan: Plan) -> list[Plan]:
    """``plan`` at every stage, least sharded first, HSDP with a node as its shard group."""
    out = [plan.with_(stage=s) for s in mm.STAGES]
    g = min(cluster.gpus_per_node, cluster.gpus)
    if cluster.nodes > 1:
        out.insert(3, plan.with_(stage="hsdp", shard_group=g))
    return out


def compare(model, cluster: pp.Cluster, plan: Plan, *, fraction: float = ACHIEVABLE_FRACTION) -> dict:
    """Every stage with the same batch and checkpointing: which first fits, which is fastest that fits."""
    preds = [predict(model, cluster, p, fraction=fraction) for p in candidates(cluster, plan)]
    fitting = [p for p in preds if p.memory.fits]
    return {"predictions": preds,
            "first_fit": fitting[0] if fitting else None,
            "fastest": min(fitting, key=lambda p: p.timing.step_s) if fitting else None}
