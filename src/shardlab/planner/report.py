"""A plan's answer as plain text and as a dict: one formatter for the CLI and the notebook widget.

Every number here is a formula's value (the planner's), never a measurement; the figures it
quotes from "How to Scale Your Model" are published figures, labelled as such.
"""

from __future__ import annotations

import math

from shardlab.planner import ACHIEVABLE_FRACTION, Prediction
from shardlab.planner import network_model as nm
from shardlab.planner.anchors import bytes_per_param, knee
from shardlab.planner.plan import Plan

GIB = 2**30


FLAG_WIDTH = 46  # the widest flag below, "--network-model nccl --overlap-efficiency F", and a gap


def assumptions(plan: Plan, fraction: float = ACHIEVABLE_FRACTION, network: str = "ideal",
                bucket_mb: float | None = None, overlap_efficiency: float | None = None) -> list[tuple[str, str, str]]:
    """Every assumption that decides an answer: (what, what this plan assumes, the flag that changes it).

    ``bucket_mb`` and ``overlap_efficiency`` as passed to :func:`~shardlab.planner.step_time`
    (None: the model's default); the rows show the values the step was priced with."""
    zero12, nccl = plan.row.gathers_params_after_step, network == "nccl"
    bucket, eff = nm.network_knobs(network, bucket_mb, overlap_efficiency)
    eff_source = "an assumption, not a published number" if overlap_efficiency is None else "your value"
    bucket_source = "PyTorch's default" if bucket_mb is None else "your value"
    return [
        ("attention kernel", "fused (SDPA / FlashAttention): no s×s scores kept" if plan.attention == "fused"
         else "eager: the s×s scores are kept (Korthikanti's 5·a·s/h)", "--attention eager|fused"),
        ("activation checkpointing", plan.checkpointing, "--checkpointing none|selective|full"),
        ("reduce dtype", f"gradients reduced in {plan.reduce_dtype}", "--reduce-dtype fp32|bf16"),
        ("gathers", "the next unit prefetched" if plan.prefetch else "no prefetch", "--no-prefetch"),
        ("ZeRO-1/2 parameter all-gather", ("hidden under the next forward" if plan.overlap_param_gather
                                           else "exposed after the step") if zero12 else "(not this stage)",
         "--overlap-param-gather"),
        ("gradient reduction", ("as each unit's gradients are ready" if plan.row.reduce_as_ready
         else "after the whole backward, as the engine's ZeRO-1 does: it cannot hide under backward")
         + " (the stage's rule; DeepSpeed's overlap_comm is not modelled)", "--plan"),
        ("gradient accumulation", "ZeRO-2/3 and HSDP reduce every micro-batch; DDP and ZeRO-1 once a step",
         "--grad-accum N"),
        ("HSDP's deferral", "the all-reduce across replicas on the last micro-batch only "
         "(FSDP2: set_requires_all_reduce(False) on the others)", "--plan hsdp --grad-accum N"),
        ("NIC sharing", "a ring with p GPUs on each node gets p/G of the node's NICs", "--nics-per-node"),
        ("network bus", f"NCCL's: {nm.NIC_EFFICIENCY:.0%} of the NICs, {nm.NVLINK_EFFICIENCY:.0%} of NVLink "
         f"(NCCL's maintainer), {nm.ALPHA_US} µs a ring hop (fitted on a published curve); rings, no trees"
         if nccl else "the line rates, the link table's latencies; bus bandwidth does not fall with size",
         "--network-model ideal|nccl"),
        ("overlap", f"a transfer hides wherever the link is free; compute at {eff:.0%} beside it "
         f"(NCCL takes SMs; {eff_source}), reported as contention; the last reductions never hide" if nccl else
         "perfect: a transfer hides wherever the link is free, NCCL takes no SMs; the last reductions never hide",
         "--network-model nccl --overlap-efficiency F"),
        ("buckets", f"DDP all-reduces in {bucket / nm.MiB:g} MiB buckets ({bucket_source}), each paying its "
         "ring latency, cut per unit (a small unit still pays a whole α) and issued after the unit's backward "
         "(PyTorch issues each as it fills); the others one collective per unit" if nccl else
         "one collective per unit", "--network-model nccl --bucket-mb M"),
        ("achieved fraction of peak", f"{fraction:.0%} for every GPU, model and micro-batch", "--fraction"),
    ]


def text(pred: Prediction, comparison: dict, *, fraction: float = ACHIEVABLE_FRACTION, anchors: bool = True,
         compute: str = "fraction", network: str = "ideal", bucket_mb: float | None = None,
         overlap_efficiency: float | None = None) -> str:
    """The plan's breakdown and the comparison, as plain text (a formula's values, not measurements)."""
    m, c, plan, mem, t = pred.model, pred.cluster, pred.plan, pred.memory, pred.timing
    lines = [f"{m.name} ({m.params / 1e9:.3g}B params, seq {m.seq}) on {c.describe()}",
             f"plan: {plan.label}, micro-batch {plan.micro_batch} × {plan.grad_accum} accumulation, "
             f"prefetch {'on' if plan.prefetch else 'off'}, {plan.recipe}, {plan.attention} attention, "
             f"reduce in {plan.reduce_dtype}",
             "", "memory per GPU (formula)"]
    for name, value in mem.parts().items():
        lines.append(f"  {name:<16}{value / GIB:>9.2f} GiB")
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    lines += [f"  {'total':<16}{mem.total / GIB:>9.2f} GiB of {c.gpu.memory_bytes / GIB:.0f} GiB: {verdict}",
              "", "step time per GPU (formula)",
              f"  {'compute':<16}{t.compute_s:>9.3f} s  (" + (f"{fraction:.0%} of {c.gpu.peak_flops / 1e12:.0f} TFLOPS peak)"
              if compute == "fraction" else f"roofline: each kernel against {c.gpu.peak_flops / 1e12:.0f} TFLOPS "
              f"and {c.gpu.hbm_bytes_per_s / 1e12:.2f} TB/s)"),
              f"  {'exposed comm':<16}{t.exposed_comm_s:>9.3f} s  (of {t.link_s:.3f} s the links were busy)",
              *([f"  {'contention':<16}{t.contention_s:>9.3f} s  (compute slowed beside hidden transfers)"]
                if network == "nccl" else []),
              f"  {'step':<16}{t.step_s:>9.3f} s",
              f"  {t.tokens_per_s:,.0f} tokens/s/GPU, {t.tflops_per_gpu:.0f} TFLOPS/GPU (recompute counted), "
              f"MFU {t.mfu:.0%}"]
    k = knee(plan.micro_batch * m.seq, c, plan, fraction=fraction)
    lines += ["", (f"knee: {k.tokens:,.0f} tokens per GPU per micro-batch; this plan runs "
                   f"{k.tokens_per_micro_batch:,.0f}, so communication {'can hide' if k.hides else 'cannot hide'}")
              if math.isfinite(k.tokens) else "knee: none; the gradient reduction cannot hide under backward",
              f"  {k.formula}"]
    if k.book is not None:
        lines.append(f"  How to Scale Your Model (published figure, bf16, full peak, {k.book_span}): {k.book:,} tokens per H100")
    lines += ["", f"{'plan':<30}{'GiB/GPU':>9}  {'fits':<5}{'step s':>9}{'TFLOPS':>8}"]
    for p in comparison["predictions"]:
        lines.append(f"{p.plan.label:<30}{p.memory.total / GIB:>9.1f}  {'yes' if p.memory.fits else 'no':<5}"
                     f"{p.timing.step_s:>9.3f}{p.timing.tflops_per_gpu:>8.0f}")
    first, fastest = comparison["first_fit"], comparison["fastest"]
    if first is None:
        lines.append("Nothing fits: add GPUs, checkpoint activations, or shrink the micro-batch.")
    else:
        lines.append(f"First plan that fits: {first.plan.label}. Fastest that fits: {fastest.plan.label}.")
    if anchors:
        lines += ["", "assumptions that decide the answer (and the flag that changes each)"]
        lines += [f"  {what:<30}{flag:<{FLAG_WIDTH}}{value}"
                  for what, value, flag in assumptions(plan, fraction, network, bucket_mb, overlap_efficiency)]
        lines += ["", f"bytes per parameter elsewhere, recomputed (DeepSpeed's at N = {c.gpus})"]
        lines += [f"  {r.source:<30}{r.published:>9} -> {r.recomputed:5.2f}  {r.assumption}" for r in bytes_per_param(c.gpus)]
    lines.append("A model, not a measurement: no optimizer step, no stragglers; notebook 08 sets it beside published runs.")
    return "\n".join(lines)


def as_dict(pred: Prediction, *, fraction: float = ACHIEVABLE_FRACTION) -> dict:
    """The same numbers for programs (``--json``)."""
    t, mem, plan = pred.timing, pred.memory, pred.plan
    k = knee(plan.micro_batch * pred.model.seq, pred.cluster, plan, fraction=fraction)
    return {"plan": plan.label, "stage": plan.stage,
            "memory_bytes": {**{k_.replace(" ", "_"): v for k_, v in mem.parts().items()}, "total": mem.total,
                             "card": mem.card}, "fits": mem.fits,
            "step_s": t.step_s, "compute_s": t.compute_s, "exposed_comm_s": t.exposed_comm_s, "link_s": t.link_s,
            "contention_s": t.contention_s,
            "tokens_per_s_per_gpu": t.tokens_per_s, "tflops_per_gpu": t.tflops_per_gpu, "mfu": t.mfu,
            "knee": {"tokens_per_gpu": k.tokens if math.isfinite(k.tokens) else None, "formula": k.formula, "tokens_per_micro_batch": k.tokens_per_micro_batch,
                     "hides": k.hides, "book_published_tokens_per_h100": k.book, "book_span": k.book_span}}


def anchors_dict(gpus: int, plan: Plan, fraction: float = ACHIEVABLE_FRACTION, network: str = "ideal",
                 bucket_mb: float | None = None, overlap_efficiency: float | None = None) -> dict:
    """The network knobs the step ran with, the assumptions and the bytes-per-parameter table, for ``--json``."""
    bucket, eff = nm.network_knobs(network, bucket_mb, overlap_efficiency)
    rows = assumptions(plan, fraction, network, bucket_mb, overlap_efficiency)
    return {"ddp_bucket_mb": None if bucket is None else bucket / nm.MiB, "overlap_efficiency": eff,
            "assumptions": [dict(what=w, assumed=v, flag=f) for w, v, f in rows],
            "bytes_per_param": [dict(source=r.source, published=r.published, recomputed=r.recomputed,
                                     assumption=r.assumption) for r in bytes_per_param(gpus)]}
