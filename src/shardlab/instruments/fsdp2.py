"""PyTorch's FSDP2 (``fully_shard``) on live ranks: its collectives per unit, and its DTensor shards.

``fully_shard(module)`` makes the module one unit: an ``FSDPParamGroup`` (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``) that all-gathers its parameters
in ``unshard()``, frees them in ``reshard()``, and reduce-scatters their gradients in
``post_backward()``. :func:`record_fully_shard` records every collective at the dispatcher
(:class:`~shardlab.instruments.collectives.Recorder`) and, for the length of the block, wraps
those methods of the class so that each collective is labelled with the unit that issued it,
and the stream gets the same ``forward`` / ``backward`` / ``free`` marks ShardLab's engine
emits. The wrappers call the originals unchanged: the schedule recorded is torch's own::

    with record_fully_shard() as seen:
        lm_loss(net(x), y).backward()
    seen.log[0]      # Call(kind='all_gather', numel=..., unit='root', phase='forward', ...)

Units are named by module path as ShardLab names them ("blocks.0"), the outermost one "root".

:func:`dtensor_shards` lists what a rank holds at rest: each parameter a ``DTensor`` placed
``Shard(0)``, whose local piece is this rank's rows of dim 0 (``torch.chunk``: at a world size
that does not divide dim 0 the last ranks get fewer rows, or none).
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager

import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor

from shardlab.engine import events
from shardlab.instruments.collectives import Recorder


def unit_name(group: FSDPParamGroup) -> str:
    """The unit's module path, as ShardLab names units ("" is the model itself: "root")."""
    return group._module_fqn or "root"


def _phase() -> str:
    """Inside autograd's backward or not (FSDP2 asks the same question, ``is_bw()``)."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _labelled(method, seen: Recorder):
    """``method`` of an FSDPParamGroup, whose collectives are filed under the group's unit."""

    @functools.wraps(method)
    def run(group, *args, **kwargs):
        before = seen.unit, seen.phase
        seen.unit, seen.phase = unit_name(group), _phase()
        try:
            return method(group, *args, **kwargs)
        finally:
            seen.unit, seen.phase = before

    return run


def _marked(method, seen: Recorder, what: str, *, once_in=None):
    """``method``, then a ``what`` mark for the group's unit (the unit's compute comes next)."""

    @functools.wraps(method)
    def run(group, *args, **kwargs):
        repeat = once_in is not None and group._training_state == once_in  # a no-op call
        out = method(group, *args, **kwargs)
        if not repeat:
            seen.mark(what, unit_name(group))
        return out

    return run


def _freeing(method, seen: Recorder):
    """``reshard``, with a ``free`` mark when it really gave the gathered weights back."""

    @functools.wraps(method)
    def run(group, *args, **kwargs):
        held = not group.is_sharded
        out = method(group, *args, **kwargs)
        if held and group.is_sharded:
            seen.mark(events.FREE, unit_name(group))
        return out

    return run


@contextmanager
def record_fully_shard():
    """Record FSDP2's collectives inside the block, each labelled with its unit (module doc)."""
    seen = Recorder()
    original = {name: getattr(FSDPParamGroup, name)
                for name in ("unshard", "post_backward", "reshard", "pre_forward", "pre_backward")}
    wrapped = {
        "unshard": _labelled(original["unshard"], seen),              # the all-gather (and prefetches)
        "post_backward": _labelled(original["post_backward"], seen),  # the reduce-scatter
        "reshard": _freeing(original["reshard"], seen),
        "pre_forward": _marked(original["pre_forward"], seen, events.FORWARD),
        "pre_backward": _marked(original["pre_backward"], seen, events.BACKWARD, once_in=TrainingState.PRE_BACKWARD),
    }
    try:
        for name, method in wrapped.items():
            setattr(FSDPParamGroup, name, method)
        with seen:
            yield seen
    finally:
        for name, method in original.items():
            setattr(FSDPParamGroup, name, method)


def dtensor_shards(model: torch.nn.Module) -> list[dict]:
    """This rank's view of each parameter: its type, placements, full shape and local shape."""
    rows = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        rows.append({"name": name, "type": type(p).__name__,
                     "placements": tuple(repr(pl) for pl in getattr(p, "placements", ())),
                     "shape": tuple(p.shape), "local": tuple(local.shape)})
    return rows


def dim0_padded_numel(shapes, world_size: int) -> int:
    """Elements FSDP2 all-gathers for a unit: each parameter's dim 0 padded to a multiple of N.

    (torch 2.13, ``_fsdp_common._get_dim0_padded_size``: ceil(dim0 / N) * N rows, per parameter.)
    """
    total = 0
    for shape in shapes:
        rows = math.ceil(shape[0] / world_size) * world_size if shape else world_size
        total += rows * math.prod(shape[1:])
    return total
