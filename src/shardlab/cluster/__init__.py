"""Ranks inside a notebook: one persistent ipyparallel engine per rank, joined in one process group.

::

    cluster = shardlab.start_cluster(world_size=4)      # ~10 s once, on a 2-core laptop
    cluster.run(fn, *args)                              # fn(*args) on every rank -> [result per rank]

    %%ranks                                             # this cell runs on every rank,
    x = torch.arange(4.) + rank                         # output labelled [rank r]
    x

    cluster.pull("x")[2]                                # what rank 2 holds now
    cluster.stop()                                      # or: with shardlab.start_cluster(4) as cluster:

Why persistent engines rather than ``mp.spawn``: spawn re-imports torch in every child on every
run (~15 s for 4 ranks on 2 cores) and cannot pickle functions defined in a notebook. Engines pay
the start once; after that a run costs ~0.02 s, functions travel with ipyparallel's pickling, and
variables stay on each rank between cells, which is what lets a learner look at rank 2's shard.

The runtime never hangs and never leaves processes behind:

* the notebook's kernel hosts the rendezvous store on a port the OS picks (no port races);
* every process group has a timeout, so a collective that some rank never joins raises
  :class:`CollectiveTimeout` on the waiting rank instead of hanging;
* a rank that raises drops its process group at once, so ranks blocked in a collective with it
  fail within milliseconds ("a peer failed") instead of waiting for the timeout; the group is
  rebuilt, cheaply and automatically, before the next run; variables on the ranks are kept;
* a rank that does not answer at all (an endless loop) is interrupted, and if that fails the
  engines are killed and restarted on the next run;
* engines and the controller watch the kernel: if it dies, even by SIGKILL, they kill
  themselves within a second; ``stop()``, the context manager and ``atexit`` stop them otherwise.

The pieces, one file each:

* ``core.py``      the :class:`Cluster`: start, run, stop, restart; :func:`start_cluster`, :func:`current`
* ``engines.py``   the ranks' processes and process group, and their one health state
* ``runs.py``      one run: send to every rank, wait with a deadline, interrupt, notice dead ranks
* ``on_rank.py``   what runs inside each rank: join the group, run a function or a cell, pull
* ``shipping.py``  sending notebook-defined functions and classes (and what they use) to the ranks
* ``errors.py``    :class:`ClusterError` and its timeouts, and how the ranks' failures are explained
* ``processes.py`` the engine and controller processes: orphan guard, finding and killing them
* ``magic.py``     the ``%%ranks`` cell magic
"""

from shardlab.cluster.core import RANKS_PER_CORE, Cluster, current, start_cluster
from shardlab.cluster.errors import ClusterError, CollectiveTimeout, RankTimeout

__all__ = [
    "RANKS_PER_CORE",
    "Cluster",
    "ClusterError",
    "CollectiveTimeout",
    "RankTimeout",
    "current",
    "start_cluster",
]
