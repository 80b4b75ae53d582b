"""The planner predicts ShardLab's own step times on this machine, within 20%.

One run on 2 ranks (``planner_calibrate.measure``) fits the emulated link's α and β from
timed all-gathers and measures stage 0 and stage 3 with and without that link, interleaved in
the same processes, so the machine's load hits the measurement and its inputs alike. The
planner gets only the fitted link and the no-link step times; it must predict the slow-link
step times. The link (0.1 Gbit/s) makes the step's traffic 3-5 times its compute, so that
the check stays within 20% on a loaded 2-core machine, where compute alone varies by ±50%:
it checks the planner's bytes per collective, its ring α-β time from the fitted link, and its
order of units (what it leaves exposed), more than the finer points of overlap. Every time
is the best of 9 interleaved rounds (load only adds time).
"""

import pytest
from support import slowdown

from shardlab.bench import planner_calibrate as C


@pytest.fixture(scope="module")
def result():
    out = C.measure("small", bandwidth_gbps=0.1, latency_us=200.0, timeout=slowdown(240))
    out["predicted"] = C.predict(out)
    return out


def test_the_fit_finds_the_emulated_bandwidth(result):
    # The emulator adds the ring model on top of loopback: β comes back, α absorbs loopback's cost.
    assert result["link"].bandwidth_gbps == pytest.approx(0.1, rel=0.15)
    assert result["link"].latency_us >= 100


@pytest.mark.parametrize("stage", C.STAGES)
def test_planner_predicts_the_measured_step_within_20_percent(result, stage):
    measured, predicted, compute = result[f"measured_{stage}"], result["predicted"][stage], result[f"compute_{stage}"]
    print(f"\nstage {stage}: compute {compute:.3f} s, on the link measured {measured:.3f} s, "
          f"predicted {predicted:.3f} s, ratio {predicted / measured:.3f}")
    assert measured > 1.2 * compute, "the link must matter for this check to mean anything"
    assert predicted == pytest.approx(measured, rel=0.20)
