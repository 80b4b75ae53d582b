"""One training step replayed on two clocks: the GPU's compute and the link's transfers.

The planner's step time (see :mod:`shardlab.instruments.planner`). The model is a list of
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

from dataclasses import dataclass

from shardlab.instruments import planner_presets as pp
from shardlab.instruments.link import link_delay


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


def replay(units: list[Unit], stage: str, grad_accum: int, prefetch: bool, cost, cross=None) -> Replay:
    """Replay a step. ``cost(kind, params)`` is a collective's seconds on the sharding group's link;
    ``cross(params)`` an all-reduce's seconds across HSDP replicas (None otherwise)."""
    root, blocks = units[0], units[1:]
    link, net = _Link(), _Link()
    t = 0.0
    pending = []  # finish times of transfers the step must wait for
    sharded_params = stage in ("zero3", "hsdp")

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
        for i, u in enumerate(order):
            if sharded_params:
                t = borrow(order, i, t, ready)
            t += u.fwd_s
        # backward: the head's gradient first, then the blocks in reverse; the root's
        # gradients are complete only after the embedding, at the very end
        t += root.bwd_s
        ready = {}
        back = blocks[::-1]
        for i, u in enumerate(back):
            if sharded_params:
                t = borrow(back, i, t, ready)
            t += u.bwd_s
            pending += _reduce(u, stage, last, t, link, net, cost, cross)
        pending += _reduce(root, stage, last, t, link, net, cost, cross)
    t = max([t, *pending])
    if stage in ("zero1", "zero2"):  # the updated shards come back to every rank before the next step
        for u in units:
            t = max(t, link.send(t, cost("all_gather", u.params)))
    compute = grad_accum * sum(u.fwd_s + u.bwd_s for u in units)
    return Replay(t, compute, link.busy + net.busy)


def _reduce(u: Unit, stage: str, last: bool, t: float, link: _Link, net: _Link, cost, cross) -> list[float]:
    """Issue a unit's gradient reduction after its backward; return the finish times to wait for."""
    if stage == "ddp":
        return [link.send(t, cost("all_reduce", u.params))] if last else []
    if stage == "zero1":
        return [link.send(t, cost("reduce_scatter", u.params))] if last else []
    done = link.send(t, cost("reduce_scatter", u.params))  # ZeRO-2, ZeRO-3, HSDP: every micro-batch
    if stage == "hsdp" and last and cross is not None:
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


def group_link(cluster: pp.Cluster, size: int, per_node: int) -> GroupLink:
    """A ring of ``size`` GPUs, ``per_node`` of them on each node it touches.

    Inside one node it runs on NVLink. Across nodes, NCCL spreads its rings over every NIC of
    the node, so the ring's bus bandwidth is what its share of the node's NICs can carry
    (``per_node / gpus_per_node`` of them; nccl-tests' bus bandwidth across 8-GPU nodes is the
    node's NIC total, e.g. ~96 of 100 GB/s with 4 HDR NICs), capped by NVLink.
    """
    if size <= 1 or size <= per_node:
        return GroupLink(max(size, 1), cluster.intra.bandwidth_gbps, cluster.intra.latency_us)
    share = cluster.node_nic_bytes_per_s * per_node / cluster.gpus_per_node * 8 / 1e9
    return GroupLink(size, min(cluster.intra.bandwidth_gbps, share), cluster.inter.latency_us)
