"""The measured plots over time: per-rank timelines and memory, from ``trace`` and ``track_memory``.

Input formats (what :func:`shardlab.trace` and :func:`shardlab.track_memory` produce):

* ``timeline(events)``: a list of dicts, one per interval, with ``rank`` (int), ``lane``
  (``"compute"`` or ``"comm"``), ``start`` and ``end`` (seconds on one clock for all ranks, such
  as ``time.perf_counter()`` on one machine), and optionally ``kind`` (``"forward"``,
  ``"backward"``, ``"step"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``,
  ``"broadcast"``), ``unit`` (e.g. ``"blocks.0"``) and ``name`` (the bar's text; defaults to
  ``kind unit``).
* ``memory_over_time(samples)``: a list of dicts ``{"rank": int, "time": seconds, "bytes":
  {category: bytes}}`` (categories such as ``params``, ``grads``, ``optimizer``, ``gathered``,
  ``activations``), or a mapping ``rank -> [(time, {category: bytes}), ...]``.
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from shardlab.engine import events
from shardlab.instruments.figure import COLORS, HATCHES, new_figure, scale

KIND_STYLE = {  # timeline bars: hatch per kind, so lanes read without colour
    "forward": ("#4C72B0", ""), "backward": ("#55A868", ""), "step": ("#8172B3", ""),
    "all_gather": ("#DD8452", "//"), "reduce_scatter": ("#C44E52", "\\\\"),
    "all_reduce": ("#937860", "xx"), "broadcast": ("#8C8C8C", ".."),
}


def _label(e: Mapping) -> str:
    """A bar's text: its ``name``, else its unit (the kind is in the legend), else its kind."""
    return str(e.get("name") or e.get("unit") or e.get("kind") or "")


def _pack(intervals: list) -> list[list]:
    """Sub-rows in which no two intervals overlap (greedy, by start): a unit that contains
    others, like the root around the blocks, or async collectives in flight together, each
    get their own row instead of hiding one another."""
    rows: list[list] = []
    for e in sorted(intervals, key=lambda e: (e["start"], -e["end"])):
        row = next((r for r in rows if r[-1]["end"] <= e["start"]), None)
        rows.append([e]) if row is None else row.append(e)
    return rows or [[]]


INSTANT_MARKERS = {events.FREE: ("v", "black"), events.BACKWARD_DONE: ("|", "#55A868")}


def timeline(events, *, title="Per-rank timeline: compute and communication", time_unit="ms",
             note: str | None = None) -> Figure:
    """A Gantt chart: for each rank, a compute lane and a communication lane (format in module doc).

    Intervals that overlap within a lane go to sub-rows; instants (``start == end``, e.g.
    ``free``) are drawn as markers. Bars are labelled with their unit when they are wide enough.
    ``note`` (how to read the chart) goes under the legend, so the title stays one line.
    """
    events = list(events)
    if not events:
        raise ValueError("timeline needs at least one event")
    for e in events:
        missing = {"rank", "lane", "start", "end"} - set(e)
        if missing or e["lane"] not in ("compute", "comm"):
            raise ValueError(f"timeline event {e!r} needs rank, start, end and lane 'compute' or 'comm'")
    scale = {"s": 1, "ms": 1e3, "us": 1e6}[time_unit]
    t0 = min(e["start"] for e in events)
    span = max(max(e["end"] for e in events) - t0, 1e-12) * scale
    ranks = sorted({e["rank"] for e in events})
    lanes = {(r, lane): _pack([e for e in events if e["rank"] == r and e["lane"] == lane and e["end"] > e["start"]])
             for r in ranks for lane in ("compute", "comm")}
    fig = new_figure(10.0, 1.4 + 0.3 * sum(map(len, lanes.values())) + 0.3 * len(ranks))
    ax = fig.add_subplot()
    yticks, ylabels, seen, y = [], [], {}, 0.0
    for rank in ranks:
        for lane in ("compute", "comm"):
            rows = lanes[(rank, lane)]
            yticks.append(y - (len(rows) - 1) / 2)
            ylabels.append(f"rank {rank} {lane}")
            for k, row in enumerate(rows):
                for e in row:
                    kind = e.get("kind") or lane
                    color, hatch = KIND_STYLE.get(kind, ("#BBBBBB", "" if lane == "compute" else "++"))
                    x, w = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
                    ax.barh(y - k, w, left=x, height=0.8, color=color, hatch=hatch, edgecolor="black", linewidth=0.5)
                    seen.setdefault(kind, Patch(facecolor=color, hatch=hatch, edgecolor="black", label=kind))
                    text = _label(e)
                    if text and w / span > 0.009 * (len(text) + 1):  # only where it fits (~6 px a character)
                        ax.text(x + w / 2, y - k, text, ha="center", va="center", fontsize=8, clip_on=True,
                                bbox=dict(facecolor="white", alpha=0.75, linewidth=0, pad=0.6))
            for e in (e for e in events if e["rank"] == rank and e["lane"] == lane and e["end"] <= e["start"]):
                kind = e.get("kind") or "instant"
                marker, color = INSTANT_MARKERS.get(kind, ("d", "black"))
                ax.plot([(e["start"] - t0) * scale], [y + 0.5], marker=marker, color=color, markersize=5,
                        linestyle="none", label=kind)
                seen.setdefault(kind, ax.lines[-1])
            y -= len(rows) + 0.4
        ax.axhline(y + 0.6, color="grey", linewidth=0.6)
        y -= 0.4
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(y + 0.6, 1.0)
    ax.set_xlim(left=0)
    ax.set_xlabel(f"time since first event ({time_unit})")
    ax.set_ylabel("rank and lane")
    ax.set_title(title)
    legend = ax.legend(handles=list(seen.values()), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if note:
        ax.add_artist(legend)
        ax.annotate(note, xy=(1.01, 0.0), xycoords="axes fraction", ha="left", va="bottom", fontsize=7.5,
                    wrap=False)
    return fig


def _samples_by_rank(samples) -> dict:
    out: dict[int, list] = {}
    if isinstance(samples, Mapping):
        for rank, rows in samples.items():
            out[rank] = [(t, dict(b)) for t, b in rows]
    else:
        for s in samples:
            if not {"rank", "time", "bytes"} <= set(s):
                raise ValueError(f"memory sample {s!r} needs rank, time and bytes ({{category: bytes}})")
            out.setdefault(s["rank"], []).append((s["time"], dict(s["bytes"])))
    if not out or not any(out.values()):
        raise ValueError("memory_over_time needs at least one sample")
    return {r: sorted(rows, key=lambda row: row[0]) for r, rows in sorted(out.items())}


def memory_over_time(samples, *, unit="MB", title="Memory over time, by category", marks=()) -> Figure:
    """Stacked memory per category over time, one panel per rank (format in module doc).

    Each sample holds until the next one (a step plot), as memory changes at events.

    ``marks`` is an optional list of ``(time, label)`` drawn as dotted vertical lines, e.g.
    the start of backward or the optimizer step.
    """
    by_rank = _samples_by_rank(samples)
    divisor = scale(unit)
    t0 = min(rows[0][0] for rows in by_rank.values())
    cats = list(dict.fromkeys(c for rows in by_rank.values() for _, b in rows for c in b))
    fig = new_figure(8.0, 1.2 + 2.2 * len(by_rank))
    axes = fig.subplots(len(by_rank), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (rank, rows) in zip(axes, by_rank.items()):
        ts = [(t - t0) * 1e3 for t, _ in rows]
        ys = [[b.get(c, 0) / divisor for _, b in rows] for c in cats]
        polys = ax.stackplot(ts, ys, labels=cats, colors=[COLORS[i % 8] for i in range(len(cats))],
                             edgecolor="black", linewidth=0.4, step="post")
        for i, p in enumerate(polys):
            p.set_hatch(HATCHES[i % 8])
        for t, text in marks:
            ax.axvline((t - t0) * 1e3, color="black", linestyle=":", linewidth=1)
            ax.annotate(text, ((t - t0) * 1e3, 1), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7)
        ax.set_ylabel(f"rank {rank} ({unit})")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1].set_xlabel("time since first sample (ms)")
    fig.suptitle(title)
    return fig
