"""The measured figures draw from live ranks, and the byte-identical checks leave them out.

One launch of 2 ranks with the tiny GPT feeds every check here (``measure`` is cached), so
this stays fast; the committed PNGs come from ``python -m shardlab figures --measured``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.figure import Figure

from shardlab.bench import figures
from shardlab.bench import measured_figures as mf
from shardlab.instruments import plots, time_plots

COMMITTED = Path(__file__).resolve().parents[1] / "figures"
NAMES = ("timeline_prefetch", "timeline_no_prefetch", "memory_over_time")


@pytest.fixture(scope="module")
def drawn():
    data = mf.measure("tiny", 2, 2)
    return data, {
        "timeline_prefetch": mf.timeline_figure(data["prefetch"], prefetch=True, size="tiny"),
        "timeline_no_prefetch": mf.timeline_figure(data["no_prefetch"], prefetch=False, size="tiny"),
        "memory_over_time": mf.memory_figure(data["memory"], size="tiny"),
    }


@pytest.mark.parametrize("name", NAMES)
def test_measured_figure_is_a_titled_labelled_figure(drawn, name):
    fig = drawn[1][name]
    assert isinstance(fig, Figure)
    title = fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title()
    assert "stage 3" in title
    assert any(ax.get_xlabel() for ax in fig.axes) and all(ax.get_ylabel() for ax in fig.axes)
    assert fig._repr_png_().startswith(b"\x89PNG")


def test_they_come_from_both_ranks_and_show_the_cycle(drawn):
    data, _ = drawn
    for key in ("prefetch", "no_prefetch"):
        kinds = {e["kind"] for e in data[key]}
        assert {"all_gather", "forward", "free", "backward", "reduce_scatter", "step"} <= kinds
        assert {e["rank"] for e in data[key]} == {0, 1}
    samples = data["memory"]
    assert {s["rank"] for s in samples} == {0, 1}
    rank0 = [s for s in samples if s["rank"] == 0]
    assert len({s["bytes"]["params"] for s in rank0}) == 1  # the shard at rest does not move
    gathered = [s["bytes"]["gathered"] for s in rank0]
    assert max(gathered) > min(gathered) >= 0  # units are borrowed and given back


def test_registered_as_measured_and_committed():
    assert "shardlab.bench.measured_figures" in figures.MEASURED_MODULES
    for name in NAMES:
        assert figures.FIGURES[name].measured
        assert (COMMITTED / f"{name}.png").exists(), f"run python -m shardlab figures --measured ({name})"


def test_the_deterministic_set_leaves_them_out(tmp_path):
    written = figures.generate(tmp_path)  # what --check and the byte-compare test regenerate
    assert not {p.stem for p in written} & set(NAMES)


def test_timeline_packs_overlaps_into_rows_and_marks_instants():
    rows = time_plots._pack([dict(start=0, end=10), dict(start=1, end=2), dict(start=2, end=3), dict(start=5, end=12)])
    assert [[(e["start"], e["end"]) for e in r] for r in rows] == [[(0, 10)], [(1, 2), (2, 3), (5, 12)]]
    fig = plots.timeline([dict(rank=0, lane="compute", kind="forward", unit="u", start=0.0, end=1.0),
                          dict(rank=0, lane="compute", kind="free", unit="u", start=1.0, end=1.0)])
    labels = fig.axes[0].get_legend_handles_labels()[1] + [t.get_text() for t in fig.axes[0].get_legend().texts]
    assert "free" in labels and "forward" in labels
