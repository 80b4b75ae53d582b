"""The engine's GPU path without a GPU: fake device tensors (FakeTensorMode) and torch's fake group.

Under ``FakeTensorMode`` a CPU-only torch makes device tensors that have shapes, dtypes and
devices but no values, and the ``fake`` process group accepts collectives without a network.
Two checks, at stages 0-3 and bf16 at stage 3, world sizes 2 and 8:

* start-up and a forward pass on ``device="cuda"`` tensors, in this process;
* a whole training step (forward, backward with the engine's hooks: reduce-scatters or
  all-reduces, stage 3's re-gathers; the optimizer step) on torch's Python stand-in accelerator
  ``fakegpu``, in a process of its own (``fake_gpu_worker.py``), also at world size 3. A CPU
  build cannot run the autograd engine over ``"cuda"`` tensors: it needs a CUDA device guard
  and CUDA's streams, compiled in (the process aborts: "PyTorch is not linked with support for
  cuda devices"). The engine treats the stand-in as it treats CUDA: an accelerator device, with
  streams and a device thread. The engine has no ``"cuda"`` branch of its own to miss.

Both check that every collective's tensors are device tensors (NCCL carries only those: a CPU
tensor would fail there), count the host syncs (``.item()``, ``.tolist()``, ``.cpu()``,
``bool()``, ``torch.equal``...) against an allow-list that says why each is there, and the step
also sets rank 0's model-state bytes, read from the fake tensors, beside ``memory_math``.

What only a real GPU can show, said plainly: NCCL's bandwidth, how much communication overlaps
compute, the real peak memory (allocator, fragmentation, NCCL's own buffers), and the kernels.
``workshop/gpu_check.py --record`` measures those on the first GPU node.

Fake tensors have no values, so the few reads of a value answer neutrally here and are counted:
``torch.equal`` -> True, ``bool()`` -> True, ``.tolist()`` -> all False. They are the start-up
checks (same model on every rank; the backend keeps -0.0's sign), host syncs outside the step.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from private_torch import why_not
from support import slowdown

if why_not():  # test_torch_internals.py fails naming them; here, one skip that says why
    pytest.skip(why_not(), allow_module_level=True)

from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import shardlab  # noqa: E402
from shardlab import models  # noqa: E402
from shardlab.engine import comm  # noqa: E402
from shardlab.instruments import memory_math as mm  # noqa: E402

SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "equal", "nonzero"}
# Where a start-up sync is expected, and why (file of the engine that reads a value).
STARTUP_ALLOWED = {
    ("units.py", "equal"): "check_same_model_on_every_rank: every rank built the same units",
    ("missing_grads.py", "__bool__"): "check_backend_keeps_sign: the backend keeps -0.0's sign bit",
}
# Syncs allowed inside the step: none. missing_grads.py reads the reduced gradient (.tolist())
# only for a unit where this rank gave some param no gradient; a dense step has none.
STEP_ALLOWED: dict = {}


def _getitem(t, index):
    """Indexing through aten ops: the Python binding of ``t[i]`` asks for a CUDA device guard."""
    dim = 0
    for i in index if isinstance(index, tuple) else (index,):
        if isinstance(i, int):
            t = torch.ops.aten.select.int(t, dim, i)
        elif isinstance(i, slice):
            t = torch.ops.aten.slice.Tensor(t, dim, i.start, i.stop, i.step or 1)
            dim += 1
        elif isinstance(i, torch.Tensor) and i.dtype != torch.bool:
            t = torch.ops.aten.index.Tensor(t, [None] * dim + [i])
            dim += i.dim()
        else:
            raise NotImplementedError(f"fake-CUDA indexing with {i!r}")
    return t


class FakeCuda(TorchFunctionMode):
    """CUDA tensors fake, host bookkeeping real; every read of a CUDA value counted as a sync."""

    def __init__(self):
        super().__init__()
        self.syncs: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if not any(isinstance(a, torch.Tensor) and is_fake(a) for a in leaves) \
                and "cuda" not in str(kwargs.get("device", "")):
            with unset_fake_temporarily():  # Python ints into a CPU tensor and back: real values
                return func(*args, **kwargs)
        if func is torch.Tensor.copy_:
            return torch.ops.aten.copy_.default(args[0], args[1])
        if func is torch.Tensor.__getitem__:
            return _getitem(args[0], args[1])
        if func is torch.Tensor.__setitem__:
            view = _getitem(args[0], args[1])
            if isinstance(args[2], torch.Tensor):
                torch.ops.aten.copy_.default(view, args[2])
            else:
                torch.ops.aten.fill_.Scalar(view, args[2])
            return None
        name = getattr(func, "__name__", "")
        if name in SYNCS and isinstance(args[0], torch.Tensor) and args[0].device.type == "cuda":
            import traceback

            caller = next((f.filename.rsplit("/", 1)[-1] for f in reversed(traceback.extract_stack()[:-1])
                           if "/shardlab/" in f.filename), "?")
            self.syncs.append((caller, name))
            return {"equal": True, "__bool__": True, "tolist": [False] * args[0].numel()}.get(name, 0)
        return func(*args, **kwargs)


class NoInit(TorchFunctionMode):
    """Random init needs a CUDA generator; fake tensors have no values to initialise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.normal_, torch.Tensor.uniform_) or getattr(func, "__module__", "") == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_group(request, monkeypatch):
    world = request.param
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # c10d asks (an H100's)
    seen = []
    issue = comm._issue

    def record(kind, fn, out, inp, **kw):
        seen.append((kind, [t for t in (out, inp) if isinstance(t, torch.Tensor)]))
        return issue(kind, fn, out, inp, **kw)

    monkeypatch.setattr(comm, "_issue", record)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield world, seen
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fake_group", [2, 8], indirect=True)
@pytest.mark.parametrize("stage, bf16", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_a_step_on_fake_cuda_sends_only_cuda_tensors_and_syncs_only_where_allowed(fake_group, stage, bf16):
    world, seen = fake_group
    with FakeTensorMode():
        with torch.device("cuda"), NoInit():
            model = models.gpt("tiny")
        assert next(model.parameters()).device.type == "cuda"
        mode = FakeCuda()
        with mode:
            precision = shardlab.MixedPrecision() if bf16 else None
            model, _ = shardlab.parallelize(model, stage=stage, mixed_precision=precision)
        startup = list(mode.syncs)
        mode.syncs.clear()
        started = len(seen)
        x = torch.randint(0, models.SIZES["tiny"].vocab, (2, 16), device="cuda")
        with mode, torch.no_grad():
            logits = model(x)
        assert logits.device.type == "cuda" and logits.shape[:2] == (2, 16)
    for kind, tensors in seen:
        assert tensors and all(t.device.type == "cuda" for t in tensors), f"{kind} got {[t.device for t in tensors]}"
    assert {kind for kind, _ in seen[:started]} >= {"all_gather"}  # the start-up checks gather
    forward = [kind for kind, _ in seen[started:]]
    assert forward.count("all_gather") == (len(model._shardlab.units) if stage == 3 else 0)
    unexpected = [s for s in startup if s not in STARTUP_ALLOWED]
    assert not unexpected, f"start-up host syncs nobody allowed: {unexpected}"
    assert set(startup) == set(STARTUP_ALLOWED), f"an allowed start-up sync is gone: tighten STARTUP_ALLOWED ({startup})"
    assert mode.syncs == [] and not STEP_ALLOWED, f"host syncs in the forward: {mode.syncs}"


# -- the whole step: forward, backward with the engine's hooks, optimizer step ----------------
# In a process of its own (fake_gpu_worker.py says why it runs on torch's Python stand-in device
# there, and not on "cuda"), every configuration in one run: one torch import for all of them.
STEP_CONFIGS = [(w, s, bf16) for w in (2, 8) for s, bf16 in ((0, False), (1, False), (2, False), (3, False), (3, True))]
STEP_CONFIGS += [(3, 3, False), (3, 3, True)]  # a world size that doesn't divide: padding in every unit


@functools.cache
def _run_worker() -> subprocess.CompletedProcess:
    """Once per session, even when it fails (a failing module fixture would run again per test).

    A timeout is a failure like any other: ``functools.cache`` does not keep a raised exception,
    so it becomes a failed result (exit code None) carrying what the worker wrote before it was
    killed, and the other tests read that instead of waiting out the timeout again each.
    """
    worker = Path(__file__).with_name("fake_gpu_worker.py")
    src = str(Path(shardlab.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    args, limit = [sys.executable, str(worker), json.dumps(STEP_CONFIGS)], slowdown(120)
    try:
        return subprocess.run(args, capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired as e:  # its output is bytes, whatever text=True says
        said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(args, None, "", f"{said}\n(killed after {limit:.0f} s: timed out)")


@pytest.fixture
def traced_steps():
    done = _run_worker()
    assert done.returncode == 0, f"the fake-GPU step worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return {(r["world"], r["stage"], r["bf16"]): r for r in json.loads(done.stdout)}


@pytest.mark.parametrize("world, stage, bf16", STEP_CONFIGS)
def test_a_whole_step_on_a_fake_gpu_sends_only_device_tensors_and_reads_nothing_on_the_host(traced_steps, world, stage, bf16):
    """Backward's reduce-scatters (all-reduces at stage 0), stage 3's re-gathers and the step's
    gathers all carry device tensors; the step makes no host sync (missing_grads.py reads the
    reduced gradient only for a unit where this rank gave some param no gradient: none here)."""
    r = traced_steps[(world, stage, bf16)]
    assert r["loss_device"].startswith("fakegpu")
    for kind, devices, _ in r["startup_calls"] + r["step_calls"]:
        assert devices and all(d.startswith("fakegpu") for d in devices), f"{kind} got tensors on {devices}"
    kinds = [kind for kind, _, _ in r["step_calls"]]
    units = r["units"]
    if stage == 0:
        assert kinds == ["all_reduce"] * units  # one bucket per unit
    else:
        assert kinds.count("reduce_scatter") == units and "all_reduce" not in kinds
        gathers = kinds.count("all_gather")
        # stages 1-2: the updated shards, once per unit; stage 3: the forward's gathers and backward's re-gathers
        assert gathers == units if stage < 3 else gathers > units
    if bf16:  # weights gathered in bf16, gradients reduced in fp32 (MixedPrecision's defaults)
        assert {dt for kind, _, dts in r["step_calls"] if kind == "all_gather" for dt in dts} == {"torch.bfloat16"}
        assert {dt for kind, _, dts in r["step_calls"] if kind == "reduce_scatter" for dt in dts} == {"torch.float32"}
    assert set(map(tuple, r["startup_syncs"])) == set(STARTUP_ALLOWED), f"start-up syncs changed: {r['startup_syncs']}"
    unexpected = [s for s in r["step_syncs"] if tuple(s) not in STEP_ALLOWED]
    assert not unexpected, f"host syncs in the step nobody allowed: {unexpected}"
    assert r["grad_devices"] == r["state_devices"] == ["fakegpu:0"]


@pytest.mark.parametrize("world, stage, bf16", STEP_CONFIGS)
def test_model_states_on_fake_tensors_equal_the_formula(traced_steps, world, stage, bf16):
    """Rank 0's bytes after the step, from the fake tensors' shapes and dtypes, against
    ``memory_math.model_state_breakdown`` on padded Ψ (as ``test_memory_measured`` does on live
    ranks). fp32: the fp32-adam recipe (4 + 4 + 8). bf16: the fp32 master and both moments are
    the paper's K = 12 (mixed-adam), the gradient shard is fp32 (reduced in fp32), and no bf16
    weight is kept at rest (stage 3 frees every gathered unit)."""
    r = traced_steps[(world, stage, bf16)]
    psi = sum(r["padded"])
    assert 0 <= psi - r["params"] < len(r["padded"]) * world  # at most N-1 elements of padding per unit
    fp32 = mm.model_state_breakdown(psi, world, "fp32-adam")[mm.stage_name(stage)]
    # AdamW's moments are per parameter piece, so they hold no padding; rank 0 holds none either
    # (padding is on the last ranks), so its moments are the formula's 8Ψ (stage 0) or 8Ψ/N exactly.
    assert all(p // world <= n for n, p in zip(r["numel"], r["padded"]))
    assert r["moments"] == fp32["optimizer"]
    assert r["grads"] == (fp32["grads"] / world if stage == 1 else fp32["grads"])  # ZeRO-1 keeps a shard for the step
    assert r["step_counters"] == r["pieces_here"]  # AdamW's one 0-dim step per parameter piece stepped here
    if bf16:
        mixed = mm.model_state_breakdown(psi, world, "mixed-adam")[mm.stage_name(stage)]
        assert r["master_dtype"] == "torch.float32" and r["weights"] == 0
        assert r["master"] + r["moments"] == mixed["optimizer"]
    else:
        assert max(r["weights"], r["master"]) == fp32["params"]  # stages 0-2: the master views the weights
