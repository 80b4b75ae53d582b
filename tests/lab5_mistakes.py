"""Realistic wrong answers to lab 5, one small slip each (importable: the checks run them on
spawned ranks), and correct alternatives that must pass."""

import torch


# -- forward_prefetch ---------------------------------------------------------------------------
def forward_prefetch_everything_upfront(units, x):
    for unit in units:
        unit.gather(async_op=True)
    for unit in units:
        unit.gather()
        x = unit.module(x)
        unit.free()
    return x


def forward_prefetch_waits_at_once(units, x):
    for i, unit in enumerate(units):
        unit.gather()
        if i + 1 < len(units):
            units[i + 1].gather()  # a plain gather waits right here
        x = unit.module(x)
        unit.free()
    return x


def forward_prefetch_never_waits(units, x):
    units[0].gather()
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            units[i + 1].gather(async_op=True)
        x = unit.module(x)  # the prefetched unit is used without waiting for its gather
        unit.free()
    return x


def forward_prefetch_frees_before_running(units, x):  # free moved above the compute
    for i, unit in enumerate(units):
        unit.gather()
        if i + 1 < len(units):
            units[i + 1].gather(async_op=True)
        unit.free()
        x = unit.module(x)
    return x


def forward_prefetch_never_frees(units, x):
    for i, unit in enumerate(units):
        unit.gather()
        if i + 1 < len(units):
            units[i + 1].gather(async_op=True)
        x = unit.module(x)
    return x


def forward_prefetch_after_compute(units, x):  # the next gather starts once this unit is done
    for i, unit in enumerate(units):
        unit.gather()
        x = unit.module(x)
        if i + 1 < len(units):
            units[i + 1].gather(async_op=True)
        unit.free()
    return x


def forward_prefetch_two_ahead(units, x):
    for i, unit in enumerate(units):
        unit.gather()
        for later in units[i + 1:i + 3]:
            later.gather(async_op=True)
        x = unit.module(x)
        unit.free()
    return x


def forward_prefetch_under_no_grad(units, x):  # "only values are needed in forward"
    with torch.no_grad():
        for i, unit in enumerate(units):
            unit.gather()
            if i + 1 < len(units):
                units[i + 1].gather(async_op=True)
            x = unit.module(x)
            unit.free()
    return x


def forward_prefetch_first_two_then_next(units, x):  # correct: start 0 and 1, then each next
    units[0].gather(async_op=True)
    for i, unit in enumerate(units):
        unit.gather()
        if i + 1 < len(units):
            units[i + 1].gather(async_op=True)
        x = unit.module(x)
        unit.free()
    return x


def forward_prefetch_async_positionally(units, x):  # gather(True): async_op is keyword-only
    for i, unit in enumerate(units):
        unit.gather()
        if i + 1 < len(units):
            units[i + 1].gather(True)
        x = unit.module(x)
        unit.free()
    return x


def forward_prefetch_past_the_end(units, x):  # no bound check: the last unit has no next one
    for i, unit in enumerate(units):
        unit.gather()
        units[i + 1].gather(async_op=True)
        x = unit.module(x)
        unit.free()
    return x


# -- prefetch_next ------------------------------------------------------------------------------
def prefetch_next_all_remaining(order, unit):
    for later in order[order.index(unit) + 1:]:
        later.gather(async_op=True)


def prefetch_next_waits(order, unit):
    i = order.index(unit)
    if i + 1 < len(order):
        order[i + 1].gather()


def prefetch_next_past_the_end(order, unit):
    order[order.index(unit) + 1].gather(async_op=True)


def prefetch_next_current(order, unit):
    unit.gather(async_op=True)  # already gathered: starts nothing


def prefetch_next_previous(order, unit):
    i = order.index(unit)
    if i > 0:
        order[i - 1].gather(async_op=True)  # the unit that already ran


def prefetch_next_two_ahead(order, unit):
    i = order.index(unit)
    if i + 2 < len(order):
        order[i + 2].gather(async_op=True)


def prefetch_next_bound_one_short(order, unit):  # i < len(order) - 2: the last unit is never prefetched
    i = order.index(unit)
    if i < len(order) - 2:
        order[i + 1].gather(async_op=True)


def prefetch_next_by_identity(order, unit):  # correct: a loop instead of index()
    for i, u in enumerate(order):
        if u is unit and i + 1 < len(order):
            order[i + 1].gather(async_op=True)


def forward_prefetch_frees_a_unit_late(units, x):  # frees the previous unit one iteration late
    prev = None
    for i, unit in enumerate(units):
        unit.gather()
        if i + 1 < len(units):
            units[i + 1].gather(async_op=True)
        if prev is not None:
            prev.free()
        x = unit.module(x)
        prev = unit
    prev.free()
    return x


def prefetch_next_wraps_around(order, unit):  # % len(order): the last unit prefetches the first again
    order[(order.index(unit) + 1) % len(order)].gather(async_op=True)


FORWARD, NEXT = "lab5.forward_prefetch", "lab5.prefetch_next"
WRONG = {  # case: (task, wrong answer, the mistake the check must name, words its hint must contain)
    "every gather started up front": (FORWARD, forward_prefetch_everything_upfront, "too_many",
                                      "4 units held their full weights at once; at most 2"),
    "waits for the prefetch at once": (FORWARD, forward_prefetch_waits_at_once, "waited_at_once", "so it hid nothing"),
    "uses a unit before its gather landed": (FORWARD, forward_prefetch_never_waits, "used_in_flight",
                                             "while its prefetched gather was still in flight"),
    "frees before the unit runs": (FORWARD, forward_prefetch_frees_before_running, "freed_before_forward",
                                   "blocks.0's forward ran after you freed it"),
    "never frees": (FORWARD, forward_prefetch_never_frees, "not_freed", "still hold full weights at the end"),
    "prefetch after the compute": (FORWARD, forward_prefetch_after_compute, "no_overlap", "nothing overlaps"),
    "prefetch two ahead": (FORWARD, forward_prefetch_two_ahead, "too_many", "3 units held their full weights"),
    "forward under no_grad": (FORWARD, forward_prefetch_under_no_grad, "no_graph", "no autograd graph"),
    "frees a unit one iteration late": (FORWARD, forward_prefetch_frees_a_unit_late, "too_many",
                                        "3 units held their full weights"),
    "gather(True) for the next unit": (FORWARD, forward_prefetch_async_positionally, "positional_async",
                                       "async_op by keyword"),
    "runs past the last unit (forward)": (FORWARD, forward_prefetch_past_the_end, "past_the_end",
                                          "the last unit has no next one"),
    "prefetches every remaining unit": (NEXT, prefetch_next_all_remaining, "too_many",
                                        "4 units held their full weights at once; at most 2"),
    "waits for the prefetch at once (stage 3)": (NEXT, prefetch_next_waits, "waited_at_once",
                                                 "waited for the gather it started"),
    "runs past the last unit": (NEXT, prefetch_next_past_the_end, "past_the_end", "the last unit in the order has no next one"),
    "prefetches the current unit": (NEXT, prefetch_next_current, "started_none", "started no gather"),
    "prefetches the unit that already ran": (NEXT, prefetch_next_previous, "prefetched_done", "already run"),
    "wraps around past the last unit": (NEXT, prefetch_next_wraps_around, "prefetched_done", "already run"),
    "prefetches two ahead (stage 3)": (NEXT, prefetch_next_two_ahead, "too_many", "units held their full weights at once"),
    "index bound one short": (NEXT, prefetch_next_bound_one_short, "not_prefetched",
                              "blocks.3 in forward, blocks.0 in backward: the last unit of each order"),
}
ON_THREE: dict = {}
CORRECT = {
    "starts the first gather early too": (FORWARD, forward_prefetch_first_two_then_next),
    "finds the unit by identity": (NEXT, prefetch_next_by_identity),
}
