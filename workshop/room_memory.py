"""Memory one learner's notebook uses right after ``start_cluster(world_size=4)``: the sizing
behind workshop/README.md's "Sizing a room" table.

    PYTHONPATH=src python workshop/room_memory.py

This process stands in for the notebook's kernel (it imports torch and shardlab as notebook 00
does; a Jupyter kernel adds its own few tens of MB). It starts the 4 ranks, then sums the
resident memory (RSS, psutil) of itself and of every process it started (the ranks and their
controller). RSS counts pages shared between processes (torch's libraries) once per process,
so the sum is what a job's memory limit is likely to see at most; PSS, which splits shared
pages between their users, is printed beside it where the kernel reports it (Linux).
"""

import psutil

import shardlab


def main() -> None:
    cluster = shardlab.start_cluster(world_size=4)
    try:
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        rss = pss = 0
        for p in procs:
            try:
                info = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += getattr(info, "pss", 0)
            print(f"  pid {p.pid:>7}  {' '.join(p.cmdline())[:70]:70}  RSS {info.rss / 1e6:7.1f} MB")
        print(f"{len(procs)} processes (this one + {len(procs) - 1} it started): RSS sum {rss / 1e9:.2f} GB"
              + (f", PSS sum {pss / 1e9:.2f} GB" if pss else ""))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
