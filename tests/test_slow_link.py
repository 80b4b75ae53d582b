"""Smoke test of ``python -m shardlab slow-link``: it runs, and its numbers follow the ring model.

Not a timing test: CI machines are noisy. On a link slow enough that the emulated delay
dwarfs the tiny model's compute, what must hold anywhere is that the measured increase is
most of the ring model's prediction, that the emulator booked exactly that prediction, and
that stage 3, which moves more bytes, is predicted to pay more than stage 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from support import slowdown

from shardlab.bench import slow_link

SLOW = "0.01:0"  # 10 Mbit/s: ~0.1 s a step for the tiny GPT, ~10x its compute


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("slow_link") / "slow_link.json"
    cmd = [sys.executable, "-m", "shardlab", "slow-link", "--model", "tiny", "--steps", "2", "--warmup", "1",
           "--links", f"none,{SLOW}", "--quiet", "--json", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=slowdown(120))
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, elapsed


def _row(result, stage, link, overlap="off"):
    (row,) = [r for r in result["rows"] if (r["stage"], r["link"], r["overlap"]) == (stage, link, overlap)]
    return row


def test_runs_and_prints_the_table(result):
    """The run's time is printed, not asserted (a loaded machine would fail a limit; the
    fixture's subprocess timeout still catches a hang)."""
    res, stdout, elapsed = result
    print(f"slow-link smoke run took {elapsed:.0f} s")
    assert "| link | stage |" in stdout and "stage 3 pays" in stdout
    assert "Nothing hidden, on" in stdout and "With overlap, on" in stdout
    keys = {(r["stage"], r["link"], r["overlap"]) for r in res["rows"]}
    assert keys == {(s, link, ov) for s in (0, 3) for link, ov in (("none", "-"), (SLOW, "off"), (SLOW, "on"))}


def test_stage_3_moves_more_than_stage_0(result):
    res, _, _ = result
    s0, s3 = res["stages"]["0"], res["stages"]["3"]
    assert set(s0["calls"]) == {"all_reduce"} and set(s3["calls"]) == {"all_gather", "reduce_scatter"}
    assert s0["psi"] == pytest.approx(2.0, rel=0.01)
    assert 2.0 < s3["psi"] <= 3.0  # 3Ψ minus the root unit, which stays gathered between forward and backward
    assert 1.0 < res["bytes_ratio"] <= 1.5
    assert _row(res, 3, SLOW)["predicted_s"] > _row(res, 0, SLOW)["predicted_s"] > 0.05


@pytest.mark.parametrize("stage", [0, 3])
def test_the_slow_link_costs_what_the_ring_model_predicts(result, stage):
    res, _, _ = result
    base = _row(res, stage, "none", "-")
    assert base["increase_s"] == 0 and base["predicted_s"] == 0 and base["slept_s"] == 0
    off, on = _row(res, stage, SLOW, "off"), _row(res, stage, SLOW, "on")
    for row in (off, on):  # the emulator books exactly the ring model over what count_comm saw
        assert row["link_time_s"] == pytest.approx(row["predicted_s"], rel=1e-6)
    assert off["slept_s"] == pytest.approx(off["link_time_s"], rel=0.05)  # no overlap: every op sleeps in full
    assert 0 < on["slept_s"] <= on["link_time_s"] + 1e-9
    assert off["increase_s"] >= 0.5 * off["predicted_s"]


def test_links_parse_and_bad_ones_are_refused():
    assert slow_link.parse_link("1GbE") == dict(name="1GbE", bandwidth_gbps=1.0, latency_us=100.0)
    assert slow_link.parse_link("0.5:20")["bandwidth_gbps"] == 0.5
    assert slow_link.predicted_delay([dict(kind="all_gather", numel=10**6, itemsize=4)], 2,
                                     slow_link.parse_link("none")) == 0.0
    for bad in ("2GbE", "0:10", "1:-1"):
        with pytest.raises(ValueError):
            slow_link.parse_link(bad)
    opts = slow_link.parse(["--links", "10GbE", "--overlap", "on"])
    assert [x["name"] for x in opts["links"]] == ["none", "10GbE"]  # the baseline is always measured
    assert slow_link._modes(opts, opts["links"][0]) == ["-"] and slow_link._modes(opts, opts["links"][1]) == ["on"]
    with pytest.raises(SystemExit):
        slow_link.parse(["--world-size", "1"])
