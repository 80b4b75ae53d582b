"""A plan's answer as plain text and as a dict: one formatter for the CLI and the notebook widget."""

from __future__ import annotations

from shardlab.planner import ACHIEVABLE_FRACTION, Prediction

GIB = 2**30


def text(pred: Prediction, comparison: dict) -> str:
    """The plan's breakdown and the comparison, as plain text."""
    m, c, plan, mem, t = pred.model, pred.cluster, pred.plan, pred.memory, pred.timing
    lines = [f"{m.name} ({m.params / 1e9:.3g}B params, seq {m.seq}) on {c.describe()}",
             f"plan: {plan.label}, micro-batch {plan.micro_batch} × {plan.grad_accum} accumulation, "
             f"prefetch {'on' if plan.prefetch else 'off'}, {plan.recipe}",
             "", "memory per GPU"]
    for name, value in mem.parts().items():
        lines.append(f"  {name:<16}{value / GIB:>9.2f} GiB")
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    lines += [f"  {'total':<16}{mem.total / GIB:>9.2f} GiB of {c.gpu.memory_bytes / GIB:.0f} GiB: {verdict}",
              "", "step time per GPU",
              f"  {'compute':<16}{t.compute_s:>9.3f} s  ({ACHIEVABLE_FRACTION:.0%} of {c.gpu.peak_flops / 1e12:.0f} TFLOPS peak)",
              f"  {'exposed comm':<16}{t.exposed_comm_s:>9.3f} s  (of {t.link_s:.3f} s the links were busy)",
              f"  {'step':<16}{t.step_s:>9.3f} s",
              f"  {t.tokens_per_s:,.0f} tokens/s/GPU, {t.tflops_per_gpu:.0f} TFLOPS/GPU (recompute counted), "
              f"MFU {t.mfu:.0%}", "", f"{'plan':<30}{'GiB/GPU':>9}  {'fits':<5}{'step s':>9}{'TFLOPS':>8}"]
    for p in comparison["predictions"]:
        lines.append(f"{p.plan.label:<30}{p.memory.total / GIB:>9.1f}  {'yes' if p.memory.fits else 'no':<5}"
                     f"{p.timing.step_s:>9.3f}{p.timing.tflops_per_gpu:>8.0f}")
    first, fastest = comparison["first_fit"], comparison["fastest"]
    if first is None:
        lines.append("Nothing fits: add GPUs, checkpoint activations, or shrink the micro-batch.")
    else:
        lines.append(f"First plan that fits: {first.plan.label}. Fastest that fits: {fastest.plan.label}.")
    lines.append("Model only: no optimizer step, no stragglers; see notebook 08 for what it gets right and wrong.")
    return "\n".join(lines)


def as_dict(pred: Prediction) -> dict:
    t, mem = pred.timing, pred.memory
    return {"plan": pred.plan.label, "stage": pred.plan.stage,
            "memory_bytes": {**{k.replace(" ", "_"): v for k, v in mem.parts().items()}, "total": mem.total,
                             "card": mem.card}, "fits": mem.fits,
            "step_s": t.step_s, "compute_s": t.compute_s, "exposed_comm_s": t.exposed_comm_s, "link_s": t.link_s,
            "tokens_per_s_per_gpu": t.tokens_per_s, "tflops_per_gpu": t.tflops_per_gpu, "mfu": t.mfu}
