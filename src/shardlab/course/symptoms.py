"""What notebook 09 and lab 6 run on the ranks: a run as people report it, and the same run fixed.

A *run* is a plan (stage, units, options, batch) of the course GPT, trained a step or two,
with an instrument around it: :func:`peak` (memory by category over one step,
``track_memory``, with one more sample right after the loss), :func:`accumulate` (the gradient bytes held between two micro-batches, and
the ledger of the step), :func:`link_times` (step times on an emulated link, and optionally
without it, with the link time booked by the emulator, and one step's bytes on the wire). Every number they return was measured
on this rank, except these, each tagged ``Formula``: the ledger's ``ring_*`` bytes and
``formula_s`` (the ring formula), ``link_s`` (the link time the emulator booked, by the same
α-β ring formula) and ``waited_s`` (what the emulator slept of that booking: the booked time
less what the step had already spent). The formulas to set beside the rest live in
:mod:`shardlab.instruments.memory_math`.

:func:`on_first` runs one of them on the first ``k`` ranks of the cluster alone, so that one
notebook can compare 2 ranks with 4 without starting a second cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import models
from shardlab.course import measure
from shardlab.engine import comm, missing_grads
from shardlab.engine.api import engine_of, full_state_dict
from shardlab.instruments.measured import Measured
from shardlab.instruments.memory import memory_report, track_memory
from shardlab.instruments.timeline import trace
from shardlab.instruments.traffic import count_comm

#: What ``units=`` means in a plan: one unit per block (the default), one unit holding the whole
#: model (FSDP1 without an auto-wrap policy), or one per ``nn.Linear`` (many small units, as
#: DeepSpeed's ZeRO-3 gathers one submodule at a time).
UNITS = {"blocks": None, "whole": lambda m: False, "linear": nn.Linear}


def build(plan: dict):
    """``(model, optimizer)`` for ``plan``: keys ``stage``, ``units``, ``size``, ``checkpointing``,
    ``reshard_after_forward``, ``prefetch`` (the rest is read by the instruments)."""
    units = plan.get("units", "blocks")
    if units not in UNITS:
        raise ValueError(f"units must be one of {sorted(UNITS)}, got {units!r}")
    options = {k: plan[k] for k in ("reshard_after_forward", "prefetch") if k in plan}
    return measure.build(plan.get("size", "small"), stage=plan.get("stage", 3), units=UNITS[units],
                         checkpoint=bool(plan.get("checkpointing", False)), **options)


def _batches(model, plan: dict, steps: int) -> list:
    return measure.data(model, batch_size=plan.get("batch_size", 8), steps=steps)


def peak(plan: dict, samples: bool = False) -> dict:
    """One step after a warm-up, under ``track_memory``: the peak and what made it.

    The step is :func:`measure.train_step`'s, written out so that one more sample is taken
    right after the loss and before ``backward`` (event and phase ``"loss"``): no engine event
    fires there, and it is when the loss's saved log-softmax (4·b·T·vocab bytes) and every
    activation of the forward are held at once. The other samples are ``track_memory``'s: each
    engine event and the model's forward start and end. Nothing is sampled inside an operation.

    Returns ``total`` (bytes at the peak sample), ``at_peak`` (its bytes by category),
    ``peak_at`` (when it came: the sample's ``phase``, engine ``event`` and ``unit``, since two
    runs' peaks can fall at different moments of the step), ``at_loss`` (the loss sample's bytes
    by category, and its ``total``), ``logits`` (the bytes of the model's output, measured on its
    storage: alive until the loss returns, and not in any category, since autograd does not save
    it), ``gathered`` and ``activations`` (the most of each at any moment), ``at_rest`` (params,
    grads and optimizer after the step), ``psi``, ``world_size`` and, with ``samples``, the
    samples ``plots.memory_over_time`` draws.
    """
    model, optimizer = build(plan)
    batches = _batches(model, plan, 2)
    measure.train_step(model, optimizer, *batches[0])  # Adam's state exists from here on
    x, y = batches[1]
    with track_memory(model, optimizer) as mem:  # measure.train_step's step, with one more sample
        logits = model(x)
        logits_bytes = Measured(logits.untyped_storage().nbytes(), by="untyped_storage().nbytes()")
        loss = models.lm_loss(logits, y)
        del logits  # as in train_step: the loss keeps its log-softmax, not the logits
        mem.sample("loss", {"phase": "loss"})  # no engine event fires between the loss and backward's first
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    rest = memory_report(model, optimizer)
    at_loss = next(s for s in mem.samples if s["event"] == "loss")
    return dict(total=mem.peak["total"], at_peak=dict(mem.peak["bytes"]),
                peak_at={k: mem.peak[k] for k in ("phase", "event", "unit")}, gathered=mem.peak_of("gathered"),
                activations=mem.peak_of("activations"), at_loss=dict(at_loss["bytes"], total=at_loss["total"]),
                logits=logits_bytes, psi=_psi(plan),
                at_rest={k: rest[k] for k in ("params", "grads", "optimizer")},
                world_size=dist.get_world_size(), samples=mem.samples if samples else None)


def accumulate(plan: dict, micro_batches: int = 2) -> dict:
    """Gradient accumulation over ``micro_batches``, then one step; the bytes held in between.

    ``plan["sync_every_micro_batch"]`` False runs every micro-batch but the last inside
    ``model.no_sync()`` (as ``accelerate`` and FSDP's ``set_requires_gradient_sync(False)`` do).
    Returns ``grads_between`` (gradient bytes this rank holds after the first micro-batch),
    the ledger of the whole step (``reduce_scatters``: their calls; ``ring_formula_bytes``: the ring
    formula's bytes of every collective; ``wire_bytes``: the bytes gloo measured on this rank's sockets),
    the whole reduced gradient the optimizer stepped (``grads``) and the weights after the step
    (``weights``), both keyed as ``model.state_dict()``, to check that both ways train alike,
    AdamW's ``lr`` and ``eps`` (``adam``), ``psi`` and the engine's ``units`` (each pads its flat
    buffer by at most N-1 elements). ``grads`` is the sharper of the two checks: AdamW's first
    step moves most weights by about ``lr * sign(g)``, so the weights hide a gradient off by a
    factor, and a gradient below ``eps`` by ``lr * g / eps``, so they magnify its rounding.
    """
    if micro_batches < 1:
        raise ValueError(f"accumulate needs at least one micro-batch, got micro_batches={micro_batches}")
    model, optimizer = build(plan)
    micro = _batches(model, plan, micro_batches)
    sync = plan.get("sync_every_micro_batch", True)
    with count_comm() as ledger:
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            context = model.no_sync() if not (sync or last) else contextlib.nullcontext()
            with context:
                (models.lm_loss(model(x), y) / len(micro)).backward()
            if i == 0:
                grads_between = memory_report(model, optimizer)["grads"]
        optimizer.step()
    weights, grads = full_state_dict(model), _full_grads(model)  # gathered after the ledger closed
    optimizer.zero_grad()
    group = optimizer.param_groups[0]
    return dict(grads_between=grads_between, psi=_psi(plan), world_size=dist.get_world_size(),
                units=len(engine_of(model).units),
                reduce_scatters=ledger.calls("reduce_scatter"),
                ring_formula_bytes=ledger.ring_bytes(), wire_bytes=ledger.wire_bytes(), grads=grads,
                weights=weights, adam=dict(lr=group["lr"], eps=group["eps"]))


@torch.no_grad()
def _full_grads(model) -> dict:
    """The reduced gradient the optimizer stepped, whole, keyed as ``model.state_dict()``: every
    unit's shards all-gathered (after the step and before ``zero_grad``; the step reads the
    gradient, it does not change it). A parameter no rank gave a gradient is left out.

    Every rank takes part in every sharded unit's all-gather: a rank whose master gradient is None
    (every parameter with elements in its shard went unused) sends ``-0.0``, "no gradient"
    (``missing_grads.py``); skipping the gather there would pair the other ranks' gathers with its
    next unit's, or hang. The gathers are bookkeeping, not the step's traffic: no unit is named,
    so no ledger or memory tally books them as a unit's."""
    by_id = {}
    for unit in engine_of(model).units:
        grad, master = unit.master.grad, unit.master
        if master.numel() != unit.padded_numel:  # a shard (stages 1-3): borrow the others', on every rank
            shard = grad.detach() if grad is not None else \
                torch.full((unit.shard_numel,), -0.0, dtype=master.dtype, device=master.device)
            grad = torch.empty(unit.padded_numel, dtype=shard.dtype, device=shard.device)
            comm.all_gather(grad, shard, unit=None)
        elif grad is None:  # stage 0: every rank holds the whole all-reduced gradient, or none
            continue
        for p, t in zip(unit.params, unit.views(grad)):
            if t.numel() and bool(missing_grads.is_missing(t).all()):
                continue  # no rank gave this parameter a gradient
            by_id[id(p)] = t.clone()
    return {name: by_id[id(t)] for name, t in model.state_dict(keep_vars=True).items() if id(t) in by_id}


def link_times(plans: dict, link="1GbE", steps: int = 3, loopback: bool = False) -> dict:
    """Each plan's step on an emulated ``link``, in interleaved rounds (one warm-up).

    Returns ``{name: {"step_s": [...], "link_s": [...], "waited_s": [...], "formula_s": s,
    "calls": n, "gathers": n, "units": n, "events": [...]}}``: the measured seconds of each step,
    the link time the emulator booked for its collectives (a formula), the part of it the emulator
    slept (the booking less what the step had already spent on the loopback and on compute: a
    formula's time less a measured one, tagged ``Formula``, not a step time), the same link time by
    the α-β ring formula from the ledger's records, the collectives of one step, the plan's units,
    and a warmed-up step's trace (``trace()``); and that step's traffic: ``elements`` (the
    paper's volume, counted), ``ring_bytes`` (the ring formula, all collectives), ``ring_rs``
    (the same, reduce-scatters alone) and ``wire_bytes`` (measured on this rank's sockets, on the
    loopback). With ``loopback``, every round also steps each plan with no emulated link,
    ``loop_s``: the same steps' time without the link, measured in the same rounds.
    """
    sizes = {name: plan.get("batch_size", 8) for name, plan in plans.items()}
    if len(set(sizes.values())) > 1:  # the rounds interleave the plans on the same batches
        raise ValueError(f"link_times compares plans on one batch: got batch sizes {sizes}; "
                         "give every plan the same batch_size, or time them in separate calls")
    runs = {name: build(plan) for name, plan in plans.items()}
    batch_plan = next(iter(plans.values()))
    batches = _batches(next(iter(runs.values()))[0], batch_plan, steps + 1)
    links = {"link": link, "loopback": None} if loopback else {"link": link}
    timed = measure.time_links(runs, batches, links, warmup=1)
    out = {}
    for name, (model, optimizer) in runs.items():  # the collectives of one step, warmed up
        with count_comm() as ledger, trace() as tr:
            measure.train_step(model, optimizer, *batches[0])
        out[name] = dict(calls=ledger.calls(), gathers=ledger.calls("all_gather"),
                         units=len(engine_of(model).units), events=tr.events, elements=ledger.elements(),
                         ring_bytes=ledger.ring_bytes(), ring_rs=ledger.ring_bytes("reduce_scatter"), wire_bytes=ledger.wire_bytes(),
                         formula_s=measure.predicted_link_s(ledger.records, dist.get_world_size(), link))
        out[name].update(timed["link"][name])
        if loopback:
            out[name]["loop_s"] = timed["loopback"][name]["step_s"]
    return out


def _psi(plan: dict) -> int:
    return sum(p.numel() for p in models.gpt(plan.get("size", "small")).parameters())


_regroups = itertools.count()


def _group_timeout() -> datetime.timedelta:
    """The default group's collective timeout: the one the cluster set (``start_cluster(timeout=)``)."""
    group = dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout


def on_first(k: int, fn, *args, group_timeout: float | None = None, wait_s: float = 900.0, **kwargs):
    """Call ``fn(*args, **kwargs)`` on the first ``k`` ranks alone, in a process group of ``k``.

    Run it on every rank (``cluster.run(on_first, 2, fn, ...)``): the other ranks wait and return
    None. Afterwards every rank is back in a group of the full size, so the next cell runs as
    before. Used to set 2 ranks beside 4 on one cluster (the notebook's ranks stay alive).

    ``group_timeout`` (seconds) bounds the collectives of both groups; by default it is the
    cluster's own, read before the group is rebuilt, so later cells keep it. (Not ``timeout``:
    ``Cluster.run`` takes that keyword for itself.) The other ranks wait on a store key that
    rank 0 sets when ``fn`` ends, for at most ``wait_s``, before they rejoin: so a long ``fn``
    is bounded by ``Cluster.run``'s timeout, not by the collective one.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 1 <= k <= world:
        raise ValueError(f"k must be between 1 and the world size {world}, got {k!r}")
    backend = dist.get_backend()
    store = dist.distributed_c10d._get_default_store()  # kept: the group is rebuilt on it
    limit = _group_timeout() if group_timeout is None else datetime.timedelta(seconds=group_timeout)
    n = next(_regroups)
    done = f"first{k}/{n}/done"
    dist.destroy_process_group()
    try:
        if rank < k:
            dist.init_process_group(backend, store=dist.PrefixStore(f"first{k}/{n}/", store), rank=rank,
                                    world_size=k, timeout=limit)
            try:
                return fn(*args, **kwargs)
            finally:
                dist.destroy_process_group()
                if rank == 0:
                    store.set(done, "1")
        store.wait([done], datetime.timedelta(seconds=wait_s))
        return None
    finally:
        dist.init_process_group(backend, store=dist.PrefixStore(f"all/{n}/", store), rank=rank,
                                world_size=world, timeout=limit)


