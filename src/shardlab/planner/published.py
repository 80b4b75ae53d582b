"""Published runs beside the planner: each case, its source, its number, the prediction, the ratio.

One home for the cases, so that ``tests/test_planner_published.py`` checks them and notebook
08 shows them from the same code. Every prediction uses the presets as they are and the one
``planner.ACHIEVABLE_FRACTION``; nothing is fitted to a case. Each row is one of two kinds:

* a **prediction**: a number a paper published, against the planner's formula, within
  :data:`TOLERANCE` (±25%) or a miss with its reason;
* an **identity**: the planner's formula evaluated where the paper evaluates the same formula.
  It cannot miss, so it is shown but never counted as a check.

``WHY`` says, for the cases the planner gets wrong, what is known and what is only a hypothesis.
Every published figure is a ``Published`` value carrying its source (``instruments.measured``);
the planner's predictions stay plain formulas' values, and a ratio of the two is plain.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.instruments.link import Link
from shardlab.instruments.measured import Published
from shardlab.planner import Plan, Transformer, cluster, gpu, memory, model, network, step_time
from shardlab.planner.hardware import GPUCluster
from shardlab.planner.memory import korthikanti_layer_bytes

GIB = 2**30
GPT3 = model("gpt3-175b")  # 96 layers, h 12288, 96 heads, vocab 51200, seq 2048: 174.6B

#: Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473), Table 2, "ZeRO-3 without model parallelism":
#: 174.6B, global batch 1536, A100-80GB on Selene (8 × HDR 200 Gb/s a node); GPUs -> (micro-batch, TFLOPS/GPU),
#: TFLOPS counted with recompute (their eq. 3), as ``Timing.tflops_per_gpu`` is.
MEGATRON = {n: (micro, Published(tflops, source="Narayanan et al. 2021 (Megatron-LM), Table 2"))
            for n, micro, tflops in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))}

#: PyTorch FSDP (Zhao et al. 2023, arXiv 2304.11277), §5.4, Fig. 7(b): minGPT-175B (vocab 50000, block
#: 2048), full sharding, backward prefetch, activation checkpointing, bf16, A100-80GB on "a 2Tb/s RoCE
#: network": more than 173 and 186 TFLOPS/GPU at batch 1 and 2, linear from 128 to 512 GPUs. The paper
#: gives no layers or hidden size: we assume GPT-3's (96, 12288, 96 heads), and read 2 Tb/s as a node's
#: total over 8 NICs (:func:`fsdp_cluster`).
MINGPT = Transformer("minGPT-175B", 96, 12288, 96, 50000, 2048, tied=False)
FSDP = {b: Published(tflops, source="Zhao et al. 2023 (PyTorch FSDP), §5.4") for b, tflops in ((1, 173), (2, 186))}
FSDP_GPUS = (128, 192, 256, 384, 512)

#: torchtitan, docs/performance.md (Dec 2024), Tables 1 and 3: Llama 3.1 8B, FSDP2, local batch 2,
#: selective activation checkpointing, H100: 82.4 GiB a GPU on 8 GPUs, 67.0 GiB on 128.
TORCHTITAN = {n: Published(gib, source="torchtitan docs/performance.md (2024), Tables 1, 3")
              for n, gib in ((8, 82.4), (128, 67.0))}

TOLERANCE = 0.25

WHY = {
    "megatron": ("Known: Megatron-LM published DeepSpeed's ZeRO-3 at 144, 88 and 44 TFLOPS/GPU (Table 2), and "
                 "every GPU's traffic per step (3Ψ) does not shrink with N. The "
                 "planner's formula says Selene's 8 HDR NICs a node carry that 3Ψ in ~8 s, under 19-75 s of "
                 "compute, so it predicts ~155 TFLOPS at every size. Not known: why the run was slower. "
                 "Hypotheses: the implementation (DeepSpeed's ZeRO-3 of 2021) overlapped or ran its "
                 "collectives worse than the hardware allows; or the planner is too optimistic (every ring "
                 "gets all of a node's NICs, where nccl-tests reach ~96%; overlap is perfect; NCCL takes no "
                 "SMs from compute; `--network-model nccl` models all three and still predicts ~148 TFLOPS at "
                 "1536 GPUs). PyTorch FSDP's 173 TFLOPS at 512 GPUs fits the first, but ran on another "
                 "cluster and stops below 768, so it cannot decide."),
    "fsdp-batch-2": ("within tolerance, but low: compute-bound there, the planner predicts 50% of peak for every "
                     "batch; the paper's batch-2 runs reached 60%. Larger micro-batches run bigger, more "
                     "efficient matmuls, which one fixed fraction of peak does not know."),
}


def megatron_tflops(gpus: int, network: str = "ideal") -> float:
    """Megatron-LM's ZeRO-3 run at ``gpus`` A100s, by the planner (``network``: its network model)."""
    micro, _ = MEGATRON[gpus]
    plan = Plan("zero3", micro_batch=micro, checkpointing="full")
    return step_time(GPT3, cluster("a100", gpus, "ib-hdr"), plan, network=network).tflops_per_gpu


def fsdp_cluster(gpus: int) -> GPUCluster:
    """The FSDP paper's cluster as we read it: A100s, 8 a node, 2 Tb/s of RoCE a node over 8 NICs."""
    return GPUCluster(gpu("a100"), gpus, 8, network("nvlink3"), Link("RoCE, 2 Tb/s a node", 250.0, 5.0), 8)


def fsdp_tflops(gpus: int, batch: int, network: str = "ideal", compute: str = "fraction") -> float:
    plan = Plan("zero3", micro_batch=batch, checkpointing="full")
    return step_time(MINGPT, fsdp_cluster(gpus), plan, network=network, compute=compute).tflops_per_gpu


def torchtitan_drop_gib() -> float:
    """Predicted memory drop per GPU from 8 to 128 GPUs: only the sharded states change, 16Ψ(1/8 − 1/128)."""
    llama, plan = model("llama3-8b"), Plan("zero3", micro_batch=2, checkpointing="selective")
    at = {n: memory(llama, cluster("h100", n, "ib-ndr"), plan).total for n in TORCHTITAN}
    return (at[8] - at[128]) / GIB


@dataclass(frozen=True)
class Row:
    case: str
    source: str
    published: float
    predicted: float
    tolerance: float  # relative
    why: str = ""  # what is known and what is a hypothesis, where the planner misses (or is close to)
    kind: str = "prediction"  # "identity": the formula beside itself; "calibration": a run a constant was fitted
    # on; "shape": a curve held out from a fit but whose height was read off it, so only its shape is checked

    @property
    def ratio(self) -> float:
        return float(self.predicted) / float(self.published)

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= self.tolerance


def rows() -> list[Row]:
    """Every published case with a number, in the order notebook 08 shows them."""
    eager = dict(checkpointing="none", attention="eager")  # the paper's own count: unfused attention
    # Korthikanti's 114·sbh = 2.87 GB a GPT-3 layer is not a row: the paper prints the formula, not
    # that number, so it would sit under "published" as a formula's value (notebook 08 prints it
    # as the formula it is; tests/test_planner_published.py checks it).
    out = [Row("selective recompute removes", "Korthikanti et al. 2022", 0.70,
               1 - korthikanti_layer_bytes(GPT3, 1, "selective") / korthikanti_layer_bytes(GPT3, 1, **eager), 0.02,
               kind="identity")]
    for n, (micro, tflops) in MEGATRON.items():
        out.append(Row(f"ZeRO-3 175B, {n} A100, micro-batch {micro}: TFLOPS/GPU", "Megatron-LM 2021, Table 2",
                       tflops, megatron_tflops(n), TOLERANCE, "" if n == 384 else WHY["megatron"]))
    for batch, tflops in FSDP.items():
        out.append(Row(f"FSDP 175B, 512 A100, batch {batch}: TFLOPS/GPU", "PyTorch FSDP 2023, §5.4", tflops,
                       fsdp_tflops(512, batch), TOLERANCE, "" if batch == 1 else WHY["fsdp-batch-2"]))
    out.append(Row("Llama 3 8B memory drop, 8 -> 128 H100, GiB", "torchtitan 2024, Tables 1, 3",
                   TORCHTITAN[8] - TORCHTITAN[128], torchtitan_drop_gib(), TOLERANCE))
    return out


def predictions(items: list[Row] | None = None) -> list[Row]:
    """The rows that check something: a published measurement against the planner's formula."""
    return [r for r in (rows() if items is None else items) if r.kind == "prediction"]


def table(items: list[Row] | None = None) -> str:
    """The rows as text: case, published, predicted, ratio, and whether it is within tolerance."""
    items = rows() if items is None else items
    width = max(54, *(len(r.case) + 1 for r in items))
    lines = [f"{'case':<{width}}{'published':>10}{'formula':>10}{'ratio':>7}  within?",
             "-" * (width + 46)]
    for r in items:
        if r.kind == "identity":
            verdict = "identity: the paper's formula, not a check"
        else:
            verdict = f"yes (±{r.tolerance:.0%})" if r.within else f"NO (±{r.tolerance:.0%}): see why"
            verdict = {"calibration": "fitted on, ", "shape": "shape only, "}.get(r.kind, "") + verdict
        lines.append(f"{r.case:<{width}}{r.published:>10.4g}{r.predicted:>10.4g}{r.ratio:>7.2f}  {verdict}")
    return "\n".join(lines)


# -- the compute model's families: one fitted, the others only predicted -----------------------------
#: torchtitan, docs/performance.md at commit 0413364 (2024): FSDP2 on 64 A100 80GB, bf16, tokens/s/GPU
#: ("WPS") with its MFU. (model, local batch, checkpointing, tokens/s/GPU). torchtitan's "selective op"
#: and "selective layer" are both read as selective; its A100 network is not stated (we assume 8 HDR
#: NICs a node, where these steps are compute-bound). The ONE family the roofline's η is fitted on.
TORCHTITAN_A100 = tuple((name, b, ck, Published(tps, source="torchtitan docs/performance.md at 0413364"))
                        for name, b, ck, tps in (("llama3-8b", 1, "selective", 2973), ("llama3-70b", 1, "full", 331),
                                                 ("llama2-13b", 2, "none", 2162), ("llama2-13b", 2, "selective", 1904),
                                                 ("llama2-70b", 1, "selective", 355), ("llama2-70b", 2, "full", 353)))
#: torchtitan, docs/performance.md at commit eaea6f6 (Dec 2024), Tables 1 and 3: Llama 3.1 8B, FSDP2,
#: local batch 2, selective checkpointing, H100 HBM2e at 500 W: 5,762 tokens/s/GPU on 8 GPUs, 5,605 on
#: 128 ("33% to 39% MFU", against the SXM peak). Held out: never fitted.
TORCHTITAN_H100 = {n: Published(tps, source="torchtitan docs/performance.md at eaea6f6, Tables 1, 3")
                   for n, tps in ((8, 5762), (128, 5605))}


def torchtitan_a100_tps(name: str, batch: int, checkpointing: str, eta: float | None = None) -> float:
    plan = Plan("zero3", micro_batch=batch, checkpointing=checkpointing)
    t = step_time(model(name), cluster("a100", 64, "ib-hdr"), plan, compute="roofline", matmul_efficiency=eta)
    return t.tokens_per_s


def torchtitan_h100_tps(gpus: int, eta: float | None = None, network: str = "ideal") -> float:
    plan = Plan("zero3", micro_batch=2, checkpointing="selective")
    t = step_time(model("llama3-8b"), cluster("h100-hbm2e", gpus, "ib-ndr"), plan, compute="roofline",
                  matmul_efficiency=eta, network=network)
    return t.tokens_per_s


def fit_matmul_efficiency(lo: float = 0.30, hi: float = 0.95, step: float = 0.005) -> float:
    """η that best fits torchtitan's A100 runs (least squares of log(predicted / published)), on a grid."""
    import math

    def loss(eta):
        return sum(math.log(torchtitan_a100_tps(*run[:3], eta=eta) / float(run[3])) ** 2 for run in TORCHTITAN_A100)

    grid = [lo + i * step for i in range(int(round((hi - lo) / step)) + 1)]
    return round(min(grid, key=loss), 3)


WHY["h100-roofline"] = (
    "Known: torchtitan's H100s are the 96 GB HBM2e variant at a 500 W power limit, and torchtitan says their "
    "real peak lies between SXM's 989 and NVL's 835 TFLOPS and is not known; their published 33-39% MFU is "
    "against the SXM peak. The roofline, with η fitted on A100s and the SXM peak, predicts ~58% MFU. "
    "Hypotheses, not tested here: the power limit lowers the clocks well below either peak; FlashAttention-2 "
    "reaches a lower fraction of Hopper's peak than of Ampere's.")


def roofline_rows() -> list[Row]:
    """The compute model against its families: the fitted one (A100) and the held-out ones."""
    out = [Row(f"torchtitan A100 {name}, batch {b}, {ck} ckpt: tokens/s/GPU", "torchtitan 2024 (fitted on)",
               tps, torchtitan_a100_tps(name, b, ck), TOLERANCE, kind="calibration")
           for name, b, ck, tps in TORCHTITAN_A100]
    out += [Row(f"torchtitan H100 llama3-8b, {n} GPUs: tokens/s/GPU", "torchtitan 2024, Tables 1, 3", tps,
                torchtitan_h100_tps(n), TOLERANCE, WHY["h100-roofline"]) for n, tps in TORCHTITAN_H100.items()]
    for batch, tflops in FSDP.items():
        out.append(Row(f"FSDP 175B, 512 A100, batch {batch}: TFLOPS/GPU (roofline)", "PyTorch FSDP 2023, §5.4",
                       tflops, fsdp_tflops(512, batch, compute="roofline"), TOLERANCE))
    plan = Plan("zero3", micro_batch=4, checkpointing="full")
    out.append(Row("ZeRO-3 175B, 384 A100, micro-batch 4: TFLOPS/GPU (roofline)", "Megatron-LM 2021, Table 2", 144,
                   step_time(GPT3, cluster("a100", 384, "ib-hdr"), plan, compute="roofline").tflops_per_gpu, TOLERANCE))
    return out
