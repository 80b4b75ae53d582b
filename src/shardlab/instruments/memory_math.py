"""The formulas: per-device model-state memory and communication of DDP and ZeRO-1/2/3.

These are the textbook numbers (ZeRO paper, Rajbhandari et al. 2020, §3 and §7) that the
course sets beside live measurements. Notation follows the paper: ``params`` is Ψ, the
parameter count; ``world_size`` is Nd, the data-parallel degree. A :class:`Recipe` says how
many bytes each parameter costs as weights, gradients and optimizer state. Byte counts are
exact (no rounding), and the functions also accept :class:`fractions.Fraction` so a test can
check a printed table without float error. "GB" is 10^9 bytes, the paper's unit; GiB is 2^30.

Only *model states* are counted. Activations, gathered units at stage 3, communication
buffers and allocator fragmentation come on top: see :func:`gathered_unit_bytes`,
:func:`activation_bytes` and the measured instruments. Byte and element counts come back as
:class:`~shardlab.instruments.measured.Formula` numbers, so they cannot pass for measurements. Run ``python -m shardlab memory --params 7.5e9 --gpus 64`` for the CLI table.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from shardlab.instruments import stages
from shardlab.instruments.measured import returns_formula

GB = 10**9
GIB = 2**30
STAGES = stages.NAMES
STAGE_LABELS = {s.name: s.label for s in stages.STAGES.values()}


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each kind of model state.

    ``param_bytes`` are the weights the forward pass uses, ``grad_bytes`` every gradient
    buffer, ``optim_bytes`` (the paper's K) everything the optimizer keeps, master weights
    included. ZeRO-1 shards the optimizer bytes, ZeRO-2 also the gradient bytes, ZeRO-3 all.
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    description: str = ""

    @property
    def bytes_per_param(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes


RECIPES = {
    r.name: r
    for r in (
        Recipe("mixed-adam", 2, 2, 12, "fp16/bf16 weights and grads; fp32 master, momentum, variance (ZeRO paper, K=12)"),
        Recipe("fp32-adam", 4, 4, 8, "fp32 weights and grads; fp32 momentum and variance"),
        Recipe("sgd-momentum", 4, 4, 4, "fp32 weights and grads; one fp32 momentum buffer"),
        # The Ultra-Scale Playbook's ~20 B/param: bf16 grads (2) plus an fp32 accumulation
        # buffer (4) that the 16-byte story leaves out, so grad_bytes = 6.
        Recipe("bf16-fp32-grads", 2, 6, 12, "bf16 weights and grads, fp32 grad accumulation, fp32 master/m/v (Playbook, 20 B/param)"),
    )
}
MIXED_ADAM = RECIPES["mixed-adam"]

# Elements each rank moves per step, in multiples of Ψ, and which collectives move them.
COMM_COLLECTIVES = {s.name: s.collectives for s in stages.STAGES.values()}


def recipe(name_or_recipe) -> Recipe:
    """Look a recipe up by name (a :class:`Recipe` passes through)."""
    if isinstance(name_or_recipe, Recipe):
        return name_or_recipe
    if name_or_recipe not in RECIPES:
        raise ValueError(f"unknown recipe {name_or_recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name_or_recipe]


def stage_name(stage) -> str:
    """Normalise 0-3 or 'ddp'/'zero1'/'zero-2'/'ZeRO-3' to one of :data:`STAGES`."""
    return stages.stage(stage).name


def _check(params, world_size):
    if not isinstance(params, numbers.Real) or isinstance(params, bool) or params <= 0:
        raise ValueError(f"params must be a positive number, got {params!r}")
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size (number of devices) must be a positive integer, got {world_size!r}")


@returns_formula("memory_math.model_state_breakdown (ZeRO paper, §3)")
def model_state_breakdown(params, world_size, recipe_=MIXED_ADAM) -> dict[str, dict[str, float]]:
    """Per-device bytes of params / grads / optimizer state for each stage (the paper's Fig. 1)."""
    _check(params, world_size)
    r = recipe(recipe_)
    p, g, k = r.param_bytes * params, r.grad_bytes * params, r.optim_bytes * params
    n = world_size
    return {s.name: {"params": p / n if s.shards_params else p, "grads": g / n if s.shards_grads else g,
                     "optimizer": k / n if s.shards_optimizer_state else k} for s in stages.STAGES.values()}


@returns_formula("memory_math.model_state_bytes (ZeRO paper, §3)")
def model_state_bytes(params, world_size, recipe_=MIXED_ADAM) -> dict[str, float]:
    """Per-device model-state bytes for each stage: 16Ψ, 4Ψ+12Ψ/Nd, 2Ψ+14Ψ/Nd, 16Ψ/Nd for mixed Adam."""
    return {s: sum(parts.values()) for s, parts in model_state_breakdown(params, world_size, recipe_).items()}


def formula_text(stage, recipe_=MIXED_ADAM) -> str:
    """The paper-style formula of a stage for a recipe, e.g. '4Ψ + 12Ψ/Nd'."""
    r, s = recipe(recipe_), stages.stage(stage)
    kinds = ((r.param_bytes, s.shards_params), (r.grad_bytes, s.shards_grads), (r.optim_bytes, s.shards_optimizer_state))
    replicated = sum(b for b, cut in kinds if not cut)
    sharded = sum(b for b, cut in kinds if cut)
    terms = ([f"{replicated}Ψ"] if replicated else []) + ([f"{sharded}Ψ/Nd"] if sharded else [])
    return " + ".join(terms)


def first_fitting_stage(params, world_size, device_bytes, recipe_=MIXED_ADAM, *, reserve_bytes=0):
    """The least sharded stage whose model states fit ``device_bytes`` per device, or None.

    The seed's tip as arithmetic: stay on DDP while it fits, else take the first stage that
    does. ``reserve_bytes`` keeps room for activations and gathered units (they come on top).
    """
    totals = model_state_bytes(params, world_size, recipe_)
    room = device_bytes - reserve_bytes
    return next((s for s in STAGES if totals[s] <= room), None)


@returns_formula("memory_math.gathered_unit_bytes")
def gathered_unit_bytes(largest_unit_params, recipe_=MIXED_ADAM, *, prefetch=True, include_grad=False):
    """Extra room at stage 3 for gathered units, on top of the sharded state.

    A unit is all-gathered before it runs; with prefetch the next unit's gather is in flight
    while the current one computes, so two full units can be alive (FSDP's rate limiter
    allows at most two gathers in flight). In backward, the unit's full gradient also exists
    until its reduce-scatter finishes: ``include_grad`` adds one unit of gradient bytes.
    """
    if not isinstance(largest_unit_params, numbers.Real) or largest_unit_params < 0:
        raise ValueError(f"largest_unit_params must be a non-negative number, got {largest_unit_params!r}")
    r = recipe(recipe_)
    extra = (2 if prefetch else 1) * largest_unit_params * r.param_bytes
    return extra + (largest_unit_params * r.grad_bytes if include_grad else 0)


@returns_formula("memory_math.comm_elements (ZeRO paper, §7)")
def comm_elements(stage, params) -> float:
    """Elements each rank sends+receives per step, as the paper counts them: 2Ψ, 2Ψ, 2Ψ, 3Ψ."""
    _check(params, 1)
    return sum(k for _, k in COMM_COLLECTIVES[stage_name(stage)]) * params


@returns_formula("(N-1)/N × volume × element size (memory_math.ring_bytes_per_rank)")
def ring_bytes_per_rank(stage, params, world_size, dtype_bytes=2) -> float:
    """Bytes each rank actually sends in ring collectives per step: (N-1)/N × volume × dtype size."""
    _check(params, world_size)
    return comm_elements(stage, params) * (world_size - 1) / world_size * dtype_bytes


def deepspeed_estimate(params, world_size, stage=3, largest_layer_params=0) -> float:
    """DeepSpeed's estimator (no offload), in bytes, to compare with the textbook formula.

    ``estimate_zero2_model_states_mem_needs``: 2P + 18P/T; ``estimate_zero3_...``: 4·L + 18P/T,
    where 18 = 2 fp16 grads + 4 fp32 grads + 4 fp32 master + 8 Adam, and L is the largest
    layer. DeepSpeed prints ``bytes / 2**30`` and labels it "GB" (it is GiB). It differs from
    the ideal on purpose: it counts the implementation's fp32 gradient buffer and a gather buffer.
    """
    _check(params, world_size)
    s = stage_name(stage)
    if s == "zero2":
        return 2 * params + int(18 * params / world_size)
    if s == "zero3":
        return 4 * largest_layer_params + int(18 * params / world_size)
    raise ValueError("DeepSpeed's estimators cover ZeRO-2 and ZeRO-3 only")


def gpt_param_count(cfg) -> int:
    """Parameters of :class:`shardlab.models.GPT` for a config (12d²+13d per block)."""
    d, v = cfg.d, cfg.vocab
    block = 12 * d * d + 13 * d
    root = v * d + cfg.seq * d + 2 * d + (0 if getattr(cfg, "tie_weights", False) else v * d)
    return root + cfg.n_layer * block


@returns_formula("memory_math.activation_bytes")
def activation_bytes(cfg, batch_size, dtype_bytes=4, *, checkpoint=False) -> dict[str, int]:
    """Estimated activation memory of one forward of the course's GPT, kept for backward.

    Counted per block (b·T·d elements each, in the compute dtype): LayerNorm inputs 2, qkv
    input 1, q/k/v 3, attention output (also ``proj``'s input: fused kernels return it in
    (b, T, h, d/h) layout, so the reshape is a view) 1, MLP input 1, GELU input 4, ``out``
    input 4 = 16. This assumes a fused attention kernel (no T×T score matrix) and no dropout,
    and ignores small per-row statistics (LayerNorm mean/rstd, attention log-sum-exp), about
    1% here. The root adds the final LayerNorm and head inputs (2·b·T·d) and the fp32
    log-softmax saved by the loss (4·b·T·vocab bytes). With per-block activation
    checkpointing, each block keeps only its input, and backward recomputes one block at a
    time, so the peak is L·b·T·d + 16·b·T·d. Checked with saved-tensor hooks on gpt-13m, batch
    8, fp32, torch 2.13 CPU: 85.59 MB measured vs 85.46 MB here; the live check is
    ``shardlab.saved_activations``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {dtype_bytes!r}")
    btd = batch_size * cfg.seq * cfg.d
    per_block = 16 * btd * dtype_bytes
    blocks = (cfg.n_layer * btd * dtype_bytes + per_block) if checkpoint else cfg.n_layer * per_block
    root = 2 * btd * dtype_bytes + 4 * batch_size * cfg.seq * cfg.vocab
    return {"per_block": per_block, "blocks": blocks, "root": root, "total": blocks + root}


_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text) -> float:
    """Parse '7.5e9', '7500000000', '7.5B', '13M', '1T' into a positive number."""
    s = str(text).strip().replace("_", "").replace(",", "")
    scale = 1
    if s and s[-1].upper() in _SUFFIX:
        scale, s = _SUFFIX[s[-1].upper()], s[:-1]
    try:
        value = float(s) * scale
    except ValueError:
        raise ValueError(f"cannot read a parameter count from {text!r}; try 7.5e9 or 7.5B") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"parameter count must be positive and finite, got {text!r}")
    return int(value) if value == int(value) else value
