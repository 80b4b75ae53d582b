"""A unit's parameters as one flat buffer, padded so that it splits into N equal shards.

This is the data structure under every ZeRO stage (PyTorch FSDP calls it a FlatParameter)::

    unit params:   [ w1 (6) | b1 (2) | w2 (3) ]          11 elements
    padded flat:   [ w1 | b1 | w2 | 0 ]                  12 elements, 12 % N == 0 for N = 3 or 4
    rank r owns:   flat[r * 12/N : (r+1) * 12/N]          one contiguous shard

The module's own ``nn.Parameter`` objects are kept (the optimizer, hooks and the user's
references stay valid) but their ``.data`` is re-pointed at views into ``full``. So:

* one all-gather into ``full`` refreshes every parameter of the unit at once (no copies);
* freeing ``full``'s storage frees the whole unit, and re-allocating it brings it back;
* the padding (at most N-1 elements) never reaches a parameter; it is zero and stays zero.

A unit is in one of three states (FSDP2's ``ShardedState``): ``SHARDED`` (only the master shard
exists), ``GATHERING`` (an all-gather is in flight) or ``GATHERED`` (``full`` holds every element).

Gradients that never came are sent as ``-0.0``, so that the reduced gradient itself says
whether any rank used a parameter: ``missing_grads.py`` explains the convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn

from shardlab.engine import comm, events
from shardlab.engine.backward_count import BackwardCount
from shardlab.engine.missing_grads import mark_unused, send_missing, send_present


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A second tensor over ``t``'s memory with its own version counter.

    Collectives write through the alias, so refilling a freed unit does not look to autograd
    like an in-place change of the parameters it saved for backward.
    """
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape)


def _is_view_of(grad: torch.Tensor | None, piece: torch.Tensor | None) -> bool:
    """``grad`` is ``piece`` itself (same memory, same shape): the master's, not a new gradient."""
    return (grad is not None and piece is not None and grad.shape == piece.shape
            and grad.data_ptr() == piece.data_ptr())


class UnitState(Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass
class Reduction:
    """A unit's gradients on their way across ranks: ``grad`` holds the result once ``pending`` lands."""

    unit: FlatUnit
    pending: comm.Pending
    grad: torch.Tensor


def padded_numel(numel: int, world_size: int) -> int:
    """The smallest multiple of ``world_size`` that holds ``numel`` elements: the padding is < world_size."""
    return -(-numel // world_size) * world_size


class FlatUnit:
    """One unit: its trainable parameters flattened into ``full``, padded, split into shards."""

    def __init__(self, name: str, params: list[nn.Parameter], *, rank: int, world_size: int, index: int = 0,
                 module: nn.Module | None = None):
        self.name = name
        self.params = params
        self.module = module  # the submodule whose parameters these are (None: a plain list)
        self.rank, self.world_size = rank, world_size
        self.index = index  # place in the fixed unit order (registration order)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)  # real elements
        self._offsets = [0, *torch.tensor(self.numels).cumsum(0).tolist()]
        self.padded_numel = padded_numel(self.numel, world_size)
        self.shard_numel = self.padded_numel // world_size
        self.master_dtype = params[0].dtype
        self.full = torch.zeros(self.padded_numel, dtype=self.master_dtype, device=params[0].device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in params], out=self.full[: self.numel])
        self.state = UnitState.GATHERED
        self._comm_full: torch.Tensor  # ``full`` with its own version counter (``_alias``) ...
        self._full_views: list[torch.Tensor]  # ... and ``full`` cut per param: both set here
        self._point_params_at(self.full)
        self.master: nn.Parameter | None = None  # what the optimizer steps: set by the stage
        self.shard_views: list[torch.Tensor] | None = None  # stage 3: what params show at rest
        self.backward_count = BackwardCount.for_params(len(params))  # written by its own methods only
        self.unused: list[int] = []  # params that no rank gave a gradient in the last backward
        self.no_grad_here: set[int] = set()  # params this rank gave no gradient in the last packing
        self._gathering: comm.Pending | None = None

    # -- layout ---------------------------------------------------------------------------
    def _point_params_at(self, full: torch.Tensor) -> None:
        self.full = full
        self._comm_full = _alias(full)
        self._full_views = self.views(full)
        for p, view in zip(self.params, self._full_views):
            p.data = view

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors shaped like the unit's parameters (padding dropped)."""
        return [v.view(s) for v, s in zip(flat[: self.numel].split(self.numels), self.shapes)]

    def my_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a padded flat buffer (a view, not a copy)."""
        return flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    def ranges(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        """Where each parameter lies in ``flat``: the whole padded buffer, or this rank's shard
        (then each parameter's overlap with the shard, possibly empty)."""
        n = flat.numel()
        start = 0 if n == self.padded_numel else self.rank * self.shard_numel
        return [(min(max(a - start, 0), n), min(max(b - start, 0), n)) for a, b in zip(self._offsets, self._offsets[1:])]

    def pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's part of ``flat`` as a 1-D view (FSDP1's ``use_orig_params`` layout)."""
        return [flat[a:b] for a, b in self.ranges(flat)]

    def cast(self, dtype: torch.dtype) -> None:
        """Keep the full parameters in ``dtype`` (mixed precision); the master keeps its own."""
        if dtype != self.full.dtype:
            self._point_params_at(self.full.to(dtype))

    # -- gather and free (stage 3) ----------------------------------------------------------
    def gather(self, *, async_op: bool = False) -> None:
        """Borrow the other ranks' shards: all-gather the master shard into ``full``.

        With ``async_op`` (prefetch) this only starts the gather; the next plain ``gather()``
        waits for it.
        """
        if self.state is UnitState.SHARDED:
            self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
            shard = self.master.detach().to(self.full.dtype)
            self._gathering = comm.all_gather(self._comm_full, shard, unit=self.name, owner=self, async_op=True)
            self.state = UnitState.GATHERING
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        """Wait for the all-gather in flight, if any: the unit is then ``GATHERED``."""
        if self.state is UnitState.GATHERING:
            self._gathering.wait()
            self._gathering = None
            self.state = UnitState.GATHERED
            if self.shard_views is not None:
                self._grads_back_to_master_or_missing()

    def free(self) -> None:
        """Give the borrowed shards back: release ``full``'s memory, keep only the master shard."""
        if self.state is UnitState.SHARDED:
            return
        self.wait_gather()  # a gather still in flight must land before its buffer goes
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        if self.shard_views is not None:
            for p, view in zip(self.params, self.shard_views):
                p.data = view
            self._grads_to_pieces()
        events.emit(events.FREE, unit=self.name)

    # Stage 3's params change shape: full views while gathered, shard pieces at rest. Their
    # ``grad`` follows, by one invariant: whenever params show pieces, each ``p.grad`` shows its
    # piece of the master's gradient, except a param that holds a gradient of its own
    # (``no_sync``) or that no rank used. The two methods below keep it at each change.
    def _grads_to_pieces(self) -> None:
        """At a free: each param's ``grad`` becomes its piece of the master's gradient (a view).

        While the unit was gathered its params were full-shaped, so the shard-shaped grads were
        hidden (``p.grad = None``, the master kept them). Shown again here, a second gather in
        the same accumulation window (micro-batch 2's backward, after its forward freed the
        unit) does not read that ``None`` as the user's ``zero_grad`` and drop micro-batch 1.
        """
        grad = self.master.grad
        if grad is None:
            return
        for i, (p, piece) in enumerate(zip(self.params, self.pieces(grad))):
            if p.grad is None and i not in self.unused:
                p.grad = piece

    def _grads_back_to_master_or_missing(self) -> None:
        """At a gather: params become full views again, and the pieces they showed go back to
        the master. A piece the user dropped (their own optimizer's ``zero_grad``) is written
        ``-0.0`` in the master's gradient ("no gradient", ``missing_grads.py``), and when every
        piece was dropped the master's gradient is set to None.

        (Autograd is about to accumulate full-shaped gradients into ``p.grad``.)
        """
        grad = self.master.grad
        pieces = self.pieces(grad) if grad is not None else []
        dropped = 0
        for p, piece in zip(self.params, pieces):
            if p.grad is None and piece.numel():
                send_missing(piece)  # dropped (the user's zero_grad, or unused): "no gradient"
                dropped += 1
            elif _is_view_of(p.grad, piece):
                p.grad = None  # our shard view: the master keeps it
        if grad is not None and dropped == sum(piece.numel() > 0 for piece in pieces):
            self.master.grad = None  # every piece dropped: as if zero_grad(set_to_none=True)
        for p, view in zip(self.params, self._full_views):
            p.data = view

    @property
    def holds_full(self) -> bool:
        """The full buffer's memory is allocated: ``GATHERED``, or ``GATHERING`` (an all-gather
        is filling it). What the labs count for memory; ``state`` says which of the two."""
        return self.state is not UnitState.SHARDED

    @property
    def gathering(self) -> comm.Pending | None:
        """The all-gather in flight, if any (read-only)."""
        return self._gathering

    # -- gradients --------------------------------------------------------------------------
    def pack_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """The unit's gradients as one padded flat buffer; ``-0.0`` where a parameter got none."""
        flat = torch.empty(self.padded_numel, dtype=dtype, device=self.full.device)
        flat[self.numel :].zero_()  # the padding
        shown = self.master_grad_pieces()  # at rest a grad may show the master's: not new here
        self.no_grad_here = set()
        for i, (g, p, piece) in enumerate(zip(self.views(flat), self.params, shown)):
            if p.grad is None or _is_view_of(p.grad, piece):
                send_missing(g)
                self.no_grad_here.add(i)
            else:
                send_present(p.grad, g)
        return flat

    def reduce_scatter(self, grad: torch.Tensor) -> Reduction:
        """Start summing ``grad`` (a packed full buffer) over ranks; this rank keeps its shard."""
        shard = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
        return Reduction(self, comm.reduce_scatter(shard, grad, unit=self.name, owner=self, async_op=True), shard)

    def mark_unused(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Set ``unused`` from the reduced ``grad``; return what the optimizer should step
        (:func:`missing_grads.mark_unused`)."""
        ranges = self.ranges(grad) if grad is not None else []
        self.unused, grad = mark_unused(ranges, grad, self.no_grad_here)
        return grad

    def master_grad_pieces(self) -> list[torch.Tensor | None]:
        """Stage 3: each param's piece of the master's gradient (what its ``grad`` shows at rest)."""
        grad = self.master.grad if self.master is not None else None
        if self.shard_views is None or grad is None:
            return [None] * len(self.params)
        return self.pieces(grad)

    def set_param_grads(self, flat: torch.Tensor | None, skip=()) -> None:
        """Point each ``p.grad`` at its part of ``flat``: full views, or shard pieces at stage 3.

        A piece with no elements on this rank still gets its (empty) gradient, as FSDP2's empty
        local shards do: code that checks every parameter got a gradient must not trip on it.
        None for params in ``skip``, or for all when ``flat`` is None or not in the params' dtype.
        """
        parts = [None] * len(self.params)
        if flat is not None and flat.dtype == self.params[0].dtype:
            parts = self.pieces(flat) if self.shard_views is not None else self.views(flat)
        for i, (p, g) in enumerate(zip(self.params, parts)):
            p.grad = None if i in skip else g

    # -- whole-tensor access (state dicts) --------------------------------------------------
    def gather_full_master(self) -> torch.Tensor:
        """The full master (fp32) flat buffer, assembled from every rank's shard."""
        if self.master.numel() == self.padded_numel:  # stage 0: every rank holds it all
            return self.master.detach().clone()
        full = torch.empty(self.padded_numel, dtype=self.master.dtype, device=self.master.device)
        comm.all_gather(full, self.master.detach(), unit=self.name, owner=self)
        return full

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite the unit with full tensors (same order as ``params``); keep the layout."""
        full = torch.zeros(self.padded_numel, dtype=self.master.dtype, device=self.master.device)
        torch.cat([t.reshape(-1).to(full) for t in tensors], out=full[: self.numel])
        with torch.no_grad():
            source = full if self.master.numel() == self.padded_numel else self.my_shard(full)
            self.master.copy_(source)
            if self.state is UnitState.GATHERED:
                self._comm_full.copy_(full)
