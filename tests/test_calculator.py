"""The memory calculator against the ZeRO paper, the seed and ``python -m shardlab memory``.

Oracles: ZeRO paper (arXiv 1910.02054) Figure 1 and every Table 1 cell, the seed's 7B example
(112 GB, 14 GB per GPU on 8 at ZeRO-3); see /work/shared/notes/reference-facts.md.
"""

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from support import slowdown
from test_memory_math import COLUMNS, TABLE1, printed_as  # the paper's table, as printed

from shardlab.course import calculator as calc
from shardlab.instruments import memory_math as mm
from shardlab.models import SIZES

SRC = str(Path(__file__).resolve().parents[1] / "src")
ACT = dict(layers=32, hidden=4096, seq_len=4096, micro_batch=1, checkpointing=False)


def model_state(result, stage):
    s = result.stages[stage]
    return s.weights + s.grads + s.optimizer


def test_figure_1():
    r = calc.memory_calculator(7.5e9, 64)
    gb = {s: model_state(r, s) / mm.GB for s in mm.STAGES}
    assert gb == pytest.approx({"ddp": 120, "zero1": 31.40625, "zero2": 16.640625, "zero3": 1.875}, abs=1e-9)
    assert [round(gb[s], 1) for s in mm.STAGES] == [120, 31.4, 16.6, 1.9]  # as Figure 1 prints them


@pytest.mark.parametrize("nd", sorted(TABLE1))
@pytest.mark.parametrize("column", sorted(COLUMNS))
def test_every_cell_of_table_1(nd, column):
    psi, rule = COLUMNS[column]
    r = calc.memory_calculator(Fraction(psi), nd)  # exact arithmetic, then the paper's rounding
    for stage, cell in zip(("zero1", "zero2", "zero3"), TABLE1[nd][column].split("/")):
        assert printed_as(r.stages[stage].total / mm.GB, cell.strip(), rule), f"{column} Nd={nd} {stage}"


def test_seed_7b_example():
    r = calc.memory_calculator(7e9, 8, stage=3)
    assert r.stages["ddp"].total == 112 * mm.GB and r.stages["zero3"].total == 14 * mm.GB
    s = r.stages["zero3"]
    assert (s.weights, s.grads, s.optimizer, s.activations) == (1.75e9, 1.75e9, 10.5e9, 0)
    assert r.stages["zero3"].fits and not r.stages["ddp"].fits  # against an 80 GB card
    assert r.verdict() == "ZeRO-3: 14 GB per GPU fits in 80 GB"
    text = str(r)
    assert "Verdict: ZeRO-3: 14 GB per GPU fits in 80 GB" in text
    assert all(label in text for label in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "16Ψ/Nd"))


@pytest.mark.parametrize("params, gpus, recipe", [
    ("7.5e9", 64, "mixed-adam"), ("7e9", 8, "mixed-adam"), ("1T", 1024, "fp32-adam"),
    ("13M", 4, "sgd-momentum"), ("7B", 3, "bf16-fp32-grads"),
])
def test_same_numbers_as_the_cli(params, gpus, recipe):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "shardlab", "memory", "--params", params, "--gpus", str(gpus),
                          "--recipe", recipe, "--json"], capture_output=True, text=True, env=env, check=True)
    cli = json.loads(out.stdout)
    r = calc.memory_calculator(params, gpus, recipe=recipe)
    for s in mm.STAGES:
        assert model_state(r, s) == pytest.approx(cli[s], rel=1e-12), s
        assert r.stages[s].formula == cli["formula"][s]
    assert r.recipe.bytes_per_param == cli["bytes_per_param"]


@pytest.mark.parametrize("stage", mm.STAGES)
@pytest.mark.parametrize("activations", [None, ACT])
def test_largest_model_that_fits_is_where_the_line_is_crossed(stage, activations):
    r = calc.memory_calculator(1e9, 16, activations=activations, gpu_memory_gb=40)
    largest = r.stages[stage].largest_params
    assert calc.memory_calculator(largest * 0.999, 16, activations=activations, gpu_memory_gb=40).stages[stage].fits
    assert not calc.memory_calculator(largest * 1.001, 16, activations=activations, gpu_memory_gb=40).stages[stage].fits


def test_activations_follow_the_formula_and_no_stage_shards_them():
    cfg = SIZES["small"]
    a = dict(layers=cfg.n_layer, hidden=cfg.d, seq_len=cfg.seq, micro_batch=8, vocab=cfg.vocab)
    for ckpt in (False, True):
        r = calc.memory_calculator(1e6, 4, recipe="fp32-adam", activations={**a, "checkpointing": ckpt})
        expected = mm.activation_bytes(cfg, 8, 4, checkpoint=ckpt)["total"]
        assert {s.activations for s in r.stages.values()} == {expected}
    plain = calc.memory_calculator(7e9, 8, activations=ACT).stages["zero3"]
    ckpt = calc.memory_calculator(7e9, 8, activations={**ACT, "checkpointing": True}).stages["zero3"]
    assert ckpt.activations < plain.activations and ckpt.largest_params > plain.largest_params
    assert plain.largest_params < calc.memory_calculator(7e9, 8).stages["zero3"].largest_params


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="world_size"):
        calc.memory_calculator(7e9, 0)
    with pytest.raises(ValueError, match="params"):
        calc.memory_calculator(-1, 8)
    with pytest.raises(ValueError, match="missing \\['seq_len'\\]"):
        calc.memory_calculator(7e9, 8, activations=dict(layers=2, hidden=8, micro_batch=1))
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        calc.memory_calculator(7e9, 8, gpu_memory_gb=0)
    with pytest.raises(ValueError, match="unknown recipe"):
        calc.memory_calculator(7e9, 8, recipe="fp8")


def test_plot_draws_a_bar_per_stage_and_the_gpu_line():
    fig = calc.plot(calc.memory_calculator(7e9, 8, stage=3, activations=ACT))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert any(list(line.get_ydata()) == [80, 80] for line in ax.get_lines())
    assert len(ax.patches) == 4 * 4  # four stages × weights / grads / optimizer / activations


def test_widget_recomputes_when_the_slider_moves():
    W = pytest.importorskip("ipywidgets")
    from shardlab.course import calculator_widgets

    box = calculator_widgets.calculator_widget(params=7e9, gpus=8, stage="zero3", gpu_memory_gb=80)
    controls, verdict, _, table = box.children
    slider = controls.children[0]
    assert isinstance(slider, W.FloatLogSlider)
    assert "shardlab-calculator-verdict" in verdict._dom_classes
    assert "ZeRO-3: 14 GB per GPU fits in 80 GB" in verdict.value
    slider.value = 7e10
    assert "ZeRO-3: 140 GB per GPU does not fit in 80 GB" in verdict.value
    assert str(calc.memory_calculator(7e10, 8, stage=3)).split("\n")[2] in table.value.replace("&gt;", ">")


def test_without_widgets_show_prints_the_plain_function(monkeypatch, capsys):
    monkeypatch.setenv("SHARDLAB_NO_WIDGETS", "1")
    from shardlab.course import calculator_widgets

    calculator_widgets.show(params=7e9, gpus=8, stage="zero3", gpu_memory_gb=80)
    out = capsys.readouterr().out
    assert str(calc.memory_calculator(7e9, 8, stage="zero3")) in out


def test_the_package_names_work_on_every_call():
    """``shardlab.course.calculator_widget`` is a function on the second call too (issue 22).

    It once shared its name with a submodule: the first call imported the submodule, whose
    import replaced the package attribute, and the second call raised ``TypeError``. A fresh
    interpreter, so that no other test has imported the modules first.
    """
    pytest.importorskip("ipywidgets")
    code = ("import shardlab.course as c\n"
            "for _ in range(2):\n"
            "    box = c.calculator_widget(params=7e9, gpus=8)\n"
            "    assert type(box).__name__ == 'VBox', type(box)\n"
            "    assert c.memory_calculator(7e9, 8).stages['zero3'].total == 14e9\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=slowdown(120),
                         env={**os.environ, "MPLBACKEND": "Agg"})
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok", out.stderr[-2000:]

