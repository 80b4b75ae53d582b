"""``symptoms.peak`` samples the moment after the loss, which ``track_memory`` has no event for.

Between the model's forward end and backward's first engine event the loss holds its saved
log-softmax (4·b·T·vocab bytes) on top of every activation: the loss sample must see exactly
that much more than the forward's end, and on ZeRO-2 at batch 8 it is the step's highest sample
(the peak once missed it, and notebook 09's rankings changed when it was added). The logits are
in no category; ``peak`` measures them apart.
"""

from support import slowdown

from shardlab.course import symptoms
from shardlab.launch import run_ranks
from shardlab.models import SIZES


def _peak_and_samples(plan):
    r = symptoms.peak(plan, samples=True)
    events = [s["event"] for s in r["samples"]]
    done = next(s for s in r["samples"] if s["event"] == "model_forward_done")
    return (events, r["peak_at"], r["at_loss"]["activations"] - done["bytes"]["activations"], r["logits"],
            r["total"], max(s["total"] for s in r["samples"] if s["event"] != "loss"))


def test_the_loss_sample_holds_the_log_softmax_and_is_zero2s_peak():
    cfg, batch = SIZES["small"], 8
    out = run_ranks(_peak_and_samples, 2, dict(stage=2, batch_size=batch), timeout=slowdown(120))
    softmax = 4 * batch * cfg.seq * cfg.vocab
    for events, peak_at, more, logits, total, without in out:
        assert events.count("loss") == 1
        assert events.index("model_forward_done") < events.index("loss") < events.index("backward")
        assert softmax <= more < 1.01 * softmax, (more, softmax)   # the log-softmax (and the int64 targets)
        assert logits == softmax                                      # fp32 logits, b·T·vocab
        assert peak_at["event"] == "loss" and total > without
