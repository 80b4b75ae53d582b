"""One training step replayed on two clocks: the GPU's compute and the link's transfers.

The planner's step time. The model is a list of
units, the root (embedding and output head) first and then the blocks, as the engine wraps
them. Per micro-batch, unit by unit, as ``engine/zero3.py`` and ``engine/ddp.py`` run them:

* **ZeRO-3 / HSDP forward:** wait for the unit's gather, issue the next unit's gather
  (prefetch), compute. The root stays gathered from forward to backward.
* **Backward:** the output head first, then the blocks in reverse, each regathered (prefetched
  one ahead); after a unit's backward its gradients are reduce-scattered (ZeRO-2/3, HSDP) or,
  on the last micro-batch, all-reduced (DDP) or reduce-scattered (ZeRO-1). HSDP all-reduces each
  gradient shard across replicas, on the network, once its reduce-scatter is done.
* **After the last micro-batch:** ZeRO-1 and ZeRO-2 all-gather the updated parameters; nothing
  of the next step can hide that.

The link carries one transfer at a time, in the order issued: a transfer starts when it is
issued or when the link is free, whichever is later. That is the booking rule of
``emulate_link`` on this machine, so the same replay predicts ShardLab's own steps. What one
collective costs comes from :func:`group_link` (below): NVLink inside a node, the node's NICs
across nodes, priced by the α-β ring model of :func:`shardlab.instruments.link.link_delay`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlab.instruments import memory_math, stages
from shardlab.instruments.link import link_delay
from shardlab.planner import network_model as nm
from shardlab.planner import roofline
from shardlab.planner.compute import ACHIEVABLE_FRACTION, recompute_flops, step_flops, unit_flops
from shardlab.planner.hardware import GPUCluster
from shardlab.planner.plan import Plan, sharding_degree
from shardlab.planner.transformer import Transformer, need_transformer

NETWORK_MODELS = ("ideal", "nccl")


@dataclass
class Unit:
    """One wrapped unit: its parameters and its compute seconds per micro-batch."""

    name: str
    params: float
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class Replay:
    """What one step cost: its length, the compute in it, and the link's busy time."""

    step_s: float
    compute_s: float
    link_s: float  # total seconds the links carried data (hidden or not)

    @property
    def exposed_comm_s(self) -> float:
        """Time the GPU waited for the link: the step minus its compute."""
        return max(0.0, self.step_s - self.compute_s)


class _Link:
    def __init__(self):
        self.free_at = 0.0
        self.busy = 0.0

    def send(self, at: float, seconds: float) -> float:
        """Book a transfer issued at ``at``; return when it finishes."""
        start = max(at, self.free_at)
        self.free_at = start + seconds
        self.busy += seconds
        return self.free_at


def replay(units: list[Unit], stage, grad_accum: int, prefetch: bool, cost, cross=None, *,
           overlap_param_gather: bool = False, overlap_efficiency: float = 1.0) -> Replay:
    """Replay a step. ``stage``: a row of :data:`shardlab.instruments.stages.STAGES` or its name
    (HSDP is ZeRO-3 with a ``cross``). ``cost(kind, params)`` is a collective's seconds on the
    sharding group's link; ``cross(params)`` an all-reduce's seconds across HSDP replicas.
    ``overlap_param_gather``: ZeRO-1/2 gather the updated parameters unit by unit in the next
    forward (Megatron-LM's ``--overlap-param-gather``) instead of all at once after the step;
    in a steady state the next step's forward is this one's. ``overlap_efficiency``: compute's
    speed while a transfer hides beside it (NCCL's kernels take SMs); each hidden second of
    transfer adds (1 − it) seconds to the step, 1.0 is perfect overlap."""
    row = stages.stage(stage)
    root, blocks = units[0], units[1:]
    link, net = _Link(), _Link()
    t = 0.0
    pending = []  # finish times of transfers the step must wait for

    def borrow(order, i, t, ready):
        """Gather unit ``i`` of ``order`` (unless prefetched), wait for it, prefetch the next."""
        u = order[i]
        if u.name not in ready:
            ready[u.name] = link.send(t, cost("all_gather", u.params))
        t = max(t, ready[u.name])
        if prefetch and i + 1 < len(order):
            ready[order[i + 1].name] = link.send(t, cost("all_gather", order[i + 1].params))
        return t

    for micro in range(grad_accum):
        last = micro == grad_accum - 1
        # forward
        ready = {}
        order = [root, *blocks]
        late_gather = row.gathers_params_after_step and overlap_param_gather and micro == 0
        for i, u in enumerate(order):
            if row.shards_params or late_gather:
                t = borrow(order, i, t, ready)
            t += u.fwd_s
        # backward: the head's gradient first, then the blocks in reverse; the root's
        # gradients are complete only after the embedding, at the very end
        ready = {}
        back = blocks[::-1]
        if row.shards_params and prefetch and back:  # the engine prefetches the last block's gather
            ready[back[0].name] = link.send(t, cost("all_gather", back[0].params))  # during the head's backward
        t += root.bwd_s
        for i, u in enumerate(back):
            if row.shards_params:
                t = borrow(back, i, t, ready)
            t += u.bwd_s
            if row.reduce_as_ready:
                pending += _reduce(u, row, last, t, link, net, cost, cross)
        # ZeRO-1 reduces nothing as gradients become ready (stages.reduce_as_ready, as the
        # engine does): every unit's reduce-scatter is issued once the whole backward is done
        for u in ([root] if row.reduce_as_ready else [*back, root]):
            pending += _reduce(u, row, last, t, link, net, cost, cross)
    t = max([t, *pending])
    if row.gathers_params_after_step and not overlap_param_gather:  # every rank waits for the updated shards
        for u in units:
            t = max(t, link.send(t, cost("all_gather", u.params)))
    compute = grad_accum * sum(u.fwd_s + u.bwd_s for u in units)
    busy = link.busy + net.busy
    hidden = min(compute, max(0.0, busy - max(0.0, t - compute)))  # transfer seconds under compute
    return Replay(t + (1 - overlap_efficiency) * hidden, compute, busy)


def _reduce(u: Unit, row: stages.Stage, last: bool, t: float, link: _Link, net: _Link, cost, cross) -> list[float]:
    """Issue a unit's gradient reduction at ``t``; return the finish times to wait for.

    ``t`` is the end of the unit's backward where the stage reduces as gradients become ready,
    the end of the whole backward for ZeRO-1 (``stages.Stage.reduce_as_ready``).

    DDP all-reduces, the others reduce-scatter; ZeRO-2/3 every micro-batch (a sharded gradient
    cannot add up whole), DDP and ZeRO-1 on the last one only."""
    if not (last or row.reduces_every_micro_batch):
        return []
    kind = "reduce_scatter" if row.shards_optimizer_state else "all_reduce"
    done = link.send(t, cost(kind, u.params))
    if last and cross is not None:  # HSDP: the shard's all-reduce across replicas, once a step
        return [done, net.send(done, cross(u.params))]
    return [done]


@dataclass(frozen=True)
class GroupLink:
    """The bus a collective group sees: bandwidth (Gbit/s per GPU) and per-hop latency (µs)."""

    size: int
    bandwidth_gbps: float
    latency_us: float

    def seconds(self, kind: str, params: float, itemsize: int) -> float:
        """The α-β ring time of one collective on a full buffer of ``params`` elements."""
        return link_delay(kind, int(params), itemsize, self.size, self.bandwidth_gbps, self.latency_us)


def group_link(cluster: GPUCluster, size: int, per_node: int, network: str = "ideal") -> GroupLink:
    """A ring of ``size`` GPUs, ``per_node`` of them on each node it touches.

    Inside one node it runs on NVLink. Across nodes, NCCL spreads its rings over every NIC of
    the node, so the ring's bus bandwidth is what its share of the node's NICs can carry
    (``per_node / gpus_per_node`` of them; nccl-tests' bus bandwidth across 8-GPU nodes is the
    node's NIC total, e.g. ~96 of 100 GB/s with 4 HDR NICs), capped by NVLink.

    ``network``: "ideal" takes the line rates and the latencies of the link table; "nccl" what
    NCCL reaches on them (:mod:`shardlab.planner.network_model`): η of each line rate and the
    published curves' α per hop.
    """
    if network not in NETWORK_MODELS:
        raise ValueError(f"network model must be one of {NETWORK_MODELS}, got {network!r}")
    nccl = network == "nccl"
    nvlink = cluster.intra.bandwidth_gbps * (nm.NVLINK_EFFICIENCY if nccl else 1)
    if size <= 1 or size <= per_node:
        return GroupLink(max(size, 1), nvlink, nm.ALPHA_US if nccl else cluster.intra.latency_us)
    share = cluster.node_nic_bytes_per_s * per_node / cluster.gpus_per_node * 8 / 1e9
    share *= nm.NIC_EFFICIENCY if nccl else 1
    return GroupLink(size, min(nvlink, share), nm.ALPHA_US if nccl else cluster.inter.latency_us)


def groups(cluster: GPUCluster, plan: Plan, network: str = "ideal") -> tuple[GroupLink, GroupLink | None]:
    """The sharding group's link, and HSDP's replica group's link (None for the other plans)."""
    n, g = cluster.gpus, sharding_degree(plan, cluster.gpus)
    shard = group_link(cluster, g, min(g, cluster.gpus_per_node), network)
    if plan.stage != "hsdp" or g == n:
        return shard, None
    reps_per_node = max(1, cluster.gpus_per_node // g) if g < cluster.gpus_per_node else 1
    return shard, group_link(cluster, n // g, reps_per_node, network)


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


def step_time(model: Transformer, cluster: GPUCluster, plan: Plan, *, fraction: float = ACHIEVABLE_FRACTION,
              compute_s: float | None = None, compute: str = "fraction", matmul_efficiency: float | None = None,
              network: str = "ideal", bucket_mb: float | None = None, overlap_efficiency: float | None = None) -> Timing:
    """Replay one step (:func:`replay`) and report it.

    ``compute``: "fraction" prices a unit's FLOPs at ``fraction`` × peak; "roofline" prices each
    kernel against the GPU's peak and memory bandwidth (:mod:`shardlab.planner.roofline`).
    ``compute_s``: a measured compute time for one micro-batch's forward and backward (e.g. a
    step on this machine with no slow link); the units keep their FLOP shares of it.
    ``matmul_efficiency``: the roofline's η, if not its fitted :data:`roofline.MATMUL_EFFICIENCY`.
    ``network``: "ideal" (line rates, every transfer hides where the link is free) or "nccl"
    (:mod:`~shardlab.planner.network_model`: NCCL's bus, DDP's all-reduce in ``bucket_mb`` buckets,
    default PyTorch's 25, and compute at ``overlap_efficiency`` beside a transfer, default 0.9).
    """
    nccl = network == "nccl"
    bucket = (bucket_mb * nm.MiB if bucket_mb is not None else nm.DDP_BUCKET_BYTES) if nccl else None
    eff = overlap_efficiency if overlap_efficiency is not None else (nm.OVERLAP_EFFICIENCY if nccl else 1.0)
    if bucket is not None and not bucket > 0:
        raise ValueError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
    if not 0 < eff <= 1:
        raise ValueError(f"overlap_efficiency must be in (0, 1], got {overlap_efficiency!r}")
    if compute not in ("fraction", "roofline"):
        raise ValueError(f"compute must be 'fraction' or 'roofline', got {compute!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction of peak must be in (0, 1], got {fraction!r}")
    m, r = need_transformer(model), memory_math.recipe(plan.recipe)
    f, redo = unit_flops(m, plan.micro_batch), recompute_flops(m, plan)
    rate = fraction * cluster.gpu.peak_flops
    if compute_s is not None:
        if not compute_s > 0:
            raise ValueError(f"compute_s must be a positive number of seconds, got {compute_s!r}")
        rate = 3 * (m.layers * f["block"] + f["root"]) / compute_s  # FLOP/s this machine reached
    if compute == "roofline" and compute_s is None:
        eta = matmul_efficiency
        root_s, block_s = roofline.root_seconds(m, plan, cluster.gpu, eta), roofline.block_seconds(m, plan, cluster.gpu, eta)
    else:
        root_s, block_s = (f["root"] / rate, 2 * f["root"] / rate), (f["block"] / rate, (2 * f["block"] + redo) / rate)
    units = [Unit("root", m.root_params, *root_s)]
    units += [Unit(f"block{i}", m.block_params, *block_s) for i in range(m.layers)]
    shard, replicas = groups(cluster, plan, network)
    g = sharding_degree(plan, cluster.gpus)

    def cost(kind, params):  # gathers move weights (the recipe's dtype), reductions gradients (plan's)
        itemsize = r.param_bytes if kind == "all_gather" else plan.reduce_bytes
        if kind == "all_reduce" and bucket is not None:  # DDP: one all-reduce per bucket, each its α
            n = max(1, math.ceil(params * itemsize / bucket))
            return n * shard.seconds(kind, params / n, itemsize)
        return shard.seconds(kind, params, itemsize)

    def cross(params):  # HSDP: each GPU all-reduces its 1/g shard of the unit across replicas
        return replicas.seconds("all_reduce", params / g, plan.reduce_bytes)

    run = replay(units, plan.row, plan.grad_accum, plan.prefetch, cost, cross if replicas else None,
                 overlap_param_gather=plan.overlap_param_gather, overlap_efficiency=eff)
    model_flops, hardware_flops = step_flops(m, plan)
    return Timing(run.step_s, run.compute_s, run.exposed_comm_s, run.link_s,
                  plan.grad_accum * plan.micro_batch * m.seq, model_flops, hardware_flops, cluster.gpu.peak_flops)
