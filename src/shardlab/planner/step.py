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
issued or when the link is free, whichever is later (HSDP has two such links: the sharding
group's and, across replicas, the network's). That is the booking rule of
``emulate_link`` on this machine, so the same replay predicts ShardLab's own steps. What one
collective costs comes from :func:`~shardlab.planner.groups.group_link`: NVLink inside a node, the node's NICs
across nodes, priced by the α-β ring model of :func:`shardlab.instruments.link.link_delay`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from shardlab.instruments import memory_math, stages
from shardlab.planner import network_model as nm
from shardlab.planner import roofline
from shardlab.planner.compute import ACHIEVABLE_FRACTION, recompute_flops, step_flops, unit_flops
from shardlab.planner.groups import groups
from shardlab.planner.hardware import GPUCluster
from shardlab.planner.plan import Plan, sharding_degree
from shardlab.planner.transformer import Transformer, need_transformer


@dataclass
class Unit:
    """One wrapped unit: its parameters and its compute seconds per micro-batch."""

    name: str
    params: float
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class Replay:
    """What one step cost: its length, the compute in it, the links' busy time, and SM contention."""

    step_s: float
    compute_s: float
    link_s: float  # total seconds the links carried data (hidden or not)
    contention_s: float = 0.0  # compute slowed beside hidden transfers (overlap_efficiency < 1)

    @property
    def exposed_comm_s(self) -> float:
        """Time the GPU waited for a link: the step minus its compute and the contention."""
        return max(0.0, self.step_s - self.contention_s - self.compute_s)


class _Link:
    def __init__(self):
        self.free_at = 0.0
        self.busy = 0.0
        self.spans = []  # (start, end) of each transfer

    def send(self, at: float, seconds: float) -> float:
        """Book a transfer issued at ``at``; return when it finishes."""
        start = max(at, self.free_at)
        self.free_at = start + seconds
        self.busy += seconds
        self.spans.append((start, self.free_at))
        return self.free_at


def _merged(links) -> list[list[float]]:
    """Every link's non-empty transfer spans, sorted and merged where they touch or overlap."""
    merged = []
    for start, end in sorted(span for link in links for span in link.spans if span[1] > span[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(computing: list[tuple[float, float]], *links: _Link) -> float:
    """Seconds of compute with at least one transfer beside it, on any link.

    Two links busy beside the same compute second (HSDP's shard group and its replicas) count
    it once: what the contention charges is compute slowed, not transfers carried.

    Both lists grow as layers × grad-accum, so each compute span looks up (bisect) only the
    merged transfers that can touch it instead of testing every pair: O((C + T) log T) for
    replay's back-to-back compute spans, not O(C × T). It adds the same nonzero terms in the
    same order as the sum over every pair, so it returns the same float
    (``tests/test_planner_overlap.py`` checks it against that sum)."""
    merged = _merged(links)
    ends = [t1 for _, t1 in merged]  # merged spans are disjoint and sorted, so their ends are too
    total = 0.0
    for c0, c1 in computing:
        i = bisect.bisect_right(ends, c0)  # the first merged span ending after the compute starts
        while i < len(merged) and merged[i][0] < c1:
            t0, t1 = merged[i]
            total += max(0.0, min(c1, t1) - max(c0, t0))
            i += 1
    return total


def replay(units: list[Unit], stage, grad_accum: int, prefetch: bool, cost, cross=None, *,
           overlap_param_gather: bool = False, overlap_efficiency: float = 1.0) -> Replay:
    """Replay a step. ``stage``: a row of :data:`shardlab.instruments.stages.STAGES` or its name
    (HSDP is ZeRO-3 with a ``cross``). ``cost(kind, params)`` is a collective's seconds on the
    sharding group's link; ``cross(params)`` an all-reduce's seconds across HSDP replicas.
    ``overlap_param_gather``: ZeRO-1/2 gather the updated parameters unit by unit in the next
    forward (Megatron-LM's ``--overlap-param-gather``) instead of all at once after the step;
    in a steady state the next step's forward is this one's. ``overlap_efficiency``: compute's
    speed while a transfer hides beside it (NCCL's kernels take SMs): each second of compute with
    a transfer beside it adds (1 − it) seconds to the step, booked as ``contention_s`` (to first
    order: the transfers are not moved later by it); 1.0 is perfect overlap."""
    row = stages.stage(stage)
    root, blocks = units[0], units[1:]
    link, net = _Link(), _Link()
    t = 0.0
    pending = []  # finish times of transfers the step must wait for
    computing = []  # (start, end) of each unit's compute

    def run(t, seconds):
        computing.append((t, t + seconds))
        return t + seconds

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
            t = run(t, u.fwd_s)
        # backward: the head's gradient first, then the blocks in reverse; the root's
        # gradients are complete only after the embedding, at the very end
        ready = {}
        back = blocks[::-1]
        if row.shards_params and prefetch and back:  # the engine prefetches the last block's gather
            ready[back[0].name] = link.send(t, cost("all_gather", back[0].params))  # during the head's backward
        t = run(t, root.bwd_s)
        for i, u in enumerate(back):
            if row.shards_params:
                t = borrow(back, i, t, ready)
            t = run(t, u.bwd_s)
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
    # perfect overlap (the ideal model) charges nothing: skip the sweep, whose result it multiplies by 0
    contention = 0.0 if overlap_efficiency == 1 else (1 - overlap_efficiency) * _overlap(computing, link, net)
    return Replay(t + contention, compute, link.busy + net.busy, contention)


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
class Timing:
    """One step on one GPU: its seconds, split, and the rates the papers report."""

    step_s: float
    compute_s: float
    exposed_comm_s: float  # waiting for a link
    link_s: float
    contention_s: float  # compute slowed beside hidden transfers (``--overlap-efficiency``), not waiting
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
    step on this machine with no slow link), recompute included when the plan checkpoints; the
    units keep their FLOP shares of it (recompute's FLOPs counted), so they add up to it.
    ``matmul_efficiency``: the roofline's η, if not its fitted :data:`roofline.MATMUL_EFFICIENCY`.
    ``network``: "ideal" (line rates, every transfer hides where the link is free) or "nccl"
    (:mod:`~shardlab.planner.network_model`: NCCL's bus, DDP's all-reduce in ``bucket_mb`` buckets,
    default PyTorch's 25, and compute at ``overlap_efficiency`` beside a transfer, default 0.9;
    both only under "nccl", see :func:`~shardlab.planner.network_model.network_knobs`). A unit's DDP buckets are its own (a
    unit under a bucket's size still pays a whole α; PyTorch merges small units into one
    bucket) and are issued at the end of its backward (PyTorch issues each as it fills).
    """
    bucket, eff = nm.network_knobs(network, bucket_mb, overlap_efficiency)
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
        rate = (3 * (m.layers * f["block"] + f["root"]) + m.layers * redo) / compute_s  # FLOP/s this machine reached
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
    return Timing(run.step_s, run.compute_s, run.exposed_comm_s, run.link_s, run.contention_s,
                  plan.grad_accum * plan.micro_batch * m.seq, model_flops, hardware_flops, cluster.gpu.peak_flops)
