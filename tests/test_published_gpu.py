"""Notebook 06's published GPU figures: labelled published, each with its source, never measured."""

import json
from pathlib import Path

from shardlab.course import gpu_results

ROOT = Path(__file__).resolve().parents[1]


def test_every_published_figure_is_labelled_and_cited():
    text = gpu_results.published_text()
    lines = text.splitlines()
    assert "not measured by ShardLab" in lines[0]
    assert len(lines) == 1 + len(gpu_results.PUBLISHED)
    for line, row in zip(lines[1:], gpu_results.PUBLISHED):
        assert line.strip().startswith("published: ") and f"[{row['source']}]" in line
        assert "measured" not in line  # a published figure is never called measured
        assert "github.com" in row["source"] or "torchtitan" in row["source"]


def test_notebook_06_shows_them_and_says_what_only_a_gpu_shows():
    cells = json.loads((ROOT / "notebooks" / "06_real_gpus.ipynb").read_text())["cells"]
    at = next(i for i, c in enumerate(cells) if "published_text()" in "".join(c["source"]))
    above = "".join(cells[at - 1]["source"])
    assert "published, not measured" in above
    for shown_only_on_a_gpu in ("bandwidth", "overlap", "peak", "kernels"):
        assert shown_only_on_a_gpu in above
