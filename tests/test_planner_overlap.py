"""The contention's overlap sweep (``step._overlap``) against the sum over every pair it replaced.

Code review round 4, H1: the sum over every (compute span, transfer span) pair was quadratic in
layers × grad-accum, and the CLI took minutes for 405B on 1024 GPUs at grad-accum 16. The sweep
must give the very same float, on random spans and on real replays."""

import random

import pytest

from shardlab import planner
from shardlab.planner import step
from shardlab.planner.step import _Link, _merged, _overlap


def _every_pair(computing, *links):
    """The old double loop, kept here as the reference: the same merged transfers, then every pair."""
    merged = _merged(links)
    return sum(max(0.0, min(c1, t1) - max(c0, t0)) for c0, c1 in computing for t0, t1 in merged)


def _spans(rng, n, grid):
    """``n`` random spans, some empty, some touching, on a coarse grid or as arbitrary floats."""
    out = []
    for _ in range(n):
        a = rng.randrange(50) / 4 if grid else rng.uniform(0, 12)
        out.append((a, a + (rng.randrange(12) / 4 if grid else rng.uniform(0, 3) * rng.random())))
    return out


def _link(spans):
    link = _Link()
    link.spans = spans
    return link


@pytest.mark.parametrize("case", range(300))
def test_the_sweep_equals_the_sum_over_every_pair(case):
    rng = random.Random(case)
    grid = case % 2 == 0
    computing = _spans(rng, rng.randrange(0, 30), grid)
    if case % 3:  # as replay books them: in time order, back to back; else any order, overlapping
        computing, t = [], 0.0
        for _ in range(rng.randrange(0, 30)):
            seconds = rng.randrange(8) / 4 if grid else rng.uniform(0, 2)
            computing.append((t, t + seconds))
            t += seconds + (rng.randrange(3) / 4 if grid else rng.uniform(0, 0.5)) * (rng.random() < 0.3)
    links = [_link(_spans(rng, rng.randrange(0, 30), grid)) for _ in range(rng.randrange(1, 3))]
    assert _overlap(computing, *links) == _every_pair(computing, *links)


@pytest.mark.parametrize("plan, gpus", [(planner.Plan("zero3", grad_accum=3), 64),
                                        (planner.Plan("hsdp", grad_accum=2), 64),
                                        (planner.Plan("ddp", grad_accum=2), 16)])
def test_a_replay_gives_the_same_timing_as_with_every_pair(monkeypatch, plan, gpus):
    # real spans (HSDP books two links) through the whole step_time, contention included
    args = (planner.model("8b"), planner.cluster("h100", gpus), plan)
    fast = step.step_time(*args, network="nccl")
    monkeypatch.setattr(step, "_overlap", _every_pair)
    assert fast.contention_s > 0 and step.step_time(*args, network="nccl") == fast


def test_perfect_overlap_charges_no_contention(monkeypatch):
    # the ideal model (overlap efficiency 1) never needs the sweep: its result would be × 0
    monkeypatch.setattr(step, "_overlap", lambda *a: pytest.fail("_overlap called at efficiency 1"))
    run = step.step_time(planner.model("8b"), planner.cluster("h100", 64), planner.Plan("zero3", grad_accum=4))
    assert run.contention_s == 0.0 and run.step_s >= run.compute_s


def test_405b_on_1024_gpus_at_grad_accum_64_replays():
    # took over 585 s with the sum over every pair; returns under pytest-timeout's default now.
    # Overlap is compute seconds, so the contention is at most (1 - 0.9) of the compute.
    run = step.step_time(planner.model("405b"), planner.cluster("h100", 1024),
                         planner.Plan("zero3", grad_accum=64), network="nccl", overlap_efficiency=0.9)
    assert 0 < run.contention_s <= (1 - 0.9) * run.compute_s * (1 + 1e-12)
