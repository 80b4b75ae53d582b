"""The network model (``--network-model nccl``) beside published numbers: all-reduce curves and scaling runs.

Two kinds of check, each a :class:`~shardlab.planner.published.Row`:

* **the bus**: busbw at a message size on the curve α was fitted on (all_reduce_bench.py on
  4 × 8 B200, ``kind="calibration"``, shown, never counted), and on the curve held out from that
  fit (nccl-tests on 8 H200) two ways: the planner's own one-node bus (η·450 = 370 GB/s) against
  it, the prediction; and the shape only, its plateau read off the same curve (``kind="shape"``,
  shown, never counted);
* **scaling**: throughput per GPU at each size of a published data-parallel or FSDP run, and the
  ratio from its smallest size to its largest, predicted with the same constants (nothing here is
  fitted on a run). Megatron-LM's ZeRO-3 collapse stays a miss, with its reason.

No published DDP (all-reduce) scaling run is checked: the PyTorch DDP paper (Li et al. 2020,
arXiv 2006.15704) shows its ResNet50 and BERT scaling to 256 GPUs as figures only, and we could not
read exact numbers from a source, so none is invented here.
"""

from __future__ import annotations

from shardlab.planner import cluster
from shardlab.planner import network_model as nm
from shardlab.planner import published as pub
from shardlab.planner.groups import group_link
from shardlab.planner.published import TOLERANCE, Row

#: the sizes of each curve notebook 08 shows (all from VALID_FROM up, where the model holds)
SHOWN = (8 * nm.MiB, 64 * nm.MiB, 256 * nm.MiB, 1024 * nm.MiB)
SOURCE = "stas00/ml-engineering, network/benchmarks"

WHY = {
    "megatron": ("Known: with NCCL's bus (η 0.96 of the NICs, 4.6 µs a ring hop) ZeRO-3's 1536-GPU ring pays "
                 "1535 hops per gather, ~7 ms, 96 layers × 3 collectives a step: ~2 s, still under the ~19 s of "
                 "compute, and a 10% compute cost beside each transfer adds ~1 s, so the model predicts ~148 "
                 "TFLOPS, not 44. Not known: why the run was slower. Hypothesis: DeepSpeed's ZeRO-3 of 2021 "
                 "overlapped or ran its collectives far worse than NCCL's bus allows (the 1536-GPU step would "
                 "need ~50 s exposed); PyTorch FSDP's 173 TFLOPS at 512 GPUs fits it, but on another cluster."),
    "h100": pub.WHY["h100-roofline"],
}


def megatron_tflops(gpus: int) -> float:
    return pub.megatron_tflops(gpus, network="nccl")


def fsdp_tflops(gpus: int, batch: int) -> float:
    return pub.fsdp_tflops(gpus, batch, network="nccl")


def torchtitan_h100_tps(gpus: int) -> float:
    return pub.torchtitan_h100_tps(gpus, network="nccl")


def planner_one_node_bus_gbs() -> float:
    """The bus the planner prices a collective on one 8-GPU NVLink 4 node with (GB/s): η·450 = 370."""
    return group_link(cluster("h200", 8), 8, 8, "nccl").bandwidth_gbps / 8


def bus_rows() -> list[Row]:
    """busbw at :data:`SHOWN` sizes: the fitted curve, then the held-out one against the planner's
    bus (the prediction) and with its own plateau (the shape only)."""
    out = []
    for name, n, points, role in nm.CURVES:
        published = dict(points)
        ways = ([("plateau read from the curve", None, "calibration")] if role == "fitted" else
                [("the planner's bus", planner_one_node_bus_gbs(), "prediction"),
                 ("shape only, plateau read from the curve", None, "shape")])
        for how, plateau, kind in ways:
            for size, ratio in nm.curve_ratios(n, points, plateau_gbs=plateau):
                if size in SHOWN:
                    out.append(Row(f"{name}, {size // nm.MiB} MiB, {how}: busbw GB/s", SOURCE, published[size],
                                   ratio * float(published[size]), TOLERANCE, kind=kind))
    return out


def scaling_rows() -> list[Row]:
    """Each run at its smallest and largest size, and the ratio between them."""
    out = []
    mega = {n: megatron_tflops(n) for n in pub.MEGATRON}
    for n, (micro, tflops) in pub.MEGATRON.items():
        out.append(Row(f"ZeRO-3 175B, {n} A100, micro-batch {micro}: TFLOPS/GPU", "Megatron-LM 2021, Table 2",
                       tflops, mega[n], TOLERANCE, "" if n == 384 else WHY["megatron"]))
    out.append(Row("ZeRO-3 175B, TFLOPS/GPU 1536 / 384 A100", "Megatron-LM 2021, Table 2",
                   pub.MEGATRON[1536][1] / pub.MEGATRON[384][1], mega[1536] / mega[384], TOLERANCE, WHY["megatron"]))
    small, big = pub.FSDP_GPUS[0], pub.FSDP_GPUS[-1]
    for batch, tflops in pub.FSDP.items():
        at = {n: fsdp_tflops(n, batch) for n in (small, big)}
        out.append(Row(f"FSDP 175B, {big} A100, batch {batch}: TFLOPS/GPU", "PyTorch FSDP 2023, §5.4", tflops,
                       at[big], TOLERANCE))
        out.append(Row(f"FSDP 175B, batch {batch}: TFLOPS/GPU {big} / {small} A100 (linear: 1)",
                       "PyTorch FSDP 2023, Fig. 7(b)", 1.0, at[big] / at[small], TOLERANCE))
    tt = {n: torchtitan_h100_tps(n) for n in pub.TORCHTITAN_H100}
    for n, tps in pub.TORCHTITAN_H100.items():
        out.append(Row(f"torchtitan H100 llama3-8b, {n} GPUs: tokens/s/GPU (roofline)", "torchtitan 2024, Tables 1, 3",
                       tps, tt[n], TOLERANCE, WHY["h100"]))
    out.append(Row("torchtitan H100 llama3-8b: tokens/s/GPU 128 / 8 GPUs", "torchtitan 2024, Tables 1, 3",
                   pub.TORCHTITAN_H100[128] / pub.TORCHTITAN_H100[8], tt[128] / tt[8], TOLERANCE))
    return out
