"""The memory calculator: will a model train on these GPUs, and at which ZeRO stage?

A plain function first, so the numbers can be tested and used without widgets::

    result = memory_calculator(7e9, gpus=8, stage=3)       # bytes per GPU at every stage
    print(result)                                           # a table and the verdict
    result.stages["zero3"].total / 1e9                      # 14.0

and :mod:`shardlab.course.calculator_widgets` on top of it (sliders, a stacked bar per stage
against the GPU's memory line), which this module never imports. Every number comes from :mod:`shardlab.instruments.memory_math`, the module
``python -m shardlab memory`` prints and ``tests/test_calculator.py`` checks against the ZeRO
paper. GB here is 10^9 bytes, the paper's unit: an "80 GB" card holds 80 GiB (85.9 GB), so
the GPU line is slightly conservative.

Activations are optional: give ``activations=dict(layers=32, hidden=4096, seq_len=4096,
micro_batch=1, checkpointing=False)`` (``vocab`` too, for the logits the loss keeps). They are
per GPU and no ZeRO stage shards them. They grow with depth and width (16·L·b·T·d), so they
do not shrink as the GPU count grows; the "largest model that fits" search holds the given
activation shape fixed while it varies the parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from shardlab.instruments import memory_math as mm

GPU_SIZES_GB = (24, 40, 80, 141)
ACTIVATION_FIELDS = ("layers", "hidden", "seq_len", "micro_batch")


@dataclass(frozen=True)
class StageMemory:
    """Bytes per GPU at one stage, and whether they fit."""

    stage: str
    formula: str
    weights: float
    grads: float
    optimizer: float
    activations: float
    fits: bool
    largest_params: float  # the largest Ψ whose state plus these activations fits (0: none)

    @property
    def label(self) -> str:
        return mm.STAGE_LABELS[self.stage]

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    def parts(self) -> dict[str, float]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations}


@dataclass(frozen=True)
class CalculatorResult:
    params: float
    gpus: int
    recipe: mm.Recipe
    gpu_memory_gb: float
    stages: dict  # stage name -> StageMemory, in the order ddp, zero1, zero2, zero3
    stage: str | None  # the stage asked about (None: all)
    activation_inputs: dict | None = None

    def verdict(self, stage=None) -> str:
        """'ZeRO-3: 14.0 GB per GPU fits in 80 GB', or '... does not fit ...'."""
        s = self.stages[mm.stage_name(stage if stage is not None else self.stage or "zero3")]
        word = "fits" if s.fits else "does not fit"
        return f"{s.label}: {s.total / mm.GB:.3g} GB per GPU {word} in {self.gpu_memory_gb:g} GB"

    def text(self) -> str:
        r = self.recipe
        lines = [f"{count_text(self.params)} params on {self.gpus} GPU(s) of {self.gpu_memory_gb:g} GB, recipe "
                 f"{r.name} ({r.param_bytes} + {r.grad_bytes} + {r.optim_bytes} = {r.bytes_per_param} bytes/param)"
                 + ("" if self.activation_inputs is None else f", activations {_describe(self.activation_inputs)}"),
                 f"{'stage':<7} {'formula':<13} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8}"
                 f" {'total GB':>9}  {'fits?':<5} largest model that fits"]
        for s in self.stages.values():
            mark = ">" if s.stage == self.stage else " "
            lines.append(f"{mark}{s.label:<6} {s.formula:<13}" + "".join(
                f" {v / mm.GB:>8.3g}" for v in s.parts().values())
                + f" {s.total / mm.GB:>9.4g}  {'yes' if s.fits else 'no':<5} {count_text(s.largest_params)}")
        if self.stage is not None:
            lines.append("Verdict: " + self.verdict())
        lines.append("GB = 10^9 bytes. Model state per the ZeRO paper; gathered units and buffers come on top.")
        lines.append("At cluster scale, with activations and step time: notebook 08, python -m shardlab plan.")
        return "\n".join(lines)

    __str__ = text


def count_text(n) -> str:
    """A parameter count as people write it: '7B', '175B', '1.5T'."""
    if n <= 0:
        return "none (activations alone exceed the GPU)"
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def _describe(a: dict) -> str:
    ck = "with" if a.get("checkpointing") else "no"
    return f"{a['layers']} layers × d {a['hidden']}, seq {a['seq_len']}, micro-batch {a['micro_batch']}, {ck} checkpointing"


def activation_bytes_from_fields(activations: dict, dtype_bytes: int) -> int:
    """Activation bytes per GPU from the course's transformer formula (memory_math.activation_bytes)."""
    missing = [k for k in ACTIVATION_FIELDS if k not in activations]
    unknown = set(activations) - {*ACTIVATION_FIELDS, "checkpointing", "vocab"}
    if missing or unknown:
        raise ValueError(f"activations needs {ACTIVATION_FIELDS} (and optionally checkpointing, vocab); "
                         f"missing {missing}, unknown {sorted(unknown)}")
    for k in (*ACTIVATION_FIELDS, "vocab"):
        v = activations.get(k, 0 if k == "vocab" else 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "vocab" else 1):
            raise ValueError(f"activations[{k!r}] must be a positive int, got {v!r}")
    cfg = SimpleNamespace(n_layer=activations["layers"], d=activations["hidden"],
                          seq=activations["seq_len"], vocab=activations.get("vocab", 0))
    return mm.activation_bytes(cfg, activations["micro_batch"], dtype_bytes,
                               checkpoint=bool(activations.get("checkpointing", False)))["total"]


def memory_calculator(params, gpus: int, stage=None, recipe="mixed-adam", activations: dict | None = None,
                      gpu_memory_gb: float = 80) -> CalculatorResult:
    """Bytes per GPU (weights / grads / optimizer / activations) at every stage, and what fits.

    ``params`` is Ψ (a number or '7B'); ``stage`` (0-3 or 'zero3') picks the stage the verdict
    is about; ``recipe`` is a :data:`memory_math.RECIPES` name; activations are computed in the
    recipe's compute precision (its weight bytes: bf16 for mixed-adam).
    """
    params = mm.parse_count(params) if isinstance(params, str) else params
    if not isinstance(gpu_memory_gb, (int, float)) or not gpu_memory_gb > 0:
        raise ValueError(f"gpu_memory_gb must be a positive number, got {gpu_memory_gb!r}")
    r = mm.recipe(recipe)
    parts = mm.model_state_breakdown(params, gpus, r)  # checks params and gpus
    per_param = mm.model_state_bytes(1, gpus, r)
    act = 0 if activations is None else activation_bytes_from_fields(activations, r.param_bytes)
    line = gpu_memory_gb * mm.GB
    stages = {}
    for s in mm.STAGES:
        p = parts[s]
        total = p["params"] + p["grads"] + p["optimizer"] + act
        stages[s] = StageMemory(s, mm.formula_text(s, r), p["params"], p["grads"], p["optimizer"], act,
                                fits=total <= line, largest_params=max(0.0, (line - act) / per_param[s]))
    return CalculatorResult(params, gpus, r, gpu_memory_gb, stages,
                            None if stage is None else mm.stage_name(stage),
                            None if activations is None else dict(activations))


def plot(result: CalculatorResult):
    """A stacked bar per stage (weights / grads / optimizer / activations) against the GPU line."""
    from shardlab.instruments import plots

    bars = {s: {k: v for k, v in m.parts().items() if k != "activations" or result.activation_inputs}
            for s, m in result.stages.items()}
    fig = plots.memory_bars(bars, unit="GB", title=f"{count_text(result.params)} params on {result.gpus} "
                            f"GPU(s), {result.recipe.name}: memory per GPU vs the GPU's {result.gpu_memory_gb:g} GB")
    ax = fig.axes[0]
    ax.axhline(result.gpu_memory_gb, color="black", linewidth=1.2, linestyle=(0, (6, 2, 1, 2)))
    ax.annotate(f"GPU memory {result.gpu_memory_gb:g} GB", (len(bars) - 0.6, result.gpu_memory_gb),
                xytext=(0, 3), textcoords="offset points", ha="right", fontsize=8)
    if result.stage is not None:  # mark the chosen stage's tick
        ax.get_xticklabels()[mm.STAGES.index(result.stage)].set_fontweight("bold")
    ax.set_ylabel("memory per GPU (GB, 10^9 bytes)")
    return fig
