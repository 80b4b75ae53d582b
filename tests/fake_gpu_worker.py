"""A whole training step on fake accelerator tensors, in its own process: ``python fake_gpu_worker.py``.

Why a stand-in device and not ``"cuda"``: on a CPU-only torch the autograd engine cannot run a
backward over ``device="cuda"`` fake tensors. Recording a CUDA tensor in the graph asks for a
CUDA device guard, which a CPU build does not have ("PyTorch is not linked with support for
cuda devices", and the process aborts); and the engine asks ``at::getAccelerator()``, compiled
in from the CUDA hooks, for the streams it orders gradients on ("Cannot access accelerator
device when none is available"). Neither can be registered from Python for CUDA. Torch's own
Python accelerator backend can: ``_setup_privateuseone_for_python_backend`` renames PrivateUse1
to ``fakegpu`` and registers its device guard and hooks, and the engine then treats
``fakegpu`` tensors exactly as it treats CUDA ones (an accelerator device, its streams, its
device thread). The registration is for the whole process and cannot be undone, hence a
process of its own, not pytest's.

It prints one JSON record per (world size, stage, bf16): every collective's tensors' devices,
the host syncs in start-up and in the step, and this rank's bytes of weights, gradients and
optimizer state after the step. ``test_fake_cuda.py`` asserts on them.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
from private_torch import why_not

if why_not():  # before touching any of them: one clear line instead of a traceback
    sys.exit(f"fake_gpu_worker: {why_not()}")

from torch.utils import backend_registration  # noqa: E402

DEVICE = "fakegpu"


class _NotAvailable(backend_registration._DummyBackendModule):
    """No real device behind it: FakeTensorMode keeps its CPU-build behaviour (never materialises)."""

    def is_available(self) -> bool:
        return False


class _NoDeviceHooks(backend_registration._DummyPrivateUse1Hook):
    def is_available(self) -> bool:
        return False


backend_registration._setup_privateuseone_for_python_backend(DEVICE, backend_module=_NotAvailable(),
                                                            hook=_NoDeviceHooks())

import torch.distributed as dist  # noqa: E402  (after the device exists)
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import shardlab  # noqa: E402
from shardlab import models  # noqa: E402
from shardlab.engine import comm  # noqa: E402

SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "equal", "nonzero"}


SYNCS_SEEN: list[tuple[str, str]] = []
NEUTRAL = {"equal": lambda t: True, "__bool__": lambda t: True, "tolist": lambda t: [False] * t.numel()}


def _count(name, original):
    """``original`` (a read of a tensor's value), counted when it reads a fake device tensor.

    Patched on ``torch.Tensor``, not caught in a TorchFunctionMode: modes are per thread, and
    the autograd engine runs backward (the engine's hooks, its end-of-backward callback) on the
    device's own thread. Fake tensors have no values, so the read answers neutrally.
    """

    def read(t, *args, **kwargs):
        if isinstance(t, torch.Tensor) and is_fake(t) and t.device.type == DEVICE:
            caller = next((f.filename.rsplit("/", 1)[-1] for f in reversed(traceback.extract_stack()[:-1])
                           if "/shardlab/" in f.filename), "?")
            SYNCS_SEEN.append((caller, name))
            return NEUTRAL.get(name, lambda t: 0)(t)
        return original(t, *args, **kwargs)

    return read


for _name in SYNCS - {"equal", "nonzero"}:
    setattr(torch.Tensor, _name, _count(_name, getattr(torch.Tensor, _name)))
torch.equal = _count("equal", torch.equal)
torch.nonzero = _count("nonzero", torch.nonzero)
torch.Tensor.nonzero = _count("nonzero", torch.Tensor.nonzero)


_tensor = torch.tensor


def _tensor_on_fake_device(data, *args, device=None, **kwargs):
    """``torch.tensor(host data, device=fakegpu)``: only its shape and dtype exist on a fake device
    (FakeTensorMode's own rule for this is per thread too, and backward runs on the device's)."""
    if device is None or torch.device(device).type != DEVICE:
        return _tensor(data, *args, device=device, **kwargs)
    with unset_fake_temporarily():
        host = _tensor(data, *args, **kwargs)
    return torch.empty(host.shape, dtype=host.dtype, device=device)


torch.tensor = _tensor_on_fake_device


class HostRealDeviceFake(TorchFunctionMode):
    """Device tensors fake, host bookkeeping real (Python ints into a CPU tensor and back)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if not any(isinstance(a, torch.Tensor) and is_fake(a) for a in leaves) \
                and DEVICE not in str(kwargs.get("device", "")):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class NoInit(TorchFunctionMode):
    """Random init needs a device generator; fake tensors have no values to initialise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.normal_, torch.Tensor.uniform_) or getattr(func, "__module__", "") == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _nbytes(tensors) -> int:
    """Bytes of distinct storages (views of one flat buffer count once), from shapes and dtypes."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t.untyped_storage()) in seen:
            continue
        seen.add(id(t.untyped_storage()))
        total += t.untyped_storage().nbytes()
    return total


def trace(world: int, stage: int, bf16: bool) -> dict:
    seen: list = []
    issue = comm._issue

    def record(kind, fn, out, inp, **kw):
        tensors = [t for t in (out, inp) if isinstance(t, torch.Tensor)]
        seen.append((kind, [str(t.device) for t in tensors], [str(t.dtype) for t in tensors]))
        return issue(kind, fn, out, inp, **kw)

    comm._issue = record
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with FakeTensorMode():
            with torch.device(DEVICE), NoInit():
                model = models.gpt("tiny")
            params = sum(p.numel() for p in model.parameters())
            mode = HostRealDeviceFake()
            SYNCS_SEEN.clear()
            with mode:
                precision = shardlab.MixedPrecision() if bf16 else None
                model, opt = shardlab.parallelize(model, stage=stage, mixed_precision=precision)
            startup, startup_calls = list(SYNCS_SEEN), len(seen)
            SYNCS_SEEN.clear()
            cfg = models.SIZES["tiny"]
            x = torch.randint(0, cfg.vocab, (2, cfg.seq), device=DEVICE)
            y = torch.randint(0, cfg.vocab, (2, cfg.seq), device=DEVICE)
            with mode:
                loss = models.lm_loss(model(x), y)
                loss.backward()
                opt.step()
            engine = shardlab.engine_of(model)
            units = engine.units
            state = [v for s in getattr(opt, "inner", opt).state.values() for v in s.values() if torch.is_tensor(v)]
            return dict(
                world=world, stage=stage, bf16=bf16, params=params, loss_device=str(loss.device),
                startup_syncs=startup, step_syncs=list(SYNCS_SEEN),
                startup_calls=seen[:startup_calls], step_calls=seen[startup_calls:],
                units=len(units), numel=[u.numel for u in units], padded=[u.padded_numel for u in units],
                weights=_nbytes(u.full for u in units) if not engine.shards_params else 0,
                master=_nbytes(u.master for u in units), master_dtype=str(units[0].master.dtype),
                grads=_nbytes(u.master.grad for u in units),
                pieces_here=sum(b > a for u in units for a, b in u.ranges(u.master)),  # params with elements here
                moments=_nbytes(t for t in state if t.dim() > 0), step_counters=sum(t.dim() == 0 for t in state),
                state_devices=sorted({str(t.device) for t in state if t.dim() > 0}),
                grad_devices=sorted({str(u.master.grad.device) for u in units if u.master.grad is not None}),
            )
    finally:
        dist.destroy_process_group()
        comm._issue = issue


if __name__ == "__main__":
    torch.cuda.get_device_capability = lambda *a: (9, 0)  # c10d asks (an H100's)
    configs = json.loads(sys.argv[1])  # [[world, stage, bf16], ...]
    json.dump([trace(*c) for c in configs], sys.stdout)
