"""``symptoms``' helpers refuse inputs they would otherwise run wrongly, before building anything.

``link_times`` times every plan on one list of batches, so plans with different batch sizes
would silently all run at the first one's. ``accumulate`` with no micro-batch has nothing to hold.
No ranks: both checks come before the first collective.
"""

import pytest

from shardlab.course import symptoms


def test_link_times_refuses_plans_with_different_batch_sizes():
    with pytest.raises(ValueError, match=r"one batch: got batch sizes \{'eight': 8, 'sixteen': 16\}"):
        symptoms.link_times({"eight": dict(stage=2), "sixteen": dict(stage=3, batch_size=16)})


def test_accumulate_needs_a_micro_batch():
    with pytest.raises(ValueError, match="at least one micro-batch, got micro_batches=0"):
        symptoms.accumulate(dict(stage=2), micro_batches=0)
