"""When sharding is not enough: memory and traffic formulas of the other ways to split training.

ZeRO-3 splits the *state* of the model over N GPUs but every GPU still runs whole layers on
its own slice of the batch. The other parallelisms split the work itself. This module puts
each one's per-GPU memory and per-GPU traffic for one training step beside ZeRO-3's, for one
transformer shape, so that notebook 07 can compare them on the same footing:

======================  =========================================  ==============================================
plan (degree N)          memory per GPU                             traffic per GPU per step (elements, ring)
======================  =========================================  ==============================================
ZeRO-3 / FSDP            16Ψ/N + L·16·(B/N)·s·h                     3Ψ · (N−1)/N
HSDP (shard G, R = N/G)  16Ψ/G + L·16·(B/N)·s·h                     3Ψ(G−1)/G inside; 2(Ψ/G)(R−1)/R across groups
ZeRO-2 + CPU offload     2Ψ on GPU, 14Ψ/N on CPU + activations      2Ψ(N−1)/N network; 4Ψ/N bytes over PCIe
tensor (Megatron)        16Ψ/N + L·(4 + 12/N)·B·s·h                 8·L·B·s·h · (N−1)/N (4 all-reduces per layer)
pipeline (1F1B, m mb)    16Ψ/N + L·16·(B/m)·s·h (first stage)       2·B·s·h point-to-point; bubble (N−1)/(m+N−1)
context (ring attn)      16Ψ + L·16·B·(s/N)·h                       6·L·B·s·h·(N−1)/N (K, V) + 2Ψ(N−1)/N grads
======================  =========================================  ==============================================

Ψ parameters, L layers, h hidden size, s sequence length, B sequences per step over the N GPUs
(one data-parallel group). Model states use the recipe's bytes per parameter (16 for mixed
Adam, ZeRO paper §3); activations use the course's count of 16·b·s·h elements saved per block
(:func:`shardlab.instruments.memory_math.activation_bytes`, fused attention, no dropout), in
``act_bytes`` per element. The embeddings and the head are left out of the layer terms.

Sources: ZeRO (Rajbhandari et al. 2020, §5, §7) for the stages and 3Ψ; FSDP (Zhao et al. 2023,
§3.2.2) for hybrid sharding, whose cross-host traffic per GPU the paper writes 2M(W−1)/(GW)
for W hosts of G GPUs (here R = W replicas, bytes M = 2Ψ); ZeRO-Offload (Ren et al. 2021, §4)
for the 4Ψ bytes over PCIe; Megatron-LM (Shoeybi et al. 2019, §3) for the two all-reduces per
layer in forward and two in backward; Korthikanti et al. 2022 ("Reducing activation
recomputation", §4) for which activations tensor parallelism splits (our 12 of 16) and for
1F1B's first stage holding N micro-batches of L/N layers; GPipe / PipeDream-Flush for the
bubble; Ring Attention (Liu et al. 2023) and the Ultra-Scale Playbook for context
parallelism's K/V ring. These are textbook counts to compare plans, not a profiler.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from shardlab.instruments import memory_math as mm


@dataclass(frozen=True)
class Shape:
    """A transformer to train: ``params`` Ψ, ``layers`` L, ``hidden`` h, ``seq`` s, ``batch`` B."""

    params: float
    layers: int
    hidden: int
    seq: int
    batch: int  # sequences per step over the whole group of N GPUs

    def __post_init__(self):
        for name in ("layers", "hidden", "seq", "batch"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Shape.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.params, numbers.Real) or not self.params > 0:
            raise ValueError(f"Shape.params must be a positive number, got {self.params!r}")

    @property
    def bsh(self) -> int:
        """Elements of one layer's input for the whole batch: B·s·h."""
        return self.batch * self.seq * self.hidden


@dataclass(frozen=True)
class Strategy:
    """One way to train ``shape`` on ``gpus`` GPUs: bytes per GPU and traffic per GPU per step."""

    name: str
    gpus: int
    model_states: float  # bytes of params + grads + optimizer state on each GPU
    activations: float  # bytes saved for backward on each GPU (the most loaded one)
    sent: float  # bytes each GPU sends over the GPU network per step (ring / point-to-point)
    memory_formula: str
    traffic_formula: str
    extra: dict = field(default_factory=dict)  # e.g. CPU bytes, PCIe bytes, bubble, cross-group bytes

    @property
    def memory(self) -> float:
        return self.model_states + self.activations


def _degree(n, what="gpus") -> int:
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{what} must be a positive integer, got {n!r}")
    return int(n)


def _ring(n: int) -> float:
    return (n - 1) / n


def zero3(shape: Shape, gpus: int, recipe=mm.MIXED_ADAM, act_bytes: int = 2, comm_bytes: int = 2) -> Strategy:
    """Fully sharded data parallel: the reference the others are compared with."""
    n = _degree(gpus)
    if shape.batch % n:
        raise ValueError(f"batch {shape.batch} does not split over {n} data-parallel GPUs")
    r = mm.recipe(recipe)
    return Strategy("ZeRO-3 / FSDP", n, mm.model_state_bytes(shape.params, n, r)["zero3"],
                16 * shape.layers * (shape.bsh // n) * act_bytes,
                mm.ring_bytes_per_rank("zero3", shape.params, n, comm_bytes),
                f"{r.bytes_per_param}Ψ/N + L·16·(B/N)·s·h", "3Ψ·(N−1)/N")


def hsdp(shape: Shape, gpus: int, shard_size: int, recipe=mm.MIXED_ADAM, act_bytes: int = 2,
         comm_bytes: int = 2) -> Strategy:
    """Hybrid sharding: ZeRO-3 inside groups of ``shard_size`` GPUs (a node), replicas across.

    Gathers and reduce-scatters stay inside a group (fast links); across groups only each
    GPU's gradient shard is all-reduced, 2(Ψ/G)(R−1)/R elements, instead of ZeRO-3's 3Ψ(N−1)/N
    on the slow links. The price: state is sharded G ways, not N.
    """
    n, g = _degree(gpus), _degree(shard_size, "shard_size")
    if n % g:
        raise ValueError(f"shard_size {g} must divide gpus {n} (replicas = gpus / shard_size)")
    reps = n // g
    ref = zero3(shape, n, recipe, act_bytes, comm_bytes)
    inside = 3 * shape.params * _ring(g) * comm_bytes
    across = 2 * shape.params / g * _ring(reps) * comm_bytes
    return Strategy(f"HSDP ({g} shard × {reps} replicas)", n, mm.model_state_bytes(shape.params, g, recipe)["zero3"],
                ref.activations, inside + across, "16Ψ/G + L·16·(B/N)·s·h",
                "3Ψ(G−1)/G inside a group + 2(Ψ/G)(R−1)/R across groups",
                {"sent_inside_group": inside, "sent_across_groups": across, "replicas": reps})


def cpu_offload(shape: Shape, gpus: int, act_bytes: int = 2, comm_bytes: int = 2) -> Strategy:
    """ZeRO-Offload (with ZeRO-2): optimizer state and fp32 master on the CPU, which also steps.

    The GPU keeps the 2-byte weights (whole, as in ZeRO-2) and streams each GPU's 2-byte
    gradient shard down and its updated 2-byte weight shard up: 4Ψ/N bytes over PCIe a step.
    The CPU holds the gradient shard and the 12 bytes of Adam state per parameter: 14Ψ/N.
    """
    n = _degree(gpus)
    ref = zero3(shape, n, act_bytes=act_bytes, comm_bytes=comm_bytes)
    return Strategy("ZeRO-2 + CPU offload", n, 2 * shape.params, ref.activations,
                mm.ring_bytes_per_rank("zero2", shape.params, n, comm_bytes),
                "2Ψ on GPU (14Ψ/N on CPU) + L·16·(B/N)·s·h", "2Ψ·(N−1)/N; 4Ψ/N bytes over PCIe",
                {"cpu_bytes": 14 * shape.params / n, "pcie_bytes": 4 * shape.params / n})


def tensor_parallel(shape: Shape, gpus: int, recipe=mm.MIXED_ADAM, act_bytes: int = 2, comm_bytes: int = 2) -> Strategy:
    """Megatron tensor parallelism: every weight matrix split N ways, every GPU sees the whole batch.

    Of the 16·b·s·h elements a block saves, the inputs of the two LayerNorms, of ``qkv`` and
    of ``fc`` (4) are replicated; q, k, v, the attention output, and the MLP's two 4h-wide
    tensors (12) are split. Forward all-reduces the attention and the MLP outputs, backward
    their input gradients: 4 all-reduces of B·s·h per layer, 8·B·s·h elements of volume.
    """
    n = _degree(gpus)
    if shape.hidden % n:
        raise ValueError(f"hidden {shape.hidden} does not split over {n} tensor-parallel GPUs")
    r = mm.recipe(recipe)
    acts = shape.layers * (4 * shape.bsh + 12 * shape.bsh / n) * act_bytes
    volume = 8 * shape.layers * shape.bsh
    return Strategy("tensor parallel", n, r.bytes_per_param * shape.params / n, acts,
                volume * _ring(n) * comm_bytes, f"{r.bytes_per_param}Ψ/N + L·(4 + 12/N)·B·s·h",
                "8·L·B·s·h·(N−1)/N (4 all-reduces of B·s·h per layer)")


def pipeline_parallel(shape: Shape, gpus: int, micro_batches: int, recipe=mm.MIXED_ADAM, act_bytes: int = 2,
                      comm_bytes: int = 2) -> Strategy:
    """1F1B pipeline: L/N consecutive layers per GPU, the batch cut into ``micro_batches`` m.

    The first stage holds the activations of min(m, N) micro-batches of its L/N layers,
    which for m ≥ N is L·16·(B/m)·s·h, the whole model's for one micro-batch. A stage sends
    each micro-batch's output forward and its input gradient back: 2·B·s·h elements a step
    (point-to-point, no ring). The bubble: (N−1)/(m+N−1) of the step is idle.
    """
    n, m = _degree(gpus), _degree(micro_batches, "micro_batches")
    if shape.layers % n:
        raise ValueError(f"{shape.layers} layers do not split over {n} pipeline stages")
    if shape.batch % m:
        raise ValueError(f"batch {shape.batch} does not split into {m} micro-batches")
    r = mm.recipe(recipe)
    acts = min(m, n) * (shape.layers // n) * 16 * (shape.bsh // m) * act_bytes
    return Strategy(f"pipeline parallel (1F1B, m={m})", n, r.bytes_per_param * shape.params / n, acts,
                2 * shape.bsh * comm_bytes, f"{r.bytes_per_param}Ψ/N + L·16·(B/m)·s·h (first stage, m ≥ N)",
                "2·B·s·h point-to-point", {"bubble": (n - 1) / (m + n - 1)})


def context_parallel(shape: Shape, gpus: int, recipe=mm.MIXED_ADAM, act_bytes: int = 2, comm_bytes: int = 2) -> Strategy:
    """Context parallelism with ring attention: each GPU takes s/N tokens of every sequence.

    Every activation is per token, so it is split N ways. The weights are whole on every GPU
    (combine with ZeRO to shard them), so their gradients are all-reduced as in DDP. Attention
    needs every token's K and V: they travel around the ring, N−1 hops of B·(s/N)·h each for K
    and for V per layer in forward, and K, V and their gradients again in backward.
    """
    n = _degree(gpus)
    if shape.seq % n:
        raise ValueError(f"sequence length {shape.seq} does not split over {n} context-parallel GPUs")
    r = mm.recipe(recipe)
    kv = 6 * shape.layers * shape.bsh * _ring(n)
    return Strategy("context parallel", n, r.bytes_per_param * shape.params, 16 * shape.layers * shape.bsh / n * act_bytes,
                kv * comm_bytes + mm.ring_bytes_per_rank("ddp", shape.params, n, comm_bytes),
                f"{r.bytes_per_param}Ψ + L·16·B·(s/N)·h", "6·L·B·s·h·(N−1)/N (K, V) + 2Ψ·(N−1)/N",
                {"sent_kv": kv * comm_bytes})


def compare(shape: Shape, gpus: int, *, shard_size: int | None = None, micro_batches: int | None = None) -> list[Strategy]:
    """Every plan on ``gpus`` GPUs, ZeRO-3 first: what notebook 07 tabulates."""
    n = _degree(gpus)
    return [zero3(shape, n), hsdp(shape, n, shard_size or max(1, n // 2)), cpu_offload(shape, n),
            tensor_parallel(shape, n), pipeline_parallel(shape, n, micro_batches or 4 * n), context_parallel(shape, n)]


def table(plans: list[Strategy], unit: str = "GB") -> str:
    """A text table: memory (states + activations) and bytes sent per GPU, beside ZeRO-3's."""
    scale = {"GB": mm.GB, "GiB": mm.GIB, "MB": 1e6}[unit]
    ref = plans[0]
    head = f"{'plan':<32}{'states':>9}{'activ.':>9}{'memory':>9}{'× ZeRO-3':>10}{'sent':>9}{'× ZeRO-3':>10}"
    lines = [head + f"   ({unit} per GPU; sent: per step)", "-" * len(head)]
    for p in plans:
        lines.append(f"{p.name:<32}{p.model_states / scale:>9.2f}{p.activations / scale:>9.2f}"
                     f"{p.memory / scale:>9.2f}{_multiple(p.memory, ref.memory)}"
                     f"{p.sent / scale:>9.2f}{_multiple(p.sent, ref.sent)}")
    return "\n".join(lines)


def _multiple(value: float, ref: float) -> str:
    """``value`` as a multiple of the first plan's (ZeRO-3 in :func:`compare`), or a dash where
    that is 0 (ZeRO-3 on one GPU sends nothing)."""
    return f"{value / ref:>10.2f}" if ref else f"{'—':>10}"
