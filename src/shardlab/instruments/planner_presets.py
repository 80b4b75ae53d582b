"""What the planner plans for: transformers by name, GPUs, networks and clusters.

Round numbers from the vendors' data sheets and the models' papers, so that a learner can
name "70b on 256 H100s over InfiniBand" and get a plan; none of them is tuned to make a
published run come out right (``tests/test_planner_published.py`` checks the planner against
those runs with these presets as they are).

* **Transformers** (:class:`Transformer`): the dimensions that set parameters, FLOPs and
  activations. GPT-3 sizes from Brown et al. 2020, Table 2.1 (175B with Megatron-LM's 51,200-token
  vocabulary); Llama 3 from the Llama 3 paper (Dubey et al. 2024, Table 3); 1T from Megatron-LM
  (Narayanan et al. 2021, Table 1).
* **GPUs** (:class:`GPU`): dense bf16 tensor-core peak (no sparsity) and memory per card.
* **Networks** (:class:`shardlab.instruments.link.Link`, the emulator's own type): one NIC's
  bandwidth per direction and a per-message latency. How many NICs a node has is the cluster's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlab.instruments.link import LINKS, Link

GIB = 2**30


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer: enough to count its parameters, FLOPs and activations.

    ``ffn_matrices`` is 2 for a GELU MLP (GPT) and 3 for SwiGLU (Llama); ``kv_heads`` below
    ``heads`` is grouped-query attention; ``bias`` adds GPT's biases (13h a block with the two
    LayerNorms); ``learned_positions`` adds GPT's seq × h position table; ``tied`` shares the
    embedding with the output head.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0  # 0: 4 × hidden
    kv_heads: int = 0  # 0: same as heads
    ffn_matrices: int = 2
    bias: bool = True
    learned_positions: bool = True
    tied: bool = True

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Transformer.{field} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must split evenly over {self.heads} heads")
        if self.ffn_matrices not in (2, 3):
            raise ValueError("ffn_matrices is 2 (GELU MLP) or 3 (SwiGLU)")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def block_matmul_params(self) -> int:
        """Weights the matmuls of one block multiply by: q, k, v, output projection, the FFN."""
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h + self.ffn_matrices * h * self.ffn_size

    @property
    def block_params(self) -> int:
        """One block: its matmul weights, the two norms, and GPT's biases (12h² + 13h for GPT)."""
        h = self.hidden
        biases = (h + 2 * self.kv_dim) + h + self.ffn_size + h if self.bias else 0
        norms = (4 if self.bias else 2) * h  # LayerNorm has a weight and a bias; RMSNorm a weight
        return self.block_matmul_params + biases + norms

    @property
    def root_params(self) -> int:
        """Everything outside the blocks: embedding, positions, final norm, output head."""
        h = self.hidden
        return (self.vocab * h * (1 if self.tied else 2) + (self.seq * h if self.learned_positions else 0)
                + (2 if self.bias else 1) * h)

    @property
    def params(self) -> int:
        """Ψ, the parameter count."""
        return self.layers * self.block_params + self.root_params

    def with_(self, **changes) -> Transformer:
        """A copy with some dimensions changed, e.g. ``model.with_(seq=4096)``."""
        return replace(self, **changes)


def _gpt3(name, layers, hidden, heads, vocab=50257):
    return Transformer(name, layers, hidden, heads, vocab, seq=2048)


def _llama(name, layers, hidden, heads, ffn, tied=False, seq=8192):
    return Transformer(name, layers, hidden, heads, vocab=128256, seq=seq, ffn=ffn, kv_heads=8,
                       ffn_matrices=3, bias=False, learned_positions=False, tied=tied)


MODELS = {m.name: m for m in (
    _gpt3("gpt3-125m", 12, 768, 12),
    _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-1.3b", 24, 2048, 16),
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5120, 40),
    _gpt3("gpt3-175b", 96, 12288, 96, vocab=51200),
    _llama("llama3-1b", 16, 2048, 32, 8192, tied=True),
    _llama("llama3-8b", 32, 4096, 32, 14336),
    _llama("llama3-70b", 80, 8192, 64, 28672),
    _llama("llama3-405b", 126, 16384, 128, 53248),
    Transformer("megatron-1t", 128, 25600, 160, 51200, seq=2048),
)}
ALIASES = {"125m": "gpt3-125m", "350m": "gpt3-350m", "1b": "llama3-1b", "1.3b": "gpt3-1.3b",
           "2.7b": "gpt3-2.7b", "6.7b": "gpt3-6.7b", "8b": "llama3-8b", "13b": "gpt3-13b",
           "70b": "llama3-70b", "175b": "gpt3-175b", "405b": "llama3-405b", "1t": "megatron-1t"}


def model(name_or_model) -> Transformer:
    """A :class:`Transformer` by name ('70b', 'gpt3-175b', ...); a Transformer passes through."""
    if isinstance(name_or_model, Transformer):
        return name_or_model
    key = str(name_or_model).lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name_or_model!r}; choose one of {sorted(ALIASES)} or {sorted(MODELS)}")
    return MODELS[key]


@dataclass(frozen=True)
class GPU:
    """A card: dense bf16 peak in FLOP/s and memory in bytes."""

    name: str
    peak_flops: float
    memory_bytes: float
    note: str = ""


GPUS = {g.name: g for g in (
    GPU("v100", 125e12, 32 * GIB, "V100 SXM2 32 GB: 125 TFLOPS fp16 tensor cores"),
    GPU("a100", 312e12, 80 * GIB, "A100 SXM 80 GB: 312 TFLOPS bf16 dense"),
    GPU("a100-40gb", 312e12, 40 * GIB, "A100 SXM 40 GB: 312 TFLOPS bf16 dense"),
    GPU("h100", 989e12, 80 * GIB, "H100 SXM 80 GB: 989 TFLOPS bf16 dense"),
    GPU("h200", 989e12, 141e9, "H200 SXM 141 GB: the H100's compute with more and faster memory"),
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


#: Links inside a node (per GPU, per direction) and NICs between nodes (per NIC, per direction).
#: Latencies are round numbers of the right order for NCCL on each fabric; not benchmarks.
NETWORKS = {
    "nvlink3": Link("NVLink 3 (A100)", 2400.0, 2.0, "300 GB/s per GPU per direction inside an A100 node"),
    "nvlink4": LINKS["NVLink"],
    "ib-hdr": Link("InfiniBand HDR", 200.0, 5.0, "one 200 Gbit/s HDR NIC (25 GB/s)"),
    "ib-ndr": LINKS["InfiniBand"],
    "100gbe": Link("100 Gb Ethernet", 100.0, 20.0, "one 100 Gbit/s Ethernet NIC, RoCE or TCP"),
    "25gbe": Link("25 Gb Ethernet", 25.0, 30.0, "one 25 Gbit/s Ethernet NIC, TCP"),
}
#: How many NICs a node has unless told: one per GPU on InfiniBand (DGX / HGX), one per node on Ethernet.
DEFAULT_NICS = {"ib-hdr": None, "ib-ndr": None, "100gbe": 1, "25gbe": 1}
NVLINK_FOR = {"v100": "nvlink3", "a100": "nvlink3", "a100-40gb": "nvlink3", "h100": "nvlink4", "h200": "nvlink4"}


def network(name_or_link) -> Link:
    return _lookup(NETWORKS, name_or_link, Link, "network")


@dataclass(frozen=True)
class Cluster:
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
                raise ValueError(f"Cluster.{field} must be a positive integer, got {value!r}")
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
            intra=None) -> Cluster:
    """A cluster from names: ``cluster("h100", 256, "ib-ndr")``; NICs default by network (see DEFAULT_NICS)."""
    card = gpu(gpu_name)
    inter = network(network_name)
    if nics_per_node is None:
        key = network_name if isinstance(network_name, str) else ""
        nics_per_node = DEFAULT_NICS.get(key.lower()) or gpus_per_node
    per_node = min(gpus_per_node, gpus)
    link = network(intra) if intra is not None else NETWORKS[NVLINK_FOR.get(card.name, "nvlink4")]
    return Cluster(card, gpus, per_node, link, inter, nics_per_node)
