"""The compute model: a step's kernels against the GPU's roofline, instead of one fraction of peak.

Per block and micro-batch of T = b·s tokens, forward (bf16, 2 bytes an element):

* **each matmul** (q, k, v, the output projection, the FFN's 2 or 3): 2·T·m·n FLOPs and
  2·(T·m + m·n + T·n) bytes; it takes ``max(FLOPs / (η·C), bytes / HBM)``, the roofline, with C
  the card's peak and HBM its memory bandwidth (the data sheets, :mod:`hardware`);
* **fused attention** (FlashAttention): 4·b·s²·h FLOPs are counted (as Narayanan et al. count
  them, and MFU does), but a causal kernel skips the masked half, so half of them run, at η·C;
* **memory-bound kernels** (the two norms, the residual adds, rotary embeddings, the MLP's
  activation): their bytes / HBM, nothing else;
* **a fixed cost per kernel**, τ (:data:`KERNEL_OVERHEAD_S`, launch and tail; not fitted).

Backward: every matmul is two GEMMs of its forward size, memory-bound kernels move twice their
bytes, and attention costs 2.5× its forward (FlashAttention-2 recomputes the scores). Recompute
adds what ``compute.recompute_flops`` says, as forward time. The root runs the output head's
matmul and the loss's fp32 log-softmax (8·T·V bytes each way).

One constant is fitted: η, the fraction of peak a large matmul reaches
(:data:`MATMUL_EFFICIENCY`). ``published.fit_matmul_efficiency`` fits it on torchtitan's A100
runs alone; the H100 runs, the FSDP paper's and Megatron-LM's are never fitted, only predicted
(``tests/test_planner_roofline.py``). Why it can beat one fraction of peak: what does not scale
with FLOPs (memory-bound kernels, small matmuls, per-kernel cost) weighs more on a GPU whose
peak grew faster than its memory bandwidth (H100: 295 FLOPs per byte; A100: 153).
"""

from __future__ import annotations

from shardlab.planner.hardware import GPU
from shardlab.planner.plan import Plan
from shardlab.planner.transformer import Transformer

#: η, fitted on torchtitan's six A100 runs (``published.fit_matmul_efficiency``; a test keeps the
#: fit and this number together).
MATMUL_EFFICIENCY = 0.575
#: τ: seconds a kernel costs beyond its work (launch and tail), a round number of the right order
#: for CUDA kernels issued back to back; not fitted (these runs are too large to tell it apart).
KERNEL_OVERHEAD_S = 5e-6
BYTES = 2  # bf16 activations and weights


def _matmul(tokens: float, m: int, n: int, gpu: GPU, eta: float) -> float:
    flops, moved = 2 * tokens * m * n, BYTES * (tokens * m + m * n + tokens * n)
    return max(flops / (eta * gpu.peak_flops), moved / gpu.hbm_bytes_per_s) + KERNEL_OVERHEAD_S


def block_seconds(model: Transformer, plan: Plan, gpu: GPU, eta: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one block for one micro-batch, recompute included in backward."""
    eta = MATMUL_EFFICIENCY if eta is None else eta
    h, q, kv, f, b, s = model.hidden, model.q_dim, model.kv_dim, model.ffn_size, plan.micro_batch, model.seq
    tokens = b * s
    shapes = [(h, q), (h, kv), (h, kv), (q, h)] + [(h, f)] * (model.ffn_matrices - 1) + [(f, h)]
    matmuls = sum(_matmul(tokens, m, n, gpu, eta) for m, n in shapes)
    counted_attention = 4 * b * s * s * q
    if plan.attention == "fused":
        attention = counted_attention / 2 / (eta * gpu.peak_flops) + KERNEL_OVERHEAD_S
    else:  # eager: two batched matmuls that run whole, and the s×s scores written and read as bytes
        attention = counted_attention / (eta * gpu.peak_flops) + 3 * BYTES * b * model.heads * s * s / gpu.hbm_bytes_per_s
    act = (6 if model.ffn_matrices == 3 else 4) * f  # SwiGLU reads two, writes one; GELU reads one, writes one
    rotary = 0 if model.learned_positions else 4 * (h + kv)
    elementwise = tokens * (8 * h + 12 * h + rotary + act) / gpu.hbm_bytes_per_s + 6 * KERNEL_OVERHEAD_S
    forward = matmuls + attention + elementwise
    backward = 2 * matmuls + 2.5 * attention + 2 * elementwise
    if plan.checkpointing == "full":
        backward += forward
    elif plan.checkpointing == "selective" and plan.attention == "eager":
        backward += attention
    return forward, backward


def root_seconds(model: Transformer, plan: Plan, gpu: GPU, eta: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the root: the output head's matmul and the loss's log-softmax."""
    eta = MATMUL_EFFICIENCY if eta is None else eta
    tokens = plan.micro_batch * model.seq
    head = _matmul(tokens, model.hidden, model.vocab, gpu, eta)
    loss = 8 * tokens * model.vocab / gpu.hbm_bytes_per_s + 2 * KERNEL_OVERHEAD_S
    return head + loss, 2 * head + loss
