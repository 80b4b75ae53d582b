"""The memory calculator's controls: ipywidgets over :func:`shardlab.course.calculator.memory_calculator`.

Built on :mod:`shardlab.course.calculator`, which never imports this module, so the plain
function never imports ipywidgets. Every change recomputes the result and redraws the stacked
bars; the verdict (class ``shardlab-calculator-verdict``) and the table are text, so a browser
test can read the numbers change when it moves the slider. :func:`show` is what a notebook
calls: the widget in a live notebook, else the plain table and plot.
"""

from __future__ import annotations

import html

import ipywidgets as W
from IPython.display import display

from shardlab.course import calculator
from shardlab.course.quiz import use_widgets
from shardlab.instruments import memory_math as mm

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WIDE = {"style": {"description_width": "9em"}, "layout": W.Layout(width="30em")}


def _int(description, value):
    return W.BoundedIntText(value=value, min=1, max=10**7, description=description, **WIDE)


def calculator_widget(params=7e9, gpus=8, stage="zero3", recipe="mixed-adam", gpu_memory_gb=80) -> W.VBox:
    """Sliders and dropdowns over :func:`~shardlab.course.calculator.memory_calculator`, redrawn live."""
    size = W.FloatLogSlider(value=params, base=10, min=8, max=12.5, step=0.01, readout_format=".3g",
                            description="model size Ψ", continuous_update=False, **WIDE)
    n = W.Dropdown(options=sorted({*GPU_COUNTS, gpus}), value=gpus, description="GPUs", **WIDE)
    which = W.ToggleButtons(options=[(mm.STAGE_LABELS[s], s) for s in mm.STAGES],
                            value=mm.stage_name(stage), description="stage", style={"description_width": "9em"})
    how = W.Dropdown(options=[(f"{r.name} ({r.bytes_per_param} B/param)", r.name) for r in mm.RECIPES.values()],
                     value=mm.recipe(recipe).name, description="precision", **WIDE)
    card = W.ToggleButtons(options=[(f"{g} GB", g) for g in sorted({*calculator.GPU_SIZES_GB, gpu_memory_gb})],
                           value=gpu_memory_gb, description="GPU memory", style={"description_width": "9em"})
    use_act = W.Checkbox(value=False, description="add activations", indent=False)
    act = {"layers": _int("layers", 32), "hidden": _int("hidden size", 4096),
           "seq_len": _int("sequence length", 4096), "micro_batch": _int("micro-batch", 1)}
    ckpt = W.Checkbox(value=False, description="activation checkpointing", indent=False)
    act_box = W.VBox([*act.values(), ckpt], layout=W.Layout(margin="0 0 0 2em"))

    verdict = W.HTML()
    verdict.add_class("shardlab-calculator-verdict")
    table = W.HTML()
    figure = W.Output()

    def update(_=None):
        act_box.layout.display = "" if use_act.value else "none"
        activations = None
        if use_act.value:
            activations = {k: w.value for k, w in act.items()} | {"checkpointing": ckpt.value}
        try:
            result = calculator.memory_calculator(size.value, n.value, which.value, how.value, activations, card.value)
        except ValueError as e:
            verdict.value = f"<b style='color:#b35900'>{html.escape(str(e))}</b>"
            return
        s = result.stages[which.value]
        color = "#1a7f37" if s.fits else "#c62828"
        largest = ", ".join(f"{m.label} {html.escape(_short(m.largest_params))}" for m in result.stages.values())
        verdict.value = (f"<div style='font-size:1.1em;color:{color}'><b>{html.escape(result.verdict())}</b></div>"
                         f"<div>Largest model that fits: {largest}</div>")
        table.value = f"<pre style='font-size:0.85em'>{html.escape(result.text())}</pre>"
        with figure:
            figure.clear_output(wait=True)
            display(calculator.plot(result))

    for w in (size, n, which, how, card, use_act, ckpt, *act.values()):
        w.observe(update, names="value")
    update()
    controls = W.VBox([size, n, which, how, card, use_act, act_box])
    return W.VBox([controls, verdict, figure, table])


def _short(n) -> str:
    return "none" if n <= 0 else calculator.count_text(n)


def show(params=7e9, gpus=8, stage="zero3", recipe="mixed-adam", gpu_memory_gb=80, activations=None):
    """The widget in a live notebook; otherwise the plain function's table and its plot."""
    if use_widgets():
        display(calculator_widget(params, gpus, stage, recipe, gpu_memory_gb))
        return
    result = calculator.memory_calculator(params, gpus, stage, recipe, activations, gpu_memory_gb)
    print(result)
    display(calculator.plot(result))
