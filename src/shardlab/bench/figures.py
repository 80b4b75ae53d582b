"""``python -m shardlab figures``: regenerate every PNG in ``figures/``, byte for byte.

Each figure is a function registered with :func:`register`, returning a Figure from
:mod:`shardlab.instruments.plots`; its file is ``figures/<name>.png``. Output is deterministic so the
committed PNGs can be checked in CI (``--check``): matplotlib's default style is pinned (a
user's matplotlibrc is ignored), sizes and dpi are fixed, and PNG metadata (the matplotlib
version in "Software") is stripped.

Two kinds of figure:

* ``formula`` figures are pure arithmetic and regenerate identically anywhere;
* ``measured`` figures (the per-rank timeline, memory over time) must come from live ranks,
  never from synthetic data. Register them with ``register(name, measured=True)`` in the module
  that can run the ranks, and list that module in :data:`MEASURED_MODULES`; they are drawn
  only with ``--measured``, because their timings differ from run to run.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

from shardlab.instruments import memory_math as mm
from shardlab.instruments import plots

DPI = 100
#: Modules that register measured figures when imported (added as the instruments land).
MEASURED_MODULES: list[str] = ["shardlab.bench.measured_figures"]


@dataclass(frozen=True)
class FigureSpec:
    name: str
    make: Callable[[], object]
    measured: bool
    description: str


FIGURES: dict[str, FigureSpec] = {}


def register(name: str, *, measured: bool = False, description: str = ""):
    """Decorator: add a zero-argument function returning a Figure to the regenerated set."""

    def add(fn):
        if name in FIGURES:
            raise ValueError(f"figure {name!r} is registered twice")
        FIGURES[name] = FigureSpec(name, fn, measured, description or (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return add


@register("memory_per_stage")
def _memory_per_stage():
    """ZeRO paper Figure 1: model states per device, Ψ = 7.5B, Nd = 64, mixed-precision Adam."""
    return plots.memory_bars(mm.model_state_breakdown(7.5e9, 64), subtitle="Ψ = 7.5B, Nd = 64, mixed-precision Adam")


@register("comm_per_stage")
def _comm_per_stage():
    """Communication per step and rank by stage: 2Ψ, 2Ψ, 2Ψ, 3Ψ elements."""
    return plots.comm_volume()


@register("crossover")
def _crossover():
    """Per-device model states vs model size on 8 devices against an 80 GB GPU."""
    return plots.crossover(world_size=8, gpu_memory_gb=80)


def _style():
    """Pinned style, so a user's matplotlibrc cannot change the bytes."""
    pinned = {k: v for k, v in matplotlib.rcParamsDefault.items() if k != "backend"}  # keep the notebook's
    return matplotlib.rc_context({**pinned, "figure.dpi": DPI, "savefig.dpi": DPI})


def save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def generate(out: Path, names=None, measured: bool = False) -> list[Path]:
    """Write the selected figures into ``out`` and return their paths."""
    if measured:
        for module in MEASURED_MODULES:
            importlib.import_module(module)
    names = list(names) if names else [n for n, s in FIGURES.items() if measured or not s.measured]
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; known: {sorted(FIGURES)}")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with _style():
        for name in names:
            written.append(save(FIGURES[name].make(), out / f"{name}.png"))
    return written


def default_dir() -> Path:
    """The repository's figures/ when run from a checkout, else ./figures."""
    root = Path(__file__).resolve().parents[2]
    return root / "figures" if (root / "pyproject.toml").exists() else Path.cwd() / "figures"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardlab figures", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the repo's figures/)")
    ap.add_argument("--only", action="append", default=None, metavar="NAME", help="just this figure (repeatable)")
    ap.add_argument("--measured", action="store_true", help="also draw figures measured on live ranks")
    ap.add_argument("--check", action="store_true", help="regenerate elsewhere; fail if any committed PNG differs")
    ap.add_argument("--list", action="store_true", help="list the figures and exit")
    args = ap.parse_args(argv)
    if args.list:
        for spec in FIGURES.values():
            print(f"{spec.name:<20} {'measured' if spec.measured else 'formula ':<8}  {spec.description}")
        return 0
    out = args.out or default_dir()
    try:
        if args.check:
            if args.measured:  # live timings differ run to run: only formula figures are byte-stable
                print("error: --check compares formula figures only; drop --measured", file=sys.stderr)
                return 2
            with tempfile.TemporaryDirectory() as tmp:
                fresh = generate(Path(tmp), args.only, args.measured)
                stale = [p.name for p in fresh if not (out / p.name).exists() or not filecmp.cmp(p, out / p.name, shallow=False)]
            if stale:
                print(f"stale or missing in {out}: {', '.join(stale)}; run python -m shardlab figures", file=sys.stderr)
                return 1
            print(f"{len(fresh)} figures in {out} are up to date")
            return 0
        for path in generate(out, args.only, args.measured):
            print(f"wrote {path}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
