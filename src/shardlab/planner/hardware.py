"""Where the planner trains: GPUs, the networks inside and between nodes, and a cluster of them.

Round numbers from the vendors' data sheets:

* **GPUs** (:class:`GPU`): dense bf16 tensor-core peak (no sparsity) and memory per card.
* **Networks** (:class:`shardlab.instruments.link.Link`, the emulator's own type): one NIC's
  bandwidth per direction and a per-message latency. How many NICs a node has is the cluster's.
* **A cluster** (:class:`GPUCluster`): so many cards, so many to a node, the links between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.instruments.link import Link, find_link

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """A card: dense bf16 peak in FLOP/s, memory in bytes, and its memory (HBM) bandwidth in bytes/s.

    Every number is the vendor's data sheet (NVIDIA V100, A100 and H100/H200 data sheets), except
    where the note says otherwise."""

    name: str
    peak_flops: float
    memory_bytes: float
    note: str = ""
    hbm_bytes_per_s: float = 2.0e12


GPUS = {g.name: g for g in (
    GPU("v100", 125e12, 32 * GIB, "V100 SXM2 32 GB: 125 TFLOPS fp16 tensor cores, 900 GB/s", 900e9),
    GPU("a100", 312e12, 80 * GIB, "A100 SXM 80 GB: 312 TFLOPS bf16 dense, 2,039 GB/s", 2039e9),
    GPU("a100-40gb", 312e12, 40 * GIB, "A100 SXM 40 GB: 312 TFLOPS bf16 dense, 1,555 GB/s", 1555e9),
    GPU("h100", 989e12, 80 * GIB, "H100 SXM 80 GB: 989 TFLOPS bf16 dense, 3,350 GB/s", 3350e9),
    GPU("h100-hbm2e", 989e12, 96e9, "H100 SXM with 96 GB HBM2e at 2.4 TB/s and a 500 W limit (torchtitan's "
        "Grand Teton hosts); its real peak lies between SXM's 989 and NVL's 835 TFLOPS, not published", 2.4e12),
    GPU("h200", 989e12, 141e9, "H200 SXM 141 GB: the H100's compute with more and faster memory, 4,800 GB/s", 4.8e12),
)}


def _lookup(table: dict, value, kind: type, what: str):
    """``value`` itself if it is already a ``kind``, else its entry in ``table`` (case-insensitive)."""
    if isinstance(value, kind):
        return value
    key = str(value).lower()
    if key not in table:
        raise ValueError(f"unknown {what} {value!r}; choose one of {sorted(table)}")
    return table[key]


def gpu(name_or_gpu) -> GPU:
    return _lookup(GPUS, name_or_gpu, GPU, "GPU")


#: How many NICs a node has unless told: one per GPU on InfiniBand (DGX / HGX), one per node on Ethernet.
ONE_NIC_A_NODE = {find_link(name) for name in ("100gbe", "25gbe", "10gbe", "1gbe")}
NVLINK_FOR = {"v100": "nvlink2", "a100": "nvlink3", "a100-40gb": "nvlink3", "h100": "nvlink4", "h100-hbm2e": "nvlink4",
              "h200": "nvlink4"}


def network(name_or_link) -> Link:
    """A network of :data:`shardlab.instruments.link.NETWORKS`, the one table the emulator reads too."""
    return find_link(name_or_link)


@dataclass(frozen=True)
class GPUCluster:
    """``gpus`` cards of one kind, ``gpus_per_node`` to a node on ``intra`` (NVLink), nodes joined by
    ``nics_per_node`` NICs of ``inter`` each."""

    gpu: GPU
    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int

    def __post_init__(self):
        for field in ("gpus", "gpus_per_node", "nics_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPUCluster.{field} must be a positive integer, got {value!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; "
                             "use a multiple of gpus_per_node")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def node_nic_bytes_per_s(self) -> float:
        """What one node can send to the others per second, all its NICs together."""
        return self.nics_per_node * self.inter.bandwidth_gbps * 1e9 / 8

    def describe(self) -> str:
        net = f"{self.nics_per_node} × {self.inter.name} per node" if self.nodes > 1 else "one node"
        return (f"{self.gpus} × {self.gpu.name} ({self.gpus_per_node} a node on {self.intra.name}; {net})")


def cluster(gpu_name="h100", gpus=8, network_name="ib-ndr", gpus_per_node=8, nics_per_node=None,
            intra=None) -> GPUCluster:
    """A cluster from names: ``cluster("h100", 256, "ib-ndr")``; NICs default by network (see ONE_NIC_A_NODE)."""
    card = gpu(gpu_name)
    inter = network(network_name)
    if nics_per_node is None:
        nics_per_node = 1 if inter in ONE_NIC_A_NODE else gpus_per_node
    per_node = min(gpus_per_node, gpus)
    link = network(intra if intra is not None else NVLINK_FOR.get(card.name, "nvlink4"))
    return GPUCluster(card, gpus, per_node, link, inter, nics_per_node)
