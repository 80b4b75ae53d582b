"""Lab 5 (prefetch): the checks pass the solution, say "not implemented" to the stubs, and reject
the classic mistakes with the hint that names them."""

from __future__ import annotations

import pytest
from labs_support import script_folder, verdicts

# -- forward_prefetch, wrong -------------------------------------------------------------------


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


def forward_prefetch_never_frees(units, x):
    for i, unit in enumerate(units):
        unit.gather()
        if i + 1 < len(units):
            units[i + 1].gather(async_op=True)
        x = unit.module(x)
    return x


# -- prefetch_next, wrong ----------------------------------------------------------------------


def prefetch_next_all_remaining(order, unit):
    for later in order[order.index(unit) + 1 :]:
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


WRONG = {
    "every gather started up front": ("lab5.forward_prefetch", forward_prefetch_everything_upfront,
                                      "4 units held their full weights at once; at most 2"),
    "waits for the prefetch at once": ("lab5.forward_prefetch", forward_prefetch_waits_at_once,
                                       "so it hid nothing"),
    "uses a unit before its gather landed": ("lab5.forward_prefetch", forward_prefetch_never_waits,
                                             "while its prefetched gather was still in flight"),
    "never frees": ("lab5.forward_prefetch", forward_prefetch_never_frees,
                    "still hold full weights at the end"),
    "prefetches every remaining unit": ("lab5.prefetch_next", prefetch_next_all_remaining,
                                        "4 units held their full weights at once; at most 2"),
    "waits for the prefetch at once (stage 3)": ("lab5.prefetch_next", prefetch_next_waits,
                                                 "waited for the gather it started"),
    "runs past the last unit": ("lab5.prefetch_next", prefetch_next_past_the_end,
                                "the last unit in the order has no next one"),
    "prefetches the current unit": ("lab5.prefetch_next", prefetch_next_current, "started no gather"),
    "prefetches the unit that already ran": ("lab5.prefetch_next", prefetch_next_previous,
                                             "units held their full weights at once"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    wrong = {case: (task, fn) for case, (task, fn, _) in WRONG.items()}
    return verdicts("lab5", "lab5_prefetch.ipynb", wrong, script_folder(tmp_path_factory))


@pytest.mark.parametrize("task", ["lab5.forward_prefetch", "lab5.prefetch_next"])
def test_solution_passes_and_stub_is_not_implemented(results, task):
    assert results[f"solution {task}"].status == "pass", results[f"solution {task}"].line()
    assert results[f"stub {task}"].status == "not implemented", results[f"stub {task}"].line()


@pytest.mark.parametrize("case", WRONG)
def test_mistake_rejected_with_its_hint(results, case):
    result, hint = results[case], WRONG[case][2]
    assert result.status == "fail", result.line()
    assert hint in result.message, result.line()
