"""Every lab's checks, on 4 and on 3 ranks: they pass the solution and the correct alternatives,
say "not implemented" to the stubs, and give each wrong solution (``labN_mistakes.py``) the
hint that names its mistake. Then one claim per lab about what its solution's verdict reports.

Each lab's checks run once, on fresh ranks, the first time one of its tests asks
(``labs_support.verdicts``); the rest of its tests read those results.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import lab1_mistakes
import lab2_mistakes
import lab3_mistakes
import lab4_mistakes
import lab5_mistakes
import lab6_mistakes
import pytest
from labs_support import assert_mistake, verdicts

from shardlab.course.labs.tasks import WORLD_SIZES, lab_tasks

LABS = {
    "lab1": ("lab1_shard_and_gather.ipynb", lab1_mistakes),
    "lab2": ("lab2_zero1.ipynb", lab2_mistakes),
    "lab3": ("lab3_zero2.ipynb", lab3_mistakes),
    "lab4": ("lab4_fsdp_unit.ipynb", lab4_mistakes),
    "lab5": ("lab5_prefetch.ipynb", lab5_mistakes),
    "lab6": ("lab6_diagnose.ipynb", lab6_mistakes),
}
_RESULTS: dict[str, dict] = {}


def results_of(lab: str) -> dict:
    """{(case, world size): Result} for ``lab``, computed on its first use in this session."""
    if lab not in _RESULTS:
        notebook, m = LABS[lab]
        _RESULTS[lab] = verdicts(lab, notebook, {**m.WRONG, **m.ON_THREE}, m.CORRECT,
                                 Path(tempfile.mkdtemp(prefix=f"shardlab-{lab}-")))
    return _RESULTS[lab]


def cases(kind: str) -> list[tuple[str, str]]:
    """(lab, case) for every case of ``kind`` (``WRONG``, ``CORRECT``, ``ON_THREE``), lab by lab."""
    return [(lab, case) for lab, (_, m) in LABS.items() for case in getattr(m, kind)]


TASKS = [(lab, t.id) for lab in LABS for t in lab_tasks(lab)]


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize(("lab", "task"), TASKS)
def test_solution_passes_and_stub_is_not_implemented(lab, task, ws):
    results = results_of(lab)
    assert results[f"solution {task}", ws].status == "pass", results[f"solution {task}", ws].line()
    assert results[f"stub {task}", ws].status == "not implemented", results[f"stub {task}", ws].line()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize(("lab", "case"), cases("CORRECT"))
def test_correct_alternative_passes(lab, case, ws):
    results = results_of(lab)
    assert results[case, ws].status == "pass", results[case, ws].line()


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize(("lab", "case"), cases("WRONG"))
def test_mistake_gets_its_hint(lab, case, ws):
    assert_mistake(results_of(lab), LABS[lab][1].WRONG, case, ws)


@pytest.mark.parametrize(("lab", "case"), cases("ON_THREE"))
def test_hard_coded_four_passes_on_4_ranks_and_gets_its_hint_on_3(lab, case):
    results = results_of(lab)
    assert results[case, 4].status == "pass", results[case, 4].line()
    assert_mistake(results, LABS[lab][1].ON_THREE, case, 3)


@pytest.mark.parametrize("lab", LABS)
def test_every_task_has_four_wrong_solutions(lab):
    m = LABS[lab][1]
    for t in lab_tasks(lab):
        assert sum(task == t.id for task, *_ in {**m.WRONG, **m.ON_THREE}.values()) >= 4, t.id


# -- what each lab's solution verdict reports ---------------------------------------------------
def test_lab1_solution_reports_the_bytes_it_sent():
    message = results_of("lab1")["solution lab1.all_reduce_mean", 4].message
    assert "one reduce-scatter and one all-gather, 96 B per rank by the ring formula" in message, message


def test_lab2_solution_shards_the_optimizer_state_by_n():
    for ws in WORLD_SIZES:
        message = results_of("lab2")["solution lab2.shard_optimizer", ws].message
        per_rank, stage0 = map(int, re.search(rf"(\d+) B per rank = 1/{ws} of stage 0's (\d+) B", message).groups())
        assert per_rank * ws == stage0 > 0, message


def test_lab3_solution_measures_a_lower_gradient_peak():
    message = results_of("lab3")["solution lab3.when_ready", 4].message
    peak, every = re.search(r"peaked at ([\d,]+) bytes vs ([\d,]+)", message).groups()
    assert int(peak.replace(",", "")) < int(every.replace(",", "")), message


def test_lab4_solution_follows_the_whole_cycle_and_rests_on_shards():
    message = results_of("lab4")["solution lab4.prepare_backward", 4].message
    assert "gather -> forward -> free -> gather -> backward -> reduce_scatter -> free" in message, message
    assert "match ShardLab stage 3" in message and "full weights freed" in message, message
    fsdp2 = results_of("lab4")["free before reduce-scatter (FSDP2's order)", 4].message
    assert "backward -> free -> reduce_scatter (free before reduce_scatter: FSDP2's order)" in fsdp2, fsdp2


def test_lab5_solution_overlaps_gathers_with_compute():
    message = results_of("lab5")["solution lab5.prefetch_next", 4].message
    assert "gathers were in flight while a unit computed" in message and "at most 2 units" in message, message


def test_lab6_solution_reruns_the_fix_and_reports_the_symptom_gone():
    for ws in WORLD_SIZES:
        a = results_of("lab6")["solution lab6.case_a", ws].message
        mine, zero2 = (int(x.replace(",", "")) for x in re.search(r"peaks at ([\d,]+) B, below ZeRO-2's ([\d,]+) B", a).groups())
        assert f"rerun on {ws} ranks" in a and mine < zero2, a
        c = results_of("lab6")["solution lab6.case_c", ws].message
        units, before, ddp = (int(re.search(rf"{w} (\d+) units", c).group(1)) for w in ("ranks:", "down from", "runs it:"))
        assert units <= ddp < before, c
        d = results_of("lab6")["solution lab6.case_d", ws].message
        assert f"= 4Ψ/{ws}" in d, d
        whole = results_of("lab6")["c: one unit for the model", ws].message  # fast, and its memory price said
        assert "no more link time than DDP. The price is memory" in whole and "gathered at once" in whole, whole
