"""Lab 5 checks: prefetch, start the next unit's all-gather early and wait for it only when needed.

``unit.gather(async_op=True)`` starts a gather and returns at once; the next plain
``unit.gather()`` waits for it. Two tasks: ``forward_prefetch(units, x)`` (the forward loop with
the next gather in flight while this unit computes) and ``prefetch_next(order, unit)`` (the same
rule as a function, plugged into ShardLab's stage 3 for forward and backward). The rule both
checks enforce: at most two units hold full weights at once, the one running and the next.
:func:`measure` times a step on an emulated 1 GbE link with and without prefetch.
"""

from __future__ import annotations

import re
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from shardlab.course.labs import lab_model, watch
from shardlab.course.labs.tasks import Hint, task
from shardlab.engine import api, events
from shardlab.instruments.link import emulate_link, link_delay

MOST = 2  # units gathered at once: the one running and the next one
STEPS = 3  # training steps in stage 3: the engine's state carries over


def _forward_check(trace):
    return lambda unit: _not_in_flight(unit, trace)


def _not_in_flight(unit, trace) -> None:
    if unit.gathering is not None:
        raise Hint(f"{unit.name}'s forward ran while its prefetched gather was still in flight: its weights "
                   "may not have arrived. Call unit.gather() before using it (it waits for the prefetch)",
                   f"a started gather is finished by a plain unit.gather() on the same unit: {watch.GATHER_WAITS}",
                   mistake="used_in_flight")
    if not unit.holds_full:
        if trace.of(unit.name, ("gather", "prefetch")):
            raise Hint(f"{unit.name}'s forward ran after you freed it: it was gathered, then freed before its "
                       "forward computed on the weights. Free a unit only after unit.module(x) has run",
                       "look at the order of unit.free() and unit.module(x) in your loop",
                       mistake="freed_before_forward")
        raise Hint(f"{unit.name}'s forward ran on freed weights: gather it (or wait for its prefetch) first",
                   mistake="never_gathered")


def _past_the_end(exc: IndexError, fn) -> bool:
    """Python's IndexError of a list, raised on a line of ``fn`` that indexes its first argument
    (``units``, or ``order``): the last unit has no next one. A tensor's index error, or one of a
    list of the learner's own, is something else."""
    code = getattr(fn, "__code__", None)
    if str(exc) != "list index out of range" or code is None or not code.co_argcount:
        return False
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == code.co_filename]
    return bool(frames) and re.search(rf"\b{re.escape(code.co_varnames[0])}\s*\[", frames[-1].line or "") is not None


def _too_many(most: int) -> Hint:
    return Hint(f"{most} units held their full weights at once; at most {MOST} may: the one running and the "
                "next. Prefetch only the next unit, and free each unit as soon as it is done",
                "count what holds full weights at each moment: start gathers one unit ahead, not more, and free "
                "each unit right after its own forward, not a step later", mistake="too_many")


@task("lab5.forward_prefetch", fn_name="forward_prefetch")
def check_forward_prefetch(fn) -> str:
    """Run the 4-block model through ``fn``; each next gather must be in flight during this unit's forward."""
    rank = dist.get_rank()
    units = lab_model.flat_units(lab_model.make_model(), sharded=True)
    trace = watch.Trace(units)
    for u in units:
        trace.watch(u, forward_check=_forward_check(trace))
    x, _ = lab_model.batch(rank, 0)
    try:
        with trace.listen():
            out = fn(units, x)
    except IndexError as e:  # units[i + 1] at the last unit: on every rank at the same point
        if not _past_the_end(e, fn):
            raise  # another index error (a tensor's, say): told as it is, with its line
        raise Hint(f"IndexError ({e}) in your loop: the last unit has no next one; start the next gather "
                   "only if there is one", "compare i + 1 with len(units) first", mistake="past_the_end") from None
    finally:
        trace.close()
    if not torch.is_tensor(out):
        raise Hint(f"forward_prefetch returned {type(out).__name__}: return the last unit's output",
                   mistake="not_a_tensor")
    if not lab_model.close(out.detach(), lab_model.make_model()(x).detach()):
        raise Hint("the output differs from the whole model's: run every unit once, in order, on its gathered weights",
                   mistake="wrong_values")
    if not out.requires_grad or out.grad_fn is None:
        raise Hint("your output has no autograd graph, so backward cannot run: did the loop run under "
                   "torch.no_grad(), or detach the output? Training needs the graph",
                   "return what the last unit.module(x) returned", mistake="no_graph")
    busy = [u.name for u in units if u.holds_full]
    if busy:
        raise Hint(f"{', '.join(busy)} still hold full weights at the end: free each unit after its forward",
                   "the last step for each unit, once its output is computed", mistake="not_freed")
    if trace.most_gathered > MOST:
        raise _too_many(trace.most_gathered)
    log = trace.log
    at = lambda what, name: next((i for i, (w, u) in enumerate(log) if w == what and u == name), None)  # noqa: E731
    for prev, u in zip(units, units[1:]):
        issued, landed = at("all_gather", u.name), at("all_gather_done", u.name)
        started, done = at("forward", prev.name), at("forward_done", prev.name)
        if issued is None or issued > started:
            raise Hint(f"{u.name}'s gather started only after {prev.name}'s forward had begun: nothing overlaps. "
                       f"Start it (unit.gather(async_op=True)) before running {prev.name}",
                       "the next unit's gather goes before this unit's compute", mistake="no_overlap")
        if landed < done:
            raise Hint(f"you waited for {u.name}'s gather before {prev.name}'s forward ran, so it hid nothing: "
                       "start it with unit.gather(async_op=True) and wait (unit.gather()) only when you need it",
                       "which call starts a gather without waiting?", mistake="waited_at_once")
    return (f"each unit's gather was in flight during the previous unit's forward; at most "
            f"{trace.most_gathered} units gathered at once; output matches the whole model")


def _stage3(prefetch_next=None, *, d: int = lab_model.D, prefetch: bool = True):
    """A stage-3 model of blocks; ``prefetch_next`` replaces the engine's own prefetch rule."""
    model = lab_model.make_model(d)
    model, optimizer = api.parallelize(model, stage=3, optimizer_cls=torch.optim.SGD, lr=0.1, prefetch=prefetch)
    engine = api.engine_of(model)
    if prefetch_next is not None:
        engine.prefetch_next = prefetch_next
    return model, optimizer, engine


def _step(model, optimizer, x, y) -> None:
    lab_model.loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


@task("lab5.prefetch_next", fn_name="prefetch_next")
def check_prefetch_next(fn) -> str:
    """Plug ``fn`` into ShardLab's stage 3; two steps, compared with stage 3 without prefetch."""
    rank = dist.get_rank()

    calls = {"issued": 0, "waited": 0}  # all-gathers started, and waited for, inside the learner's calls
    started_early: set[int] = set()  # where in the log the learner's calls started an all-gather

    def guarded(order, unit):
        before = len(log)
        try:
            fn(order, unit)
        except IndexError as e:
            if not _past_the_end(e, fn):
                raise
            raise Hint(f"IndexError ({e}) at {unit.name}: the last unit in the order has no next one; "
                       "prefetch only if there is one", "compare the index with len(order) first",
                       mistake="past_the_end") from None
        during = [(name, kind) for name, kind, *_ in log[before:]]
        calls["issued"] += during.count((events.COMM, "all_gather"))
        calls["waited"] += during.count((events.COMM_DONE, "all_gather"))
        started_early.update(before + k for k, e in enumerate(during) if e == (events.COMM, "all_gather"))

    log, most = [], [0]
    model, optimizer, engine = _stage3(guarded)

    def record(name, fields):
        most[0] = max(most[0], watch.gathered(engine.units))
        log.append((name, fields.get("kind"), fields.get("unit"), fields.get("phase")))

    steps = STEPS
    with events.listen(record):
        for step in range(steps):
            _step(model, optimizer, *lab_model.batch(rank, step))
    mine = api.full_state_dict(model)  # every collective before any verdict
    ref_model, ref_opt, _ = _stage3(prefetch=False)
    for step in range(steps):
        _step(ref_model, ref_opt, *lab_model.batch(rank, step))
    reference = api.full_state_dict(ref_model)
    n = len(engine.units)
    gathers = [i for i, (name, kind, *_) in enumerate(log) if name == events.COMM and kind == "all_gather"]
    if len(gathers) > 2 * n * steps:
        raise Hint(f"{len(gathers)} all-gathers in {steps} steps, {2 * n * steps} are needed (each unit once for "
                   "forward, once for backward): you prefetched units that had already run",
                   "the next unit is the one right after `unit` in `order`, if there is one: not one before it, "
                   "and not order[0] again after the last", mistake="prefetched_done")
    if most[0] > MOST:
        raise _too_many(most[0])
    if calls["issued"] == 0:
        raise Hint("your prefetch_next started no gather: start the one of the unit AFTER `unit` in `order` "
                   "(the current one is gathered already)", "find unit's index in order", mistake="started_none")
    if calls["waited"]:
        raise Hint("your prefetch_next waited for the gather it started, so it hid nothing: start it with "
                   "gather(async_op=True); the engine waits when that unit is about to run",
                   "which call starts a gather without waiting?", mistake="waited_at_once")
    hidden = 0
    for i in gathers:
        unit = log[i][2]
        j = next(k for k in range(i + 1, len(log)) if log[k][:3] == (events.COMM_DONE, "all_gather", unit))
        hidden += j > i + 1  # the rank did something (ran a unit) before it waited
    want = 2 * (n - 1) * steps
    if hidden < want:
        raise _not_hidden(log, gathers, started_early, hidden, want, engine.units)
    for name, t in reference.items():
        if not lab_model.close(mine[name], t):
            raise Hint(f"after {steps} steps {name} differs from stage 3 without prefetch", mistake="wrong_values")
    return (f"in ShardLab's stage 3, {hidden} of {len(gathers)} gathers were in flight while a unit computed; at "
            f"most {most[0]} units gathered at once; weights after {steps} steps match stage 3 without prefetch")


def _not_hidden(log, gathers, started_early, hidden, want, units) -> Hint:
    """Fewer gathers overlapped compute than could: name the ones the learner's rule never started
    early (each pass's first gather has no unit before it to start it), else say they were waited
    for at once."""
    missed, phase = [], None  # (unit, phase) of each gather started only when its unit was about to run
    for i in gathers:
        unit, first = log[i][2], log[i][3] != phase  # a new pass (forward, then backward, each step)
        phase = log[i][3]
        if i not in started_early and not first and (unit, phase) not in missed:
            missed.append((unit, phase))
    if not missed:
        return Hint(f"only {hidden} of the {want} gathers that could overlap compute did: the gathers your "
                    "prefetch_next started were waited for before any unit ran. Start the one of the NEXT unit "
                    "with gather(async_op=True); the engine waits when that unit is about to run",
                    mistake="waited_at_once")
    names = ", ".join(f"{unit} in {phase}" for unit, phase in missed)
    last = {(u.name, "forward") for u in units[-1:]} | {(u.name, "backward") for u in units[:1]}
    bound = (": the last unit of each order (the forward order, and backward's reverse one). Look at the bound "
             "on your index: the unit before the last has a next one" if set(missed) <= last else "")
    return Hint(f"only {hidden} of the {want} gathers that could overlap compute did. Your prefetch_next never "
                f"started these early, when the unit before them in the order ran: {names}{bound}",
                "order[i + 1] exists as long as i + 1 < len(order)", mistake="not_prefetched")


def measure(prefetch_next, *, link: str = "1GbE", steps: int = 3, d: int = 128) -> dict | None:
    """Step time on an emulated ``link`` with and without ``prefetch_next`` (a benchmark: nothing asserted).

    Run on every rank: ``cluster.run(lab5.measure, prefetch_next)``. ``wait_s`` is the time the
    rank spent waiting for gathers each step; ``link_gather_s`` what the gathers need on the
    link by the ring formula. None while ``prefetch_next`` is still a stub.
    """
    try:
        return _measure(prefetch_next, link, steps, d)
    except NotImplementedError:
        return None


def _measure(prefetch_next, link: str, steps: int, d: int) -> dict:
    rank = dist.get_rank()
    out = {}
    for mode, rule in (("no prefetch", None), ("prefetch", prefetch_next)):
        model, optimizer, engine = _stage3(rule, d=d, prefetch=rule is not None)
        waited = [0.0]
        for unit in engine.units:  # time each blocking gather() (a prefetched one only waits)
            def timed(*, async_op=False, _gather=unit.gather, _waited=waited):
                t = time.perf_counter()
                _gather(async_op=async_op)
                if not async_op:
                    _waited[0] += time.perf_counter() - t
            unit.gather = timed
        x, y = lab_model.batch(rank, 0, d, rows=256)
        _step(model, optimizer, x, y)  # warm-up
        cost = [0.0]

        def book(name, f, cost=cost):
            if name == events.COMM and f["kind"] == "all_gather":
                cost[0] += link_delay("all_gather", f["numel"], f["dtype"], f["world_size"],
                                      emulator.link.bandwidth_gbps, emulator.link.latency_us)

        times = []
        with emulate_link(link) as emulator, events.listen(book):
            waited[0] = 0.0
            for _ in range(steps):
                t = time.perf_counter()
                _step(model, optimizer, x, y)
                times.append(time.perf_counter() - t)
        out[mode] = {"step_s": statistics.median(times), "wait_s": waited[0] / steps,
                     "link_gather_s": cost[0] / steps}
    return out
