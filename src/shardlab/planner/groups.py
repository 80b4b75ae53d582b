"""Which link a collective runs on: a group of GPUs inside a node (NVLink) or across nodes (their NICs).

The step replay (``step.py``) prices every collective on the :class:`GroupLink` of its group:
the sharding group's, and for HSDP also the replica group's across nodes. Under
``--network-model nccl`` the bus is what NCCL reaches on those lines (:mod:`network_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.instruments.link import link_delay
from shardlab.planner import network_model as nm
from shardlab.planner.hardware import GPUCluster
from shardlab.planner.plan import Plan, sharding_degree


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
    if network not in nm.NETWORK_MODELS:
        raise ValueError(f"network model must be one of {nm.NETWORK_MODELS}, got {network!r}")
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
