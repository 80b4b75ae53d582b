"""Memory one learner's seat uses: the sizing behind workshop/README.md's "Sizing a room" table.

    PYTHONPATH=src python workshop/room_memory.py

Run it in the room's own environment, inside a job like a learner's (the dry run does:
``srun --cpus-per-task=2 --mem=4G ... python workshop/room_memory.py``): a CUDA build of torch
maps more libraries than the CPU build, even on a CPU seat, and only a run there measures it.

Two moments of a day, each measured:

1. **a notebook running**: right after ``start_cluster(world_size=4)``. This process stands in
   for the notebook's kernel (it imports torch and shardlab as the notebooks do; a Jupyter kernel
   adds its own few tens of MB); the sum is over itself and every process it started (the ranks
   and their controller).
2. **a notebook left open**: this process again once ``cluster.stop()`` has ended the ranks, with
   the course's modules imported (``shardlab.course``, ``shardlab.planner``): what each earlier
   notebook's kernel keeps until it is shut down (Kernel > Shut Down Kernel) or culled
   (``jupyter.sbatch`` culls kernels idle for 90 minutes).

RSS (psutil) counts pages shared between processes (torch's libraries) once per process, so its
sum is what a job's memory limit is likely to see at most; PSS splits shared pages between their
users; USS is what a process holds alone, what one more idle kernel adds. PSS and USS are printed
where the kernel reports them (Linux).
"""

import importlib

import psutil
import torch

import shardlab


def _sum(procs) -> dict:
    total = {"rss": 0, "pss": 0, "uss": 0}
    for p in procs:
        try:  # a process may exit between the listing and here (an engine starting up)
            info, command = p.memory_full_info(), " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for key in total:
            total[key] += getattr(info, key, 0)
        print(f"  pid {p.pid:>7}  {command[:70]:70}  RSS {info.rss / 1e6:7.1f} MB")
    return total


def _show(what: str, total: dict) -> None:
    extra = "".join(f", {k.upper()} {total[k] / 1e9:.2f} GB" for k in ("pss", "uss") if total[k])
    print(f"{what}: RSS {total['rss'] / 1e9:.2f} GB{extra}")


def main() -> None:
    build = f"torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})"
    print(f"{build}, {psutil.cpu_count()} CPU core(s) visible")
    me = psutil.Process()
    cluster = shardlab.start_cluster(world_size=4)
    try:
        procs = [me, *me.children(recursive=True)]
        running = _sum(procs)
        _show(f"1. a notebook running, {len(procs)} processes (this one + {len(procs) - 1} it started)", running)
    finally:
        cluster.stop()
    for module in ("shardlab.course", "shardlab.planner"):  # what the later notebooks' kernels import too
        importlib.import_module(module)

    idle = _sum([me])
    _show("2. a notebook left open (its kernel after cluster.stop())", idle)
    if idle["uss"]:
        print(f"each notebook left open adds about its USS, {idle['uss'] / 1e6:.0f} MB: 10 of them "
              f"{10 * idle['uss'] / 1e9:.1f} GB beside the running one")


if __name__ == "__main__":
    main()
