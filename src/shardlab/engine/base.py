"""What every ZeRO stage shares: units, gradient-ready hooks, the end of backward, no_sync.

A stage (see ``ddp.py``, ``zero1.py``, ``zero2.py``, ``zero3.py``) only decides four things:

* ``make_master(unit)``    which part of a unit the optimizer steps on this rank;
* ``reduce_grads(unit)``   how a unit's gradients are combined across ranks, once they are ready;
* ``finish_grads(...)``    what is kept when that communication completes;
* ``after_step(unit)``     how the updated weights reach the parameters again.

Everything else lives here, once: flattening the model into units, syncing rank 0's weights,
knowing when a unit's gradients are all computed, and waiting for the communication at the end
of backward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from shardlab.engine import comm, events
from shardlab.engine.flat import FlatUnit
from shardlab.engine.units import find_unit_modules, group_params


def on_output_grad(output, fn) -> None:
    """Call ``fn()`` when the gradient of (any tensor in) a module's output arrives in backward."""
    for t in tree_flatten(output)[0]:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(lambda grad: fn())


class Engine:
    """The machinery shared by stages 0-3. Subclasses supply the four methods named above."""

    stage: int
    #: Start each unit's reduction as soon as its gradients are all computed, overlapping the
    #: backward of the units before it (then its full gradients can be dropped). ZeRO-1 waits
    #: for the whole backward instead, holding every full gradient until then.
    reduce_as_ready = True
    #: Reductions allowed in flight at once. Waiting for the oldest one frees its full gradient
    #: buffer, so at most this many units' full gradients are alive during backward.
    max_reductions_in_flight = 2

    def __init__(self, model: nn.Module, *, units=None, param_dtype=None, reduce_dtype=None,
                 reshard_after_forward: bool = True, prefetch: bool = True):
        self.model = model
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.sync = True  # False inside no_sync(): keep gradients local, communicate later
        self.optimizer = lambda: None  # parallelize sets a weak reference to the optimizer it returns
        events.set_phase("init")
        groups = group_params(model, find_unit_modules(model, units))
        # mixed precision: params (and forward, backward) in param_dtype, masters in their own
        self.mixed = param_dtype not in (None, groups[0][2][0].dtype)
        self._check_same_model_on_every_rank(groups)
        self._broadcast_untrained_state()
        self.units: list[FlatUnit] = []
        for name, module, params in groups:
            unit = FlatUnit(name, params, rank=self.rank, world_size=self.world_size)
            comm.broadcast(unit.full, src=0, unit=name)  # every rank starts from rank 0's weights
            unit.module = module
            unit.master = nn.Parameter(self.make_master(unit))
            unit.cast(param_dtype if self.mixed else unit.master_dtype)
            self.units.append(unit)
        self.root = self.units[-1] if self.units[-1].module is model else None
        self.param_dtype = self.units[0].full.dtype  # what forward and backward compute in
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # Stage 0 keeps the averaged full gradients; in full precision they live in p.grad (views).
        self.grads_in_params = self.stage == 0 and self.reduce_dtype == self.param_dtype
        self._pending: list[tuple[FlatUnit, comm.Pending, torch.Tensor]] = []
        self._expect_all_grads()
        self._backward_started = False
        model.register_forward_pre_hook(self._on_root_forward, with_kwargs=True)
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._on_grad_ready(unit))
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self.pre_forward(u))
            unit.module.register_forward_hook(lambda m, args, out, u=unit: self.post_forward(u, out))

    # -- the four decisions of a stage ------------------------------------------------------
    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        raise NotImplementedError

    def reduce_grads(self, unit: FlatUnit) -> None:
        raise NotImplementedError

    def finish_grads(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def after_step(self, unit: FlatUnit) -> None:
        raise NotImplementedError

    # -- start: one model on every rank -----------------------------------------------------
    def _check_same_model_on_every_rank(self, groups) -> None:
        device = groups[0][2][0].device  # NCCL only moves tensors on the GPU
        mine = torch.tensor([len(groups), sum(p.numel() for _, _, ps in groups for p in ps)], device=device)
        everyone = torch.empty(2 * self.world_size, dtype=mine.dtype, device=device)
        comm.all_gather(everyone, mine)
        if not torch.equal(everyone.view(-1, 2), mine.expand(self.world_size, 2)):
            raise ValueError(
                "ranks hold different models (units, trainable elements per rank: "
                f"{everyone.view(-1, 2).tolist()}); build the same model on every rank")

    def _broadcast_untrained_state(self) -> None:
        """Frozen parameters and buffers are not sharded; every rank takes rank 0's copy."""
        with torch.no_grad():
            for p in self.model.parameters():
                if not p.requires_grad:
                    comm.broadcast(p.data)
            for b in self.model.buffers():
                comm.broadcast(b)

    # -- forward ----------------------------------------------------------------------------
    def _on_root_forward(self, module, args, kwargs):
        events.set_phase("forward")
        self._expect_all_grads()
        if self.mixed:  # cast floating-point inputs to the compute dtype
            cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def pre_forward(self, unit: FlatUnit) -> None:
        events.emit("forward", unit=unit.name)

    def post_forward(self, unit: FlatUnit, output) -> None:
        """Stages 0-2 have nothing to free; when traced, mark where the unit's backward starts."""
        events.emit("forward_done", unit=unit.name)
        if events.active() and torch.is_grad_enabled():
            on_output_grad(output, lambda: events.emit("backward", unit=unit.name))

    # -- backward ---------------------------------------------------------------------------
    def _on_grad_ready(self, unit: FlatUnit) -> None:
        """Called after each parameter's gradient is accumulated; a unit is done at zero."""
        if not self._backward_started:
            self._backward_started = True
            events.set_phase("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._grads_to_come[unit] -= 1
        if self._grads_to_come[unit] == 0:
            events.emit("backward_done", unit=unit.name)
            self.post_backward(unit)

    def post_backward(self, unit: FlatUnit) -> None:
        """A unit's gradients are all computed: start combining them across ranks (async)."""
        if self.sync and self.reduce_as_ready:
            self.reduce_grads(unit)
            self._finish_reductions(keep=self.max_reductions_in_flight)

    def reductions_in_flight(self) -> list[tuple[FlatUnit, list[torch.Tensor]]]:
        """Each pending reduction's unit and the gradient buffers it holds until it lands."""
        return [(unit, [grad, *pending.buffers]) for unit, pending, grad in self._pending]

    def _finish_reductions(self, keep: int = 0) -> None:
        """Wait for the oldest reductions until ``keep`` remain in flight, and finish them."""
        while len(self._pending) > keep:
            unit, pending, grad = self._pending.pop(0)
            pending.wait()
            self.finish_grads(unit, grad)

    def _end_of_backward(self) -> None:
        """Autograd is done: finish units that got no gradient, then wait for all reductions."""
        for unit in self.units:
            if self._grads_to_come[unit] > 0:  # unused this step: reduce zeros, like every rank
                self._grads_to_come[unit] = 0
                self.post_backward(unit)
        if self.sync and not self.reduce_as_ready:
            for unit in self.units:
                self.reduce_grads(unit)
        self._finish_reductions(keep=0)
        self._backward_started = False
        self._expect_all_grads()  # a second backward (retain_graph) reduces again

    def _expect_all_grads(self) -> None:
        """Arm the per-unit countdown: every (trainable) parameter's gradient is yet to come."""
        self._grads_to_come = {u: len(u.params) for u in self.units}

    def accumulate(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        """Give the optimizer ``grad``; add to an earlier one unless the params already did."""
        if unit.master.grad is None or self.grads_in_params:
            unit.master.grad = grad.to(unit.master.dtype)
        else:
            unit.master.grad += grad

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside keep gradients local (no communication)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # -- optimizer --------------------------------------------------------------------------
    def step(self) -> None:
        for unit in self.units:
            self.after_step(unit)

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.master.grad = None
            unit.set_param_grads(None)


class StageOptimizer(torch.optim.Optimizer):
    """The optimizer ``parallelize`` returns: ``optimizer_cls`` on this rank's masters.

    ``step()`` runs the wrapped optimizer on whatever the stage gave it (the whole model at
    stage 0, one shard per unit at stages 1-3), then lets the stage bring the new weights back.
    ``param_groups`` and ``state`` are the wrapped optimizer's, so LR schedulers just work.
    """

    def __init__(self, engine: Engine, optimizer_cls, **kwargs):
        self.engine = engine
        self.inner = optimizer_cls([u.master for u in engine.units], **kwargs)
        super().__init__([u.master for u in engine.units], self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("step(closure) is not supported: compute the loss, call backward(), then step()")
        events.set_phase("step")
        events.emit("step_start")
        self.inner.step()
        self.engine.step()
        events.emit("step_end")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
