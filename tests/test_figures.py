"""figures/ is reproducible, and every plot is titled, labelled and a Figure."""

from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from shardlab.bench import figures
from shardlab.instruments import memory_math as mm
from shardlab.instruments import plots
from shardlab.instruments.measured import Formula, Measured

COMMITTED = Path(__file__).resolve().parents[1] / "figures"


def test_regenerated_figures_match_the_committed_ones(tmp_path):
    assert figures.main(["--out", str(tmp_path)]) == 0
    fresh = sorted(tmp_path.glob("*.png"))
    formula = sorted(n for n, s in figures.FIGURES.items() if not s.measured)
    assert [p.stem for p in fresh] == formula
    for path in fresh:
        committed = COMMITTED / path.name
        assert committed.exists(), f"{path.name} is not committed in figures/: run python -m shardlab figures"
        if path.read_bytes() == committed.read_bytes():
            continue
        # Another matplotlib/freetype may rasterise text a hair differently: compare pixels.
        a, b = imread(path), imread(committed)
        assert a.shape == b.shape, f"{path.name}: size changed"
        assert np.abs(a - b).mean() < 2e-3, f"{path.name} differs: run python -m shardlab figures"


def test_generation_is_byte_deterministic(tmp_path):
    first = figures.generate(tmp_path / "a", ["crossover"])
    second = figures.generate(tmp_path / "b", ["crossover"])
    assert first[0].read_bytes() == second[0].read_bytes()
    assert b"Software" not in first[0].read_bytes()[:4096]


def test_unknown_figure_is_refused(tmp_path, capsys):
    assert figures.main(["--out", str(tmp_path), "--only", "nope"]) == 2
    assert "unknown figure" in capsys.readouterr().err


def _events():
    return [
        dict(rank=r, lane=lane, kind=kind, unit="blocks.0", start=t0 + r * 1e-3, end=t1 + r * 1e-3)
        for r in range(2)
        for lane, kind, t0, t1 in (("comm", "all_gather", 0.0, 0.004), ("compute", "forward", 0.004, 0.01),
                                   ("comm", "reduce_scatter", 0.01, 0.015))
    ]


def _samples():
    return [dict(rank=r, time=i * 1e-3, bytes={"params": 1e6, "gathered": 2e6 * (i % 2)}) for r in range(2) for i in range(6)]


PLOTS = {
    "memory_bars": lambda: plots.memory_bars(mm.model_state_breakdown(7.5e9, 64),
                                             {k: Measured(v, by="test") for k, v in mm.model_state_bytes(7.5e9, 64).items()}),
    "comm_volume": lambda: plots.comm_volume(),
    "crossover": lambda: plots.crossover(world_size=4, gpu_memory_gb=24, recipe="fp32-adam"),
    "timeline": lambda: plots.timeline(_events()),
    "memory_over_time": lambda: plots.memory_over_time(_samples(), marks=[(0.003, "backward")]),
}


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_plot_is_a_titled_labelled_figure(name):
    fig = PLOTS[name]()
    assert isinstance(fig, Figure)
    suptitle = fig._suptitle.get_text() if fig._suptitle else ""
    assert suptitle or all(ax.get_title() for ax in fig.axes)
    assert any(ax.get_xlabel() for ax in fig.axes)
    assert all(ax.get_ylabel() for ax in fig.axes)
    assert fig._repr_png_().startswith(b"\x89PNG")


def test_memory_over_time_accepts_a_mapping_per_rank():
    fig = plots.memory_over_time({0: [(0.0, {"params": 1e6}), (0.001, {"params": 2e6})]})
    assert len(fig.axes) == 1


@pytest.mark.parametrize("call, message", [
    (lambda: plots.timeline([]), "at least one"),
    (lambda: plots.timeline([dict(rank=0, lane="disk", start=0, end=1)]), "lane"),
    (lambda: plots.memory_over_time([dict(rank=0, time=0)]), "bytes"),
    (lambda: plots.memory_bars({}), "empty"),
    (lambda: plots.memory_bars({"ddp": 1}, unit="furlongs"), "unknown unit"),
    (lambda: plots.crossover(gpu_memory_gb=0), "positive"),
])
def test_plots_refuse_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_measured_bar_takes_only_measurements():
    with pytest.raises(TypeError, match="plain number, not a measurement"):
        plots.memory_bars({"ddp": 1}, {"ddp": 1})
    with pytest.raises(TypeError, match="formula, not a measurement"):
        plots.memory_bars({"ddp": 1}, {"ddp": {"params": Formula(1, formula="4Ψ")}})
