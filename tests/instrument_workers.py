"""Rank functions for the instrument tests (memory, traffic, timeline), and a launch cache.

Launching ranks costs seconds (each process imports torch), so one launch per world size
measures every stage at once, and :func:`measured` caches it for all three test files.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist

import shardlab
from shardlab.engine.units import checkpoint_units
from shardlab.launch import run_ranks
from shardlab.models import batch, gpt, lm_loss

# The course's GPT, narrowed to an odd width (d = 34) so units need padding at N = 3 and 4,
# with 4 blocks so that stage 3 has more units than it may hold gathered at once.
MODEL = "tiny"
MODEL_KW = dict(d=34, n_layer=4)
PER_RANK = 2


@contextmanager
def count_process_group_calls():
    """Count every collective that reaches the process group, whichever Python path sent it.

    All of ``torch.distributed``'s functions end in a method of ``ProcessGroup``; wrapping the
    class's methods sees calls that bypass :mod:`shardlab.engine.comm`.
    """
    pg = dist.ProcessGroup
    names = [n for n in ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
                         "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
                         "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base",
                         "reduce_scatter_single", "reduce_scatter_single_coalesced",
                         "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "gather", "scatter",
                         "alltoall", "alltoall_base", "send", "recv", "recv_anysource", "barrier")
             if hasattr(pg, n)]
    counts: dict[str, int] = {}
    originals = {n: getattr(pg, n) for n in names}
    own = {n: pg.__dict__[n] for n in names if n in pg.__dict__}  # restored exactly, not re-wrapped

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *args, **kwargs)
        return counted

    for n, fn in originals.items():
        setattr(pg, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n in names:
            if n in own:
                setattr(pg, n, own[n])
            else:
                delattr(pg, n)


def _step(model, opt, step: int, rank: int, world_size: int) -> None:
    x, y = batch(model.cfg, PER_RANK, seed=100 + step, rank=rank, world_size=world_size)
    lm_loss(model(x), y).backward()
    opt.step()


def measure_stage(stage: int, *, prefetch: bool = True, checkpointing: bool = False) -> dict:
    """Train one warm-up step, then measure one steady-state step with every instrument."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gpt(MODEL, **MODEL_KW)
    if checkpointing:
        checkpoint_units(model)
    model, opt = shardlab.parallelize(model, stage=stage, optimizer_cls=torch.optim.AdamW, lr=1e-3,
                                      prefetch=prefetch)
    engine = shardlab.engine_of(model)
    _step(model, opt, 0, rank, world_size)  # warm-up: optimizer state exists
    opt.zero_grad()
    with shardlab.trace() as tr, shardlab.count_comm() as ledger:
        with shardlab.track_memory(model, opt) as mem, count_process_group_calls() as pg_calls:
            _step(model, opt, 1, rank, world_size)
    rest = shardlab.memory_report(model, opt)
    opt.zero_grad()
    after_zero_grad = shardlab.memory_report(model, opt)
    return dict(
        stage=stage, rank=rank, world_size=world_size,
        numel=[u.numel for u in engine.units], padded=[u.padded_numel for u in engine.units],
        unit_names=[u.name for u in engine.units],
        pieces_here=sum(b > a for u in engine.units for a, b in u.ranges(u.master)),  # params with elements here
        rest=dict(rest), after_zero_grad=dict(after_zero_grad),
        peak=mem.peak, peak_activations=mem.peak_of("activations"), peak_gathered=mem.peak_of("gathered"),
        peak_grads=mem.peak_of("grads"),
        samples=mem.samples,
        ledger=ledger.as_dict(), ledger_calls=ledger.calls(), ledger_elements=ledger.elements(),
        ledger_table=ledger.table(params=sum(u.padded_numel for u in engine.units)),
        pg_calls=pg_calls, events=tr.events,
    )


def measure_all(configs: list[dict]) -> list[dict]:
    return [measure_stage(**cfg) for cfg in configs]


@functools.cache
def measured(world_size: int) -> list[list[dict]]:
    """``result[rank][i]`` for every stage (i = stage), plus, at world size 2, the variants."""
    configs = [dict(stage=s) for s in range(4)]
    if world_size == 2:
        configs += [dict(stage=3, prefetch=False)] + [dict(stage=s, checkpointing=True) for s in range(4)]
    from support import slowdown  # in the parent only (ranks import this module too)

    return run_ranks(measure_all, world_size, configs, timeout=slowdown(120))


def saved_bytes_single_process(checkpointing: bool) -> dict:
    """Activations of one forward on one process (no ranks), with and without checkpointing."""
    torch.manual_seed(0)
    model = gpt(MODEL, **MODEL_KW)
    if checkpointing:
        checkpoint_units(model)
    x, y = batch(model.cfg, PER_RANK, seed=0)
    with shardlab.saved_activations(model) as act:
        loss = lm_loss(model(x), y)
    at_end_of_forward = act.bytes
    loss.backward()
    return dict(forward=at_end_of_forward, peak=act.peak, after_backward=act.bytes)


def bookkeeping_collectives() -> dict:
    """comm's bookkeeping on one rank: the slowest rank's number, a barrier (no event from
    either), then :func:`shardlab.course.measure.collective_times` of a small buffer."""
    from shardlab.course import measure
    from shardlab.engine import comm, events

    rank, seen = dist.get_rank(), []
    with events.listen(lambda name, fields: seen.append(name)):
        worst = comm.all_reduce_max(torch.tensor([float(rank), -float(rank)]))
        comm.barrier()
    return dict(worst=worst.tolist(), events=seen, ready=comm.dist_ready(),
                rows=measure.collective_times(sizes_mb=(0.01,), iters=1))



def wire_against_tcp(numels: dict, noise_bytes: int = 65536) -> dict:
    """On 4 ranks, one collective of each kind at 2, 3 and 4 ranks (the first 2 and 3 ranks in
    groups of their own, the 4 through the engine's comm and its ledger). Per (world size, kind)
    on this rank: the wire instrument's bytes, the same sockets' bytes by their TCP counters
    (another kernel mechanism), the process's whole ``wchar`` (which also sees ``noise_bytes``
    written to a file inside the block), and at 4 ranks the ledger's view of the same call.
    ``numels[n]`` is the full buffer's size at n ranks."""
    import tempfile

    from shardlab.engine import comm
    from shardlab.instruments.wire import count_wire, tcp_bytes_written

    def proc_wchar():
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar"))

    def runs(n, group):
        numel = numels[n]
        if group is None:  # the whole world: through the engine's one door, as training does
            return {"all_gather": lambda: comm.all_gather(torch.ones(numel), torch.ones(numel // n)),
                    "reduce_scatter": lambda: comm.reduce_scatter(torch.empty(numel // n), torch.ones(numel)),
                    "all_reduce": lambda: comm.all_reduce(torch.ones(numel)),
                    "broadcast": lambda: comm.broadcast(torch.ones(numel), src=0)}
        return {"all_gather": lambda: dist.all_gather_single(torch.ones(numel), torch.ones(numel // n), group=group),
                "reduce_scatter": lambda: dist.reduce_scatter_single(torch.empty(numel // n), torch.ones(numel),
                                                                     group=group),
                "all_reduce": lambda: dist.all_reduce(torch.ones(numel), group=group),
                "broadcast": lambda: dist.broadcast(torch.ones(numel), src=0, group=group)}

    rank, out = dist.get_rank(), {}
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: None}
    with tempfile.TemporaryFile() as scratch:
        for n, group in groups.items():
            member = rank < n
            for kind, run in runs(n, group).items():
                if member:
                    run()  # warm-up: gloo's first call of a kind sets up its buffers
                comm.barrier()
                tcp0, proc0 = tcp_bytes_written(), proc_wchar()
                with count_wire() as wire, shardlab.count_comm() as ledger:
                    if member:
                        run()
                    scratch.write(b"x" * noise_bytes)  # a write to a file, not a socket
                    scratch.flush()
                tcp1, proc1 = tcp_bytes_written(), proc_wchar()
                got = dict(wire=wire.bytes, tcp=tcp1 - tcp0, proc=proc1 - proc0, member=member)
                if group is None:
                    got.update(ledger_wire=ledger.wire_bytes(), ring=ledger.ring_bytes(), record=dict(ledger.records[0]),
                               row=ledger.as_dict()["init"][kind], table=ledger.table())
                out.setdefault(n, {})[kind] = got
    comm.barrier()  # no rank leaves (closing its connections, and their counters) before all have read
    return dict(rank=rank, numel=numels, noise=noise_bytes, sizes=out)


def uncounted_at_collectives(stages) -> dict:
    """At each unit's collective, issued (``COMM``) and landed (``COMM_DONE``): the bytes of live
    flat buffers and shards of a unit that the memory tally does not count, found by ``gc``.

    The garbage collector sees every tensor object Python holds, locals of the engine included
    (not a tensor only C++ holds: autograd's accumulation buffers, a gloo work's copies), so for
    what the engine keeps it is a ground truth the tally is checked against: any fp32 tensor with
    storage of its own the size of a unit's padded buffer or of its shard is a gradient buffer, a
    gathered unit or a master.
    """
    return {stage: _uncounted_in_one_step(stage) for stage in stages}


def _buffers_alive(sizes: set | None = None) -> dict:
    """Storage key -> bytes of every live fp32 tensor with storage of its own (and ``numel`` in ``sizes``)."""
    import gc
    import warnings

    from shardlab.instruments import memory

    with warnings.catch_warnings():  # isinstance on every object wakes torch's deprecated aliases
        warnings.simplefilter("ignore")
        return {memory._key(t): t.untyped_storage().nbytes() for t in gc.get_objects()
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and (sizes is None or t.numel() in sizes)
                and t.untyped_storage().nbytes() == 4 * t.numel()}


def _uncounted_in_one_step(stage: int) -> list[tuple]:
    import gc

    from shardlab.engine import events
    from shardlab.instruments import memory

    rank, world_size = dist.get_rank(), dist.get_world_size()
    gc.collect()
    before = _buffers_alive()  # earlier stages' models, if still alive (they stay so: no address reuse)
    torch.manual_seed(0)
    model, opt = shardlab.parallelize(gpt(MODEL, **MODEL_KW), stage=stage, optimizer_cls=torch.optim.AdamW, lr=1e-3)
    units = shardlab.engine_of(model).units
    sizes = {u.padded_numel for u in units} | {u.shard_numel for u in units}
    earlier = {key for key, nbytes in before.items() if nbytes // 4 in sizes}  # masks only buffers of these sizes
    _step(model, opt, 0, rank, world_size)
    opt.zero_grad()
    missed = []

    def look(name, fields):
        if name not in (events.COMM, events.COMM_DONE) or fields.get("unit") is None:
            return
        counted = memory._tally(model, opt).seen | earlier
        alive = _buffers_alive(sizes)
        missed.append((name, fields["kind"], fields["unit"], sum(n for k, n in alive.items() if k not in counted)))

    with events.listen(look):
        _step(model, opt, 1, rank, world_size)
    return missed
