"""Lab 6 checks: diagnose a run you did not write, name its cause, fix it with one setting.

Each case is a plan (``shardlab.course.symptoms``: stage, units, options, batch) with a symptom
seen in the field (notebook 09). The learner writes ``diagnose_<case>()``, returning a cause, a
key of :data:`CAUSES`, and a fix, ``{setting: new value}`` changing one setting of the plan.
The check names what the data shows when the cause is wrong; with the right cause it reruns the
plan with the fix on the live ranks and confirms, with the same instrument, that the symptom is
gone. :func:`report` is what the lab shows of each run before the learner answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.distributed as dist

from shardlab.course import measure, symptoms
from shardlab.course.labs.tasks import Hint, task
from shardlab.engine.api import engine_of
from shardlab.instruments.traffic import count_comm

#: The causes the course names, by key: notebook 09's five, and two settings of notebooks 04 and 05
#: (``reshard_after_forward``, ``prefetch``) that a plan may also get wrong. Each case's cause is one
#: of them; the others are there because each fits some case's symptom until the plan and the
#: report are read.
CAUSES = {
    "unit_gathered_whole": "a unit (or a bucket) as big as the model is gathered whole, on top of the shard",
    "weights_kept_gathered": "reshard_after_forward=False: every unit keeps its full weights from its forward "
                             "until its backward",
    "activations": "activations are set by the batch per rank and the model, and sharding does not cut them",
    "too_many_collectives": "many small units: a gather per unit, each paying latency and a fixed cost",
    "gathers_not_overlapped": "no prefetch: each gather starts only when its unit is about to run, so no "
                              "compute hides it",
    "unreduced_gradient": "a gradient that was not reduce-scattered is kept whole, not as a shard",
    "states_only_estimate": "the estimate counts the model states at rest, and nothing else",
}
#: The settings a fix may change, with their values when a plan does not say.
SETTINGS = {"stage": 3, "units": "blocks", "reshard_after_forward": True, "prefetch": True,
            "checkpointing": False, "batch_size": 8, "sync_every_micro_batch": True}
LINK = "1GbE"
STAGE3_ONLY = ("prefetch", "reshard_after_forward")  # options ZeRO-2 cannot take: it never frees weights


@dataclasses.dataclass(frozen=True)
class Case:
    plan: dict
    cause: str
    seen: str                           # the symptom, as the lab states it
    wrong: dict                         # wrong cause -> what the data shows instead
    gone: Callable[[dict], str]         # the fixed plan -> what was verified; raises Hint if not


_baselines: dict = {}  # (what, plan, world size) -> measured: the same on every call, so measured once


def _baseline(what: str, fn, plan: dict):
    """``fn(plan)``, measured once per world size on this rank: a case's run before the fix, or
    the reference it is held to (the same bytes every time), so that each check reruns only the fix."""
    key = (what, repr(sorted(plan.items())), dist.get_world_size())
    if key not in _baselines:
        _baselines[key] = fn(plan)
    return _baselines[key]


def _peak_below_zero2(plan: dict) -> str:
    if plan.get("stage", 3) != 3:
        raise Hint(f"stage {plan['stage']} gives up sharding the weights; this model will grow, so the run must stay "
                   "at stage 3 and get below ZeRO-2's peak there", "what does stage 3 gather whole?",
                   mistake="symptom_remains")
    same_at_zero2 = {k: v for k, v in plan.items() if k not in STAGE3_ONLY} | {"stage": 2}
    mine, zero2 = symptoms.peak(plan), _baseline("peak", symptoms.peak, same_at_zero2)
    if mine["total"] >= zero2["total"]:
        raise Hint(f"rerun with your fix: peak {mine['total']:,} B, still not below ZeRO-2's {zero2['total']:,} B; "
                   f"{mine['gathered']:,} B gathered at once", "which setting decides how much is gathered at once?",
                   mistake="symptom_remains")
    units = plan.get("units", SETTINGS["units"])  # ZeRO-2's peak moves with the units too: say which
    return (f"rerun on {dist.get_world_size()} ranks: stage 3 peaks at {mine['total']:,} B, below ZeRO-2's "
            f"{zero2['total']:,} B for the same run (units={units!r}); {mine['gathered']:,} B gathered at most")


def _peak_halved(plan: dict) -> str:
    before, after = _baseline("peak", symptoms.peak, CASES["b"].plan), symptoms.peak(plan)
    smaller = plan.get("batch_size", 8) < CASES["b"].plan["batch_size"]
    if after["total"] > before["total"] / 2:
        seen = (f"rerun with your fix: peak {after['total']:,} B against {before['total']:,} B before, "
                f"{after['at_peak']['activations']:,} B of it activations")
        if smaller and after["total"] < before["total"]:
            raise Hint(f"{seen}: smaller, not yet half. The activations shrank with the batch per rank; the "
                       "rest of the peak did not", "how far must the batch per rank fall for the whole peak to "
                       "halve, or which other setting shrinks the activations?", mistake="symptom_remains")
        raise Hint(seen, "what sets the activations' size?", mistake="symptom_remains")
    return (f"rerun on {dist.get_world_size()} ranks: peak {after['total']:,} B, below half of "
            f"{before['total']:,} B; activations at the peak {after['at_peak']['activations']:,} B"
            + ("; a smaller batch per rank is a smaller global batch, unless you accumulate micro-batches "
               "to keep it (notebook 09)" if smaller else ""))


def _link_formula(plan: dict) -> tuple[int, int, float, int]:
    """(units, collectives, seconds on the link by the α-β formula, Ψ) of one step of ``plan``."""
    model, optimizer = symptoms.build(plan)
    batches = measure.data(model, batch_size=plan.get("batch_size", 8), steps=1)
    with count_comm(wire=False) as ledger:
        measure.train_step(model, optimizer, *batches[0])
    units = engine_of(model).units
    return (len(units), ledger.calls(), measure.predicted_link_s(ledger.records, dist.get_world_size(), LINK),
            sum(u.numel for u in units))


def _units(n: int) -> str:
    return f"{n} unit" + ("" if n == 1 else "s")


def _fewer_units(plan: dict) -> str:
    """The cause is many small units, each a collective or two that pays latency and a fixed cost on
    the processor, which the α-β formula leaves out (notebook 09's timed steps show it). So a fix
    passes only when it cuts the units to no more than DDP's as the report runs it, and the link time
    with them. A stage change alone keeps the 18 units: DDP or ZeRO-2 on them is as many small
    collectives, and the formula alone would call that as fast as DDP (18 gathers and 18
    reduce-scatters move what 18 all-reduces move). What stays at stage 3 is its third Ψ of
    traffic, the price of sharding the weights: said, not hidden."""
    (units, calls, link, psi), (before_units, before_calls, before, _) = (_link_formula(plan),
                                                                       _baseline("link", _link_formula, CASES["c"].plan))
    ddp_units, ddp_calls, ddp, _ = _baseline("link", _link_formula, dict(stage=0))  # DDP as the report runs it
    on = (f"rerun on {dist.get_world_size()} ranks: {_units(units)}, {calls} collectives a step, "
          f"{link * 1e3:.1f} ms on {LINK} by the α-β formula")
    ddp_is = (f"DDP as the report runs it: {_units(ddp_units)} (units={SETTINGS['units']!r}), {ddp_calls} "
              f"collectives, {ddp * 1e3:.1f} ms on {dist.get_world_size()} ranks")
    if units > ddp_units:
        raise Hint(f"{on}; {ddp_is}. Still {_units(units)}: each one is a collective or more a step, and each "
                   "collective pays the link's latency and a fixed cost on the processor that the formula leaves "
                   "out, so the small units, the cause, are still there",
                   "which setting decides how many units the model is cut into?", mistake="small_units_remain")
    if link >= before:
        raise Hint(f"{on}, not less than the {before * 1e3:.1f} ms before the fix; {ddp_is}",
                   "how many collectives does each unit cost?", mistake="symptom_remains")
    done = f"{on}, down from {_units(before_units)}, {before_calls} collectives and {before * 1e3:.1f} ms; {ddp_is}"
    if link <= ddp * 1.001 and units == 1:  # case A's run: fast, and the memory pays
        return (f"{done}: no more link time than DDP. The price is memory: the one unit is the whole model, "
                f"4 B x Ψ = {4 * psi:,} B by the formula, gathered at once on top of the shard (case A); "
                "blocks keep one block gathered at a time")
    if link <= ddp * 1.001:
        return f"{done}: no more link time than DDP"
    return (f"{done}. The rest is stage 3's extra gather, 3Ψ moved against DDP's 2Ψ by the ring formula, the "
            "price of sharding the weights; this model fits, so these units at stage 2 would move DDP's 2Ψ")


def _shard_of_gradient(plan: dict) -> str:
    run = symptoms.accumulate(plan)
    n, shard = dist.get_world_size(), 4 * run["psi"] / dist.get_world_size()
    if run["grads_between"] > shard + 4 * (n - 1) * run["units"]:  # padding: at most N-1 elements per unit
        raise Hint(f"rerun with your fix: {run['grads_between']:,} B of gradient held between micro-batches, "
                   f"{run['grads_between'] / run['psi']:.2f} bytes per parameter; a shard would be 4/N = "
                   f"{4 / n:.2f} bytes per parameter on {n} ranks",
                   "when is a gradient sharded? Only once it is reduce-scattered", mistake="symptom_remains")
    return (f"rerun on {n} ranks: {run['grads_between']:,} B of gradient held between micro-batches = 4Ψ/{n}, "
            f"for {run['reduce_scatters']} reduce-scatters a step")


CASES = {
    "a": Case(dict(stage=3, units="whole"), "unit_gathered_whole",
              "stage 3 peaks above ZeRO-2 on the same run",
              {"activations": "the report shows the same activations at stage 3 and at ZeRO-2: they are not what differs",
               "weights_kept_gathered": "the plan keeps reshard_after_forward=True (the default): what this plan "
                                        "changes is another setting",
               "too_many_collectives": "this is a memory symptom, and this run has a single unit: one all-gather "
                                       "and one reduce-scatter a step",
               "gathers_not_overlapped": "this is a memory symptom, and the plan keeps prefetch=True (the default)",
               "unreduced_gradient": "this run takes one backward per step; nothing is accumulated",
               "states_only_estimate": "the report compares two measured peaks, not an estimate with a run"}, _peak_below_zero2),
    "b": Case(dict(stage=3, batch_size=32), "activations",
              "the peak hardly falls from 2 ranks to 4",
              {"unit_gathered_whole": "the units are blocks here, and 'gathered' is a small column of the report",
               "weights_kept_gathered": "the plan keeps reshard_after_forward=True (the default), and 'gathered' is "
                                        "a small column of the report",
               "too_many_collectives": "this is a memory symptom; its units are the four blocks and the root, "
                                       "9 all-gathers and 5 reduce-scatters a step, not many small collectives",
               "gathers_not_overlapped": "this is a memory symptom, and the plan keeps prefetch=True (the default)",
               "unreduced_gradient": "one backward per step: no gradient is kept between micro-batches",
               "states_only_estimate": "the report is a measured run, not an estimate, and its params and optimizer "
                                       "columns do halve from 2 ranks to 4: what holds the peak up is another column"},
              _peak_halved),
    "c": Case(dict(stage=3, units="linear"), "too_many_collectives",
              f"a step on {LINK} is much slower than DDP's, on a model that fits",
              {"unit_gathered_whole": "the report counts 18 units, none of them the whole model",
               "weights_kept_gathered": "the plan keeps reshard_after_forward=True (the default), and keeping weights "
                                        "gathered would save gathers, not add them",
               "activations": "this is a time symptom: the ledger shows ten times DDP's collectives",
               "gathers_not_overlapped": "the plan keeps prefetch=True (the default): each gather starts while the "
                                         "unit before it computes. Count what a step pays for: units and collectives",
               "unreduced_gradient": "one backward per step; the ledger shows a reduce-scatter per unit",
               "states_only_estimate": "nothing is estimated here: the step was timed"}, _fewer_units),
    "d": Case(dict(stage=3, sync_every_micro_batch=False), "unreduced_gradient",
              "between two micro-batches a rank holds 4 bytes of gradient per parameter, at any N",
              {"unit_gathered_whole": "the units are blocks, and what stays is gradient bytes, not gathered weights",
               "weights_kept_gathered": "the plan keeps reshard_after_forward=True (the default), and what the report "
                                        "counts is gradient bytes, not gathered weights",
               "gathers_not_overlapped": "this is a memory symptom, and the plan keeps prefetch=True (the default)",
               "activations": "the report counts gradient bytes after the first micro-batch's backward, when its "
                              "activations are freed",
               "too_many_collectives": "this is a memory symptom; the ledger shows fewer reduce-scatters than usual",
               "states_only_estimate": "the gradient bytes were measured, and they equal 4Ψ whatever N is"},
              _shard_of_gradient),
}


def _judge(case_id: str, fn) -> str:
    case = CASES[case_id]
    out = fn()
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], str)):
        what = (f"{len(out)} things" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}")
        raise Hint(f"return two things, (cause, fix): a cause (a key of lab6.CAUSES) and a fix ({{setting: value}}); "
                   f"got {what}: {out!r}", mistake="not_a_diagnosis")
    cause, fix = out
    if cause not in CAUSES:
        raise Hint(f"{cause!r} is not one of the course's causes: choose one of {', '.join(CAUSES)}",
                   mistake="unknown_cause")
    if cause != case.cause:
        raise Hint(f"not {cause}: {case.wrong[cause]}", "read the report again: which line is out of line?",
                   mistake="wrong_cause")
    if not isinstance(fix, dict) or len(fix) != 1:
        raise Hint(f"change exactly one setting, as {{setting: value}}; got {fix!r}", mistake="not_one_setting")
    (setting, value), = fix.items()
    if setting not in SETTINGS:
        raise Hint(f"{setting!r} is not a setting of the plan: choose one of {', '.join(SETTINGS)}",
                   mistake="unknown_setting")
    if isinstance(SETTINGS[setting], bool) and not isinstance(value, bool):
        raise Hint(f"{setting} is True or False, not {value!r}: give it a bool", mistake="not_a_bool")
    if case.plan.get(setting, SETTINGS[setting]) == value:
        raise Hint(f"the run already has {setting}={value!r}: change it", mistake="no_change")
    try:
        verified = case.gone(dict(case.plan, **fix))
    except ValueError as e:  # a value the plan cannot take, e.g. units="leaves"
        raise Hint(f"{setting}={value!r} cannot be built: {e}", mistake="bad_value") from None
    return f"the cause is {cause}; {verified}"


@task("lab6.case_a", fn_name="diagnose_a", timeout=60.0)
def check_case_a(fn) -> str:
    return _judge("a", fn)


@task("lab6.case_b", fn_name="diagnose_b", timeout=60.0)
def check_case_b(fn) -> str:
    return _judge("b", fn)


@task("lab6.case_c", fn_name="diagnose_c", timeout=60.0)
def check_case_c(fn) -> str:
    return _judge("c", fn)


@task("lab6.case_d", fn_name="diagnose_d", timeout=60.0)
def check_case_d(fn) -> str:
    return _judge("d", fn)


def report(case_id: str) -> dict:
    """What the lab shows of a case's run, measured on this rank (run it on every rank)."""
    case = CASES[case_id]
    if case_id == "a":
        return {"this run": symptoms.peak(case.plan), "ZeRO-2, same run": symptoms.peak(dict(case.plan, stage=2))}
    if case_id == "b":
        return {"this run": symptoms.peak(case.plan)}
    if case_id == "c":
        return symptoms.link_times({"this run": case.plan, "DDP": dict(stage=0)}, LINK, 2)  # DDP as people run it
    return {"this run": symptoms.accumulate(case.plan)}
