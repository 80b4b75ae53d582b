"""Small helpers the notebooks call on the ranks: build a stage, run a step, time steps fairly.

They keep a notebook cell to a few lines without hiding anything the cell is about: the
training step is the plain PyTorch loop, and the timing is "interleave the runs, put every
rank at a barrier before each step, keep each step's seconds". A step lasts as long as its
slowest rank, so the notebook takes, per step, the maximum over ranks (:func:`slowest_median`).

Seconds and bytes measured here are :class:`~shardlab.instruments.measured.Measured`; what the
emulated link's α-β model says it needed is a :class:`~shardlab.instruments.measured.Formula`,
and so is the emulator's wait on that model (``waited_s``; :func:`_wait_formula` says why).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardlab import models
from shardlab.engine import comm
from shardlab.engine.api import parallelize
from shardlab.engine.units import checkpoint_units
from shardlab.instruments.link import emulate_link, find_link, link_delay
from shardlab.instruments.measured import Formula, Measured


def build(size: str = "small", stage: int = 0, *, seed: int = 0, device=None, checkpoint: bool = False,
          **options):
    """The course GPT of ``size`` at ZeRO ``stage`` with AdamW: ``(model, optimizer)``.

    Every rank builds the same weights from ``seed``. ``checkpoint`` wraps each block in
    activation checkpointing; ``options`` go to :func:`shardlab.parallelize` (``prefetch``,
    ``reshard_after_forward``, ``mixed_precision``).
    """
    torch.manual_seed(seed)
    model = models.gpt(size)
    if device is not None:
        model = model.to(device)
    if checkpoint:
        checkpoint_units(model)
    return parallelize(model, stage=stage, optimizer_cls=torch.optim.AdamW, lr=1e-3, **options)


def data(model, batch_size: int = 8, steps: int = 4, *, seed: int = 0, device=None) -> list:
    """This rank's rows of ``steps`` global batches: every run sees the same data."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = []
    for i in range(steps):
        x, y = models.batch(model.cfg, batch_size, seed=seed * 100_003 + i, rank=rank, world_size=world)
        out.append((x.to(device), y.to(device)) if device is not None else (x, y))
    return out


def train_step(model, optimizer, x, y) -> float:
    """One plain training step; returns the loss."""
    loss = models.lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _link(link):
    """None, a network name (:func:`~shardlab.instruments.link.find_link`), or ``{"bandwidth_gbps": .., "latency_us": ..}``."""
    if link is None:
        return None
    if isinstance(link, str):
        find_link(link)  # an unknown name is refused here, with the names it knows
        return {"preset": link}
    return dict(link)


def _timed_step(model, optimizer, x, y, link, overlap) -> tuple[float, float, float]:
    """(seconds, link time, waited) of one step, under ``link`` if one is given."""
    spec = _link(link)
    t0 = time.perf_counter()
    if spec is None:
        train_step(model, optimizer, x, y)
        return Measured(time.perf_counter() - t0, by="time_steps"), _link_formula(0.0), _wait_formula(0.0)
    with emulate_link(**spec, overlap=overlap) as em:
        train_step(model, optimizer, x, y)
    return Measured(time.perf_counter() - t0, by="time_steps"), _link_formula(em.link_time_s), _wait_formula(em.slept_s)


def _link_formula(seconds: float) -> Formula:  # what the emulated link was told a transfer costs
    return Formula(seconds, formula="α-β ring model (link_delay)")


def _wait_formula(seconds: float) -> Formula:
    """The emulator's sleep: the model's link time less the wall time that compute and the loopback
    collective already covered. The clock sets how much of it is left, but the link it waits on is the
    α-β model's, not a network's, so it is tagged as the model's number, never as a measured link."""
    return Formula(seconds, formula="α-β link time left uncovered by compute and loopback (emulate_link's sleep)")


def time_links(runs: dict, batches: list, links: dict, *, warmup: int = 1, overlap: bool = True) -> dict:
    """Seconds of each step of each run under each link, all interleaved in rotated rounds.

    ``runs`` maps a name to ``(model, optimizer)``, ``links`` a label to a link (None for the
    loopback, a network name (:func:`~shardlab.instruments.link.find_link`), or ``{"bandwidth_gbps": .., "latency_us": ..}``).
    Every round steps each (link, run) pair once on the same batch, each step after a barrier,
    so a slow moment of the machine hits all pairs alike. Returns
    ``{label: {name: {"step_s": [...], "link_s": [...], "waited_s": [...]}}}``: ``link_s`` is
    what the emulated link needed in that step, ``waited_s`` the part that compute and the loopback
    collective did not cover (wall-clock, so it moves with the machine's load).
    """
    pairs = [(label, name) for label in links for name in runs]
    out = {label: {name: {"step_s": [], "link_s": [], "waited_s": []} for name in runs} for label in links}
    for i, (x, y) in enumerate(batches):
        shift = i % len(pairs)
        for label, name in pairs[shift:] + pairs[:shift]:
            comm.barrier()
            seconds, link_s, waited = _timed_step(*runs[name], x, y, links[label], overlap)
            if i >= warmup:
                row = out[label][name]
                row["step_s"].append(seconds)
                row["link_s"].append(link_s)
                row["waited_s"].append(waited)
    return out


def time_steps(runs: dict, batches: list, *, warmup: int = 1, link=None, overlap: bool = True) -> dict:
    """:func:`time_links` for one link: ``{name: {"step_s": [...], "link_s": [...], "waited_s": [...]}}``."""
    return time_links(runs, batches, {"link": link}, warmup=warmup, overlap=overlap)["link"]


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's seconds: a step ends when its last rank does."""
    return [max(step) for step in zip(*per_rank, strict=True)]


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over steps of the slowest rank's seconds."""
    return statistics.median(slowest(per_rank))


def added_median(per_rank: list[list[float]], baseline: list[list[float]]) -> float:
    """Median over rounds of (this step - the same round's baseline step), slowest rank each:
    paired by round, so a slow moment of the machine cancels out."""
    return statistics.median(a - b for a, b in zip(slowest(per_rank), slowest(baseline), strict=True))


def predicted_link_s(records: list[dict], world_size: int, link) -> float:
    """Seconds the collectives of ``records`` (``count_comm().records``) need on ``link``.

    The ring α-β model of :func:`shardlab.instruments.link.link_delay`, summed with nothing
    hidden: the link carries one transfer at a time, so a step cannot be shorter than this.
    """
    spec = _link(link)
    if spec is None:
        return 0.0
    preset = find_link(spec["preset"]) if "preset" in spec else None
    bandwidth = spec.get("bandwidth_gbps", preset.bandwidth_gbps if preset else None)
    latency = spec.get("latency_us", preset.latency_us if preset else 0.0)
    return Formula(sum(link_delay(r["kind"], r["numel"], r["dtype"], world_size, bandwidth, latency)
                       for r in records), formula="α-β ring model (link_delay)")


def stage_memory(stage: int, size: str = "small", batch_size: int = 4, *, precision=None, device=None) -> dict:
    """Bytes one rank holds for ``stage``: by category after backward and at rest, and the peak.

    One warm-up step, then a measured one. ``after_backward`` is ``memory_report`` before the
    optimizer step (gradients alive), ``rest`` after ``zero_grad``, ``peak`` the largest tally of
    ``track_memory`` over the step (activations and gathered units included). On CUDA also the
    allocator's own counts, above what was allocated before the model was built:
    ``cuda_rest`` (``memory_allocated``) and ``cuda_peak`` (``max_memory_allocated``).
    """
    from shardlab.engine.api import engine_of
    from shardlab.instruments.memory import memory_report, track_memory

    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
    model, optimizer = build(size, stage, device=device, mixed_precision=precision)
    (x0, y0), (x, y) = data(model, batch_size, 2, device=device)
    train_step(model, optimizer, x0, y0)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with track_memory(model, optimizer) as mem:
        models.lm_loss(model(x), y).backward()
        after_backward = dict(memory_report(model, optimizer))
        optimizer.step()
    optimizer.zero_grad()
    engine = engine_of(model)
    out = dict(stage=stage, world_size=engine.world_size, psi=sum(u.numel for u in engine.units),
               padded=sum(u.padded_numel for u in engine.units), after_backward=after_backward,
               rest=dict(memory_report(model, optimizer)), peak=mem.peak["total"],
               peak_parts=dict(mem.peak["bytes"]), device=str(device or "cpu"),
               stepped=len(optimizer.state))  # parameters (pieces) with AdamW state: a step counter each
    if cuda:
        torch.cuda.synchronize(device)
        out.update(cuda_rest=Measured(torch.cuda.memory_allocated(device) - base, by="torch.cuda.memory_allocated"),
                   cuda_peak=Measured(torch.cuda.max_memory_allocated(device) - base,
                                      by="torch.cuda.max_memory_allocated"),
                   gpu=torch.cuda.get_device_name(device))
    return out


def collective_times(sizes_mb=(1, 4, 16), iters: int = 5, device=None) -> list[dict]:
    """Seconds of one all-gather, reduce-scatter and all-reduce of each FULL buffer size (MB).

    Every call goes through :mod:`shardlab.engine.comm`; each size is warmed up twice. Each of the
    ``iters`` calls is timed alone, and a call's time is its slowest rank's (a collective ends when
    its last rank does). The row keeps the fastest of those calls: on a shared CPU a call the
    scheduler interrupted is slow for reasons the link does not have, and a mean would keep them.
    ``workshop/gpu_check.py`` and notebook 06 feed these to :func:`~shardlab.instruments.link.fit_link`.

    On CUDA each timed call is the same: it starts on an idle GPU and ends with a host sync, so
    its time includes the call's launch, PyTorch's host overhead (20-30 µs a call, as stas00's
    ``ml-engineering`` network benchmarks README publishes it) and the sync. A training loop
    whose host runs ahead of the GPU hides those behind queued work; queued timing, as that
    benchmark's default and nccl-tests do it, would not count them. These rows are that
    benchmark's ``--with-host-overhead`` timing instead: what a call costs when the program waits
    for its result. So at small sizes they read slower than queued timing, and the latency α
    that ``fit_link`` fits to them is an upper bound on a queued call's; the larger the buffer,
    the smaller that overhead's share of a call.
    """
    world = dist.get_world_size()
    rows = []
    for mb in sizes_mb:
        numel = int(mb * 2**20) // 4 // world * world  # fp32, divisible into N shards
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // world, device=device)
        ops = {"all_gather": lambda f=full, s=shard: comm.all_gather(f, s),
               "reduce_scatter": lambda f=full, s=shard: comm.reduce_scatter(s, f),
               "all_reduce": lambda f=full: comm.all_reduce(f)}
        for kind, op in ops.items():
            for _ in range(2):
                op()
            _sync(device)
            times = []
            for _ in range(iters):
                comm.barrier()
                t0 = time.perf_counter()
                op()
                _sync(device)
                times.append(time.perf_counter() - t0)
            worst = torch.tensor(times, dtype=torch.float64, device=device)
            comm.all_reduce_max(worst)  # each call's slowest rank
            rows.append(dict(kind=kind, size_bytes=numel * 4, seconds=Measured(worst.min().item(), by="collective_times"),
                             world_size=world))
    return rows


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
