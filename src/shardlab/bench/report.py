"""How ``python -m shardlab bench`` shows its result: a Markdown table and a two-panel figure.

Kept apart from the measuring code so that a notebook can redraw a saved ``--json`` result
without running anything: ``bench_report.plot(json.load(open(path)), "bench.png")``.
"""

from __future__ import annotations

MB = 10**6  # decimal megabytes, like the ZeRO paper's GB
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}  # collectives


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _comm(row) -> str:
    return " + ".join(SHORT[k] for k in SHORT if row["comm"].get(k))


def table(result: dict) -> str:
    """The benchmark as a Markdown table, with the conditions and the loss check under it."""
    o, psi = result["options"], result["params"]
    device = "CUDA memory" if o["device"] == "cuda" else "CPU tensors"
    lines = [
        f"model {o['model']} ({psi / 1e6:.2f}M params), {o['world_size']} ranks, batch {o['batch']}×"
        f"{result['tokens_per_step'] // (o['batch'] * o['world_size'])} per rank, device {o['device']}, "
        f"median of {o['steps']} steps after {o['warmup']} warm-up, torch {result['machine']['torch']}",
        "",
        "| configuration | step (s) | best (s) | vs DDP | vs fully_shard | tokens/s | model states (MB) | formula (MB) "
        "| peak (MB) | comm / step | comm (MB) | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {r['best_s']:.3f} | {_ratio(r['vs_torch-ddp'])} | {_ratio(r['vs_torch-fsdp'])} "
            f"| {r['tokens_per_s']:.0f} | {r['states_bytes'] / MB:.1f} | {r['formula_bytes'] / MB:.1f} "
            f"| {r['peak_bytes'] / MB:.1f} | {r['comm_volume_psi']:.2f}Ψ ({_comm(r)}) | {r['comm_bytes'] / MB:.1f} "
            f"| {r['loss']:.6f} |")
    m = result["machine"]
    lines += [
        "",
        f"Loss check: max relative disagreement of the final loss {result['loss_disagreement']:.1e}, "
        f"over every step {result['loss_trajectory_disagreement']:.1e} "
        f"({'OK: same work' if result['loss_trajectory_disagreement'] < 1e-3 else 'MISMATCH'}).",
        f"Model states = {device} live right after optimizer.step() (weights + grads + optimizer state + "
        "engine buffers); formula = ZeRO paper, fp32 AdamW (16 B/param); peak = most live bytes during a step. "
        "Max over ranks.",
        "comm = elements per rank per step in units of Ψ, the ZeRO paper's way (all-reduce counts 2); "
        "MB = those elements × bytes each.",
        f"Machine: {m['cores']} cores, load average {_load(m['load_before'])} before, "
        f"{_load(m['load_after'])} after; wall time {result['wall_s']:.0f} s.",
    ]
    return "\n".join(lines)


def _load(load) -> str:
    return "?" if not load else "/".join(f"{x:.2f}" for x in load)


def plot(result: dict, path: str) -> None:
    """Step time (with the DDP and fully_shard lines) and memory per configuration.

    Drawn on a figure of :func:`shardlab.instruments.plots.new_figure`, never through pyplot, as
    every figure of the package is: no global backend switched, nothing left open."""
    from shardlab.instruments.plots import new_figure

    rows = result["rows"]
    names = list(rows)
    colors = ["tab:blue" if n.startswith("shardlab") else "tab:orange" for n in names]
    fig = new_figure(13, 4.8)
    ax1, ax2 = fig.subplots(1, 2, sharey=True)
    y = range(len(names))
    ax1.barh(y, [rows[n]["step_s"] for n in names], color=colors)
    for base, style in (("torch-ddp", "--"), ("torch-fsdp", ":")):
        if base in rows:
            ax1.axvline(rows[base]["step_s"], color="k", ls=style, lw=1, label=f"{base} median")
    for i, n in enumerate(names):  # the spread of the timed steps, as dots
        ax1.plot(rows[n]["steps_s"], [i] * len(rows[n]["steps_s"]), "k.", ms=3, alpha=0.5)
    slowest = max(rows[n]["step_s"] for n in names)
    ax1.set_xlim(0, 2 * slowest)  # a step disturbed by another job may lie beyond: see the JSON
    ax1.set_yticks(list(y), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("step time (s): bar = median, dots = each timed step (to 2× the slowest median)")
    ax1.legend(loc="lower right", fontsize=8)
    h = 0.4
    ax2.barh([i - h / 2 for i in y], [rows[n]["states_bytes"] / MB for n in names], h, color=colors,
             label="model states (after step)")
    ax2.barh([i + h / 2 for i in y], [rows[n]["peak_bytes"] / MB for n in names], h, color=colors, alpha=0.45,
             label="peak during a step")
    ax2.plot([rows[n]["formula_bytes"] / MB for n in names], list(y), "kD", ms=4, label="ZeRO formula (fp32 Adam)")
    ax2.set_xlabel("memory per rank (MB)")
    ax2.legend(loc="lower right", fontsize=8)
    o = result["options"]
    fig.suptitle(f"{o['model']} ({result['params'] / 1e6:.1f}M params), {o['world_size']} ranks on {o['device']}, "
                 f"torch {result['machine']['torch']}: ShardLab (blue) vs PyTorch (orange)")
    fig.savefig(path, dpi=110)
