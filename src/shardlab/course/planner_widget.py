"""The planner in a notebook: a model, GPUs, a network and a plan in; memory bars and step time out.

``show(...)`` draws, for every stage with the same batch and checkpointing, the memory per GPU
against the card and the step time split into compute and exposed communication. In a live
notebook it is a widget (dropdowns, redrawn on every change); anywhere else (nbval, a script,
``SHARDLAB_NO_WIDGETS=1``) it prints the same numbers as ``python -m shardlab plan`` and draws
the same figure. The numbers come from :mod:`shardlab.planner`.
"""

from __future__ import annotations

from shardlab import planner
from shardlab.planner import hardware, transformer
from shardlab.planner.report import text

GIB = 2**30
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULTS = dict(model="70b", gpus=64, gpu="h100", network="ib-ndr", stage="zero3", checkpointing="full", micro_batch=1)


def plan_for(model="70b", gpus=64, gpu="h100", network="ib-ndr", stage="zero3", checkpointing="full",
             micro_batch=1, grad_accum=1):
    """The planner's inputs from plain names: (model, cluster, plan)."""
    cluster = planner.cluster(gpu, gpus, network)
    return planner.model(model), cluster, planner.Plan(stage, micro_batch=micro_batch, grad_accum=grad_accum,
                                                  checkpointing=checkpointing, shard_group=cluster.gpus_per_node)


def figure(comparison: dict, chosen: planner.Plan):
    """Two panels: memory per GPU by kind against the card; step time as compute + exposed comm."""
    from shardlab.instruments import plots

    preds = comparison["predictions"]
    fig = plots.new_figure(10, 4.2)
    mem_ax, time_ax = fig.subplots(1, 2)
    names = [p.plan.label.split(",")[0] for p in preds]
    x = range(len(preds))
    bottom = [0.0] * len(preds)
    for c, kind in enumerate(("model states", "activations", "gathered units")):
        values = [p.memory.parts()[kind] / GIB for p in preds]
        mem_ax.bar(x, values, 0.7, bottom=bottom, color=plots.COLORS[c], hatch=plots.HATCHES[c],
                   edgecolor="black", linewidth=0.6, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    card = preds[0].cluster.gpu.memory_bytes / GIB
    mem_ax.axhline(card, color="black", linestyle=(0, (6, 2, 1, 2)), linewidth=1.2)
    mem_ax.annotate(f"{preds[0].cluster.gpu.name}: {card:.0f} GiB", (len(preds) - 0.6, card), xytext=(0, 3),
                    textcoords="offset points", ha="right", fontsize=8)
    top = max(card * 1.6, min(max(bottom), card * 4)) * 1.05
    mem_ax.set_ylim(0, top)
    for i, total in enumerate(bottom):  # a bar taller than the axis says its height
        if total > top:
            mem_ax.annotate(f"{total:,.0f} GiB ↑", (i, top), xytext=(0, -12), textcoords="offset points",
                            ha="center", fontsize=8, bbox={"facecolor": "white", "linewidth": 0})
    mem_ax.set_ylabel("memory per GPU (GiB)")
    mem_ax.set_title("memory per GPU (bars above the line do not fit)", fontsize=10)
    mem_ax.legend(fontsize=8, loc="upper right")
    compute = [p.timing.compute_s for p in preds]
    exposed = [p.timing.exposed_comm_s for p in preds]
    time_ax.bar(x, compute, 0.7, color=plots.COLORS[3], edgecolor="black", linewidth=0.6, label="compute")
    time_ax.bar(x, exposed, 0.7, bottom=compute, color=plots.COLORS[4], hatch=plots.HATCHES[4], edgecolor="black",
                linewidth=0.6, label="exposed communication")
    time_ax.set_ylim(0, max(c + e for c, e in zip(compute, exposed)) * 1.3)
    time_ax.set_ylabel("seconds per step")
    time_ax.set_title("step time", fontsize=10)
    time_ax.legend(fontsize=8, loc="upper left")
    for ax in (mem_ax, time_ax):
        ax.set_xticks(list(x), names, fontsize=8)
        for i, p in enumerate(preds):
            if p.plan == chosen:
                ax.get_xticklabels()[i].set_fontweight("bold")
    m, c = preds[0].model, preds[0].cluster
    fig.suptitle(f"{m.name} on {c.gpus} × {c.gpu.name}, {c.inter.name if c.nodes > 1 else 'one node'}; "
                 f"{chosen.checkpointing} checkpointing, micro-batch {chosen.micro_batch}", fontsize=10)
    return fig


def report(model="70b", gpus=64, gpu="h100", network="ib-ndr", stage="zero3", checkpointing="full",
           micro_batch=1, grad_accum=1):
    """(text, figure) for one choice: the plain-text fallback and the widget both show these."""
    m, cluster, plan = plan_for(model, gpus, gpu, network, stage, checkpointing, micro_batch, grad_accum)
    comparison = planner.compare(m, cluster, plan)
    chosen = next(p for p in comparison["predictions"] if p.plan == plan) if plan.stage != "hsdp" else \
        planner.predict(m, cluster, plan)
    return text(chosen, comparison, anchors=False), figure(comparison, plan)


def widget(**start):
    """Dropdowns over :func:`report`, redrawn on every change (needs ipywidgets)."""
    import html

    import ipywidgets as W
    from IPython.display import display

    wide = {"style": {"description_width": "8em"}, "layout": W.Layout(width="24em")}
    controls = {
        "model": W.Dropdown(options=list(transformer.ALIASES), description="model", **wide),
        "gpus": W.Dropdown(options=sorted({*GPU_COUNTS, start.get("gpus", 64)}), description="GPUs", **wide),
        "gpu": W.Dropdown(options=list(hardware.GPUS), description="GPU", **wide),
        "network": W.Dropdown(options=["ib-ndr", "ib-hdr", "100gbe", "25gbe"], description="network", **wide),
        "stage": W.Dropdown(options=list(planner.PLANS), description="plan", **wide),
        "checkpointing": W.Dropdown(options=list(planner.CHECKPOINTING), description="checkpointing", **wide),
        "micro_batch": W.Dropdown(options=[1, 2, 4, 8], description="micro-batch", **wide),
    }
    for name, value in (DEFAULTS | start).items():
        controls[name].value = value
    out, table = W.Output(), W.HTML()
    table.add_class("shardlab-planner-table")

    def update(_=None):
        try:
            words, fig = report(**{k: w.value for k, w in controls.items()})
        except ValueError as e:
            table.value = f"<b style='color:#b35900'>{html.escape(str(e))}</b>"
            return
        table.value = f"<pre style='font-size:0.85em'>{html.escape(words)}</pre>"
        with out:
            out.clear_output(wait=True)
            display(fig)

    for w in controls.values():
        w.observe(update, names="value")
    update()
    return W.VBox([W.HBox([W.VBox(list(controls.values())[:4]), W.VBox(list(controls.values())[4:])]), out, table])


def show(model="70b", gpus=64, gpu="h100", network="ib-ndr", stage="zero3", checkpointing="full", micro_batch=1):
    """The widget in a live notebook; otherwise the same numbers as text and the same figure."""
    from IPython.display import display

    from shardlab.course.quiz import use_widgets

    args = dict(model=model, gpus=gpus, gpu=gpu, network=network, stage=stage, checkpointing=checkpointing,
                micro_batch=micro_batch)
    if use_widgets():
        display(widget(**args))
        return
    words, fig = report(**args)
    print(words)
    display(fig)
