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
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from shardlab.engine import comm


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A second tensor over ``t``'s memory with its own version counter.

    Collectives write through the alias, so refilling a freed unit does not look to autograd
    like an in-place change of the parameters it saved for backward.
    """
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape)


class FlatUnit:
    """One unit: its trainable parameters flattened into ``full``, padded, split into shards."""

    def __init__(self, name: str, params: list[nn.Parameter], *, rank: int, world_size: int):
        self.name = name
        self.params = params
        self.rank, self.world_size = rank, world_size
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)  # real elements
        self.padded_numel = math.ceil(self.numel / world_size) * world_size
        self.shard_numel = self.padded_numel // world_size
        self.master_dtype = params[0].dtype
        self.full = torch.zeros(self.padded_numel, dtype=self.master_dtype, device=params[0].device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in params], out=self.full[: self.numel])
        self._point_params_at(self.full)
        self.master: nn.Parameter | None = None  # what the optimizer steps: set by the stage
        self.gathering: comm.Pending | None = None  # an all-gather in flight (prefetch)

    # -- layout ---------------------------------------------------------------------------
    def _point_params_at(self, full: torch.Tensor) -> None:
        self.full = full
        self._comm_full = _alias(full)
        for p, view in zip(self.params, self.views(full)):
            p.data = view

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors shaped like the unit's parameters (padding dropped)."""
        return [v.view(s) for v, s in zip(flat[: self.numel].split(self.numels), self.shapes)]

    def my_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a padded flat buffer (a view, not a copy)."""
        return flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    def cast(self, dtype: torch.dtype) -> None:
        """Keep the full parameters in ``dtype`` (mixed precision); the master keeps its own."""
        if dtype != self.full.dtype:
            self._point_params_at(self.full.to(dtype))

    # -- gather and free (stage 3) ----------------------------------------------------------
    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def gather(self, *, async_op: bool = False) -> None:
        """Borrow the other ranks' shards: all-gather the master shard into ``full``.

        With ``async_op`` (prefetch) this only starts the gather; the next plain ``gather()``
        waits for it.
        """
        if not self.is_gathered and self.gathering is None:
            self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
            shard = self.master.detach().to(self.full.dtype)
            self.gathering = comm.all_gather(self._comm_full, shard, unit=self.name, async_op=True)
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None

    def free(self) -> None:
        """Give the borrowed shards back: release ``full``'s memory, keep only the master shard."""
        self.wait_gather()
        self.full.untyped_storage().resize_(0)

    # -- gradients --------------------------------------------------------------------------
    def pack_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """The unit's gradients as one padded flat buffer (zeros where a parameter got none)."""
        flat = torch.empty(self.padded_numel, dtype=dtype, device=self.full.device)
        flat[self.numel :].zero_()  # the padding
        for g, p in zip(self.views(flat), self.params):
            if p.grad is None:
                g.zero_()
            else:
                g.copy_(p.grad)
        return flat

    def set_param_grads(self, flat: torch.Tensor | None) -> None:
        """Point each ``p.grad`` at its view of ``flat`` (or drop them when ``flat`` is None)."""
        if flat is None or flat.dtype != self.full.dtype:
            for p in self.params:
                p.grad = None
            return
        for p, g in zip(self.params, self.views(flat)):
            p.grad = g

    # -- whole-tensor access (state dicts) --------------------------------------------------
    def gather_master(self) -> torch.Tensor:
        """The full master (fp32) flat buffer, assembled from every rank's shard."""
        if self.master.numel() == self.padded_numel:  # stage 0: every rank holds it all
            return self.master.detach().clone()
        full = torch.empty(self.padded_numel, dtype=self.master.dtype, device=self.master.device)
        comm.all_gather(full, self.master.detach(), unit=self.name)
        return full

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite the unit with full tensors (same order as ``params``); keep the layout."""
        full = torch.zeros(self.padded_numel, dtype=self.master.dtype, device=self.master.device)
        torch.cat([t.reshape(-1).to(full) for t in tensors], out=full[: self.numel])
        with torch.no_grad():
            source = full if self.master.numel() == self.padded_numel else self.my_shard(full)
            self.master.copy_(source)
            if self.is_gathered:
                self._comm_full.copy_(full)
