"""``symptoms.on_first``: k ranks alone, the rest wait, and the full group comes back as it was.

The rebuilt group must keep the cluster's collective timeout (it once reset it to 60 s), and the
waiting ranks must outlast a ``fn`` longer than that timeout (they once blocked in a rendezvous
bounded by it).
"""

import datetime
import time

import torch
import torch.distributed as dist
from support import slowdown

from shardlab.course import symptoms
from shardlab.launch import run_ranks


def _world_and_sleep(seconds):
    time.sleep(seconds)
    return dist.get_world_size()


def _twice(group_s, sleep_s):
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=group_s))  # as the cluster does
    got = symptoms.on_first(2, _world_and_sleep, sleep_s)
    again = symptoms.on_first(1, _world_and_sleep, 0.0)
    total = torch.ones(1)
    dist.all_reduce(total)
    return got, again, dist.get_world_size(), symptoms._group_timeout().total_seconds(), total.item()


def test_on_first_keeps_the_cluster_timeout_and_the_others_outwait_a_long_fn():
    group_s = slowdown(3)
    out = run_ranks(_twice, 3, group_s, group_s + 2, timeout=slowdown(90))
    assert [o[0] for o in out] == [2, 2, None] and [o[1] for o in out] == [1, None, None]
    assert all(o[2] == 3 and o[4] == 3.0 for o in out)  # back in a group of 3 that reduces
    assert all(abs(o[3] - group_s) < 1e-6 for o in out)  # the cluster's timeout, not a default
