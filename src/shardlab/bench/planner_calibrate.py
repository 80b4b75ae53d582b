"""The planner on this machine: predict ShardLab's own step times on an emulated slow link.

Before trusting the planner at 4096 GPUs, check it where every number can be measured. One
run on 2 local ranks (:func:`measure`) measures, in the same processes and interleaved so
that the machine's load hits all of them alike:

* **the link:** all-gathers of three sizes under ``emulate_link``; :func:`link.fit_link` turns
  their times into the α and β the planner uses (it does not read the emulator's settings);
* **the compute:** a step of stage 0 and of stage 3 with no emulated link. Both compute the
  same FLOPs; they differ by their loopback collectives, which on the emulated link run inside
  the link's time. So the planner gets the faster of the two as the compute of either;
* **the truth:** the same steps on the emulated link.

:func:`predict` then gives the planner the fitted link and the measured compute, and nothing
else: the bytes, the order of the collectives and what overlaps come from the planner's own
replay (:mod:`shardlab.planner.step`). ``tests/test_planner_calibration.py`` and notebook 08 set the
prediction beside the measurement.
"""

from __future__ import annotations

from contextlib import nullcontext

from shardlab.instruments.link import Link, fit_link
from shardlab.instruments.measured import Formula
from shardlab.planner import GPU, GPUCluster, Plan, Transformer, step_time

SIZES = (2**16, 2**17, 2**18)  # float32 elements per rank: 0.25, 0.5, 1 MB
STAGES = (0, 3)


def _rank_main(opts: dict) -> dict:
    """On every rank, in interleaved rounds: all-gathers on the emulated link, and stages 0 and 3 without and with it."""
    import torch
    import torch.distributed as dist

    from shardlab import models
    from shardlab.bench.harness import timed_rounds
    from shardlab.engine import comm
    from shardlab.engine.api import parallelize
    from shardlab.instruments.link import emulate_link

    n = dist.get_world_size()
    link = dict(bandwidth_gbps=opts["bandwidth_gbps"], latency_us=opts["latency_us"])
    buffers = {size: (torch.ones(size), torch.empty(size * n)) for size in SIZES}
    cfg = models.SIZES[opts["model"]]
    runs = {}
    for stage in STAGES:
        torch.manual_seed(0)
        runs[stage] = parallelize(models.gpt(opts["model"]), stage=stage, optimizer_cls=torch.optim.AdamW, lr=1e-3)
    x, y = models.batch(cfg, opts["batch"], seed=1, rank=dist.get_rank(), world_size=n)

    def step(item, _i):
        what, arg = item
        if what == "gather":  # one all-gather of arg elements a rank on the emulated link
            shard, full = buffers[arg]
            with emulate_link(**link):
                comm.all_gather(full, shard)
            return
        model, optimizer = runs[what]
        with emulate_link(**link) if arg else nullcontext():
            models.lm_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    # Link, compute and slow steps interleaved in the same rounds: load hits them all alike.
    items = [("gather", size) for size in SIZES] + [(s, slow) for s in STAGES for slow in (False, True)]
    times, _ = timed_rounds(items, step, opts["warmup"], opts["steps"], comm.barrier)
    return dict(gathers={size * n * 4: times[("gather", size)] for size in SIZES},
                steps={f"{s}/{int(slow)}": times[(s, slow)] for s, slow in items if s != "gather"})


def measure(model: str = "small", bandwidth_gbps: float = 0.1, latency_us: float = 200.0, *, batch: int = 8,
            steps: int = 9, warmup: int = 1, world_size: int = 2, timeout: float = 300.0) -> dict:
    """Measure the link and the steps on ``world_size`` local ranks; see the module docstring.

    Every number is the best of ``steps`` rounds, each round's time being its slowest rank's:
    on a shared machine load only ever adds time, so the best round is the closest to what the
    code costs, for the inputs and for the truth alike. Returns the fitted :class:`Link` and per
    stage the step with no emulated link ("compute_0", "compute_3") and on it ("measured_0",
    "measured_3"), in seconds.
    """
    from shardlab.bench.harness import slowest
    from shardlab.launch import run_ranks

    opts = dict(model=model, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us, batch=batch, steps=steps,
                warmup=warmup)
    per_rank = run_ranks(_rank_main, world_size, opts, timeout=timeout)

    def best(key, table="steps"):
        return min(slowest([r[table][key] for r in per_rank]))

    sizes = sorted(per_rank[0]["gathers"])
    seconds = [best(size, "gathers") for size in sizes]
    out = dict(options=opts, world_size=world_size, link=fit_link("all_gather", sizes, seconds, world_size),
               gather_sizes=sizes, gather_s=seconds)
    for s in STAGES:
        out[f"compute_{s}"], out[f"measured_{s}"] = best(f"{s}/0"), best(f"{s}/1")
    return out


def transformer(size: str) -> Transformer:
    """The course GPT of :data:`shardlab.models.SIZES` as the planner's Transformer."""
    from shardlab import models

    cfg = models.SIZES[size]
    return Transformer(f"course {size}", cfg.n_layer, cfg.d, cfg.n_head, cfg.vocab, cfg.seq,
                          tied=cfg.tie_weights)


def predict(result: dict) -> dict:
    """The planner's step time for stages 0 and 3, from the fitted link and the measured compute."""
    link: Link = result["link"]
    n = result["world_size"]
    here = GPU("this CPU", 1.0, float("inf"), "peak unused: compute is measured")
    cluster = GPUCluster(here, n, n, link, link, 1)
    model = transformer(result["options"]["model"])
    out = {}
    for s in STAGES:
        plan = Plan(s, micro_batch=result["options"]["batch"], recipe="fp32-adam")
        compute = min(result[f"compute_{t}"] for t in STAGES)  # see the module docstring
        out[s] = Formula(step_time(model, cluster, plan, compute_s=compute).step_s, formula="planner.step_time")
    return out
