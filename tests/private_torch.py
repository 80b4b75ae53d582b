"""The private torch names the fake-GPU tests lean on, and which of them this torch lacks.

``fake_gpu_worker.py`` registers torch's Python stand-in accelerator with
``torch.utils.backend_registration``'s private helpers, and both it and ``test_fake_cuda.py``
make fake tensors and a fake process group from torch's private modules. None of it is public
API (tested on torch 2.13): when an upgrade renames one, ``test_torch_internals.py`` fails naming
it, ``test_fake_cuda.py`` skips saying why, and the worker says so instead of a traceback.
A plain module with no side effects (importing the worker would register the device).
"""

from __future__ import annotations

import importlib

import torch

FAKE_GPU = {
    "torch.utils.backend_registration": ("_setup_privateuseone_for_python_backend", "_DummyBackendModule",
                                         "_DummyPrivateUse1Hook"),
    "torch._subclasses.fake_tensor": ("FakeTensorMode", "is_fake", "unset_fake_temporarily"),
    "torch.testing._internal.distributed.fake_pg": ("FakeStore",),
    "torch.utils._pytree": ("tree_leaves",),
}


def lacking(names: dict[str, tuple[str, ...]] = FAKE_GPU) -> list[str]:
    """The ``module.name`` of each of ``names`` this torch does not have."""
    out = []
    for module, attrs in names.items():
        try:
            found = importlib.import_module(module)
        except ImportError:
            out += [f"{module}.{a}" for a in attrs]
            continue
        out += [f"{module}.{a}" for a in attrs if not hasattr(found, a)]
    return out


def why_not(names: dict[str, tuple[str, ...]] = FAKE_GPU) -> str | None:
    """A sentence naming this torch's version and what it lacks; None when it has everything."""
    gone = lacking(names)
    return f"torch {torch.__version__} lacks {', '.join(gone)}; test_fake_cuda needs them (tested on 2.13)" if gone else None
