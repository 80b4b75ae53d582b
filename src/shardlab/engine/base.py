"""What every ZeRO stage shares: units, gradient-ready hooks, the reductions' order, no_sync.

The stage contract. Each stage file defines exactly the methods listed for it here, and so do
stage 3's two helper parts (``tests/test_stage_contract.py`` reads this table, so it cannot
drift); everything else lives in this file, once::

    ddp.py           make_master, reduce_grads, keep_grads, after_step
    zero1.py         make_master, reduce_grads, after_step
    zero2.py         (none: one class attribute)
    zero3.py         __init__, make_master, reduce_grads, after_step, pre_forward, post_forward,
                     post_backward, root_pre_forward, root_post_forward, root_post_backward;
                     its own: pre_backward, prefetch_next, free_after_forward
    lockstep.py      UnitWalk: __init__, new_forward, forward_to, backward_to, finish,
                     walked_past, _walk_to, _enter
    graph_window.py  GraphWindow: __init__, keeps_units_gathered, backward_spans_forwards,
                     forward_started, forward_ended, backward_ended, count_accumulators

* ``make_master(unit)``: what the optimizer steps on this rank, the *master* (the whole flat
  buffer at stage 0, one shard above); ``reduce_grads(unit)``: start combining a unit's
  gradients across ranks, *returning* the :class:`~shardlab.engine.flat.Reduction` (the base
  queues it and waits for it); ``keep_grads(reduction)``: what is kept when it lands;
  ``after_step(unit)``: how the updated weights reach the parameters again;
* ``pre_forward(unit)``, ``post_forward(unit, output)``, ``post_backward(unit)``: the points of a
  unit's step where stage 3 gathers and frees, and ``root_pre_forward()``,
  ``root_post_forward()``, ``root_post_backward()`` the same for the whole model (stages 0-2
  keep the base's versions). The names after "its own" are stage 3's alone: ``pre_backward``
  (a unit's output gradient arrived: gather it), ``prefetch_next`` and ``free_after_forward``;
  its walk and its graph window are the two helper rows;

and sets class attributes instead of testing stage numbers: ``shards_optimizer_state`` and
``shards_params`` (the paper's P_os and P_p), ``reduce_as_ready`` (ZeRO-2's P_g: see below).

Every rank issues the same collectives in the same order, whatever its control flow: the units'
reductions start in one fixed order (reverse registration order, the root last), each as soon as
it and those before it are ready; a unit this rank never ran joins with ``-0.0`` when backward
ends (at stage 3, when the walk passes it), as FSDP2's root post-backward callback does. Ranks
differ only in timing: nobody drifts, aborts or hangs (``missing_grads.py`` tells the rest).
"""

from __future__ import annotations

from contextlib import contextmanager
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from shardlab.engine import comm, events
from shardlab.engine.flat import FlatUnit, Reduction
from shardlab.engine.missing_grads import add_average, check_backend_keeps_sign
from shardlab.engine.units import (
    broadcast_untrained_state,
    check_same_model_on_every_rank,
    find_unit_modules,
    group_params,
)


class TrainingState(Enum):
    """What the engine is doing (FSDP2's ``TrainingState``)."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def on_output_grad(output, fn) -> None:
    """Call ``fn()`` when the gradient of (any tensor in) a module's output arrives in backward."""
    for t in tree_flatten(output)[0]:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(lambda grad: fn())


class Engine:
    """The machinery shared by stages 0-3. Subclasses supply the methods named above."""

    stage: int
    shards_optimizer_state = False  # the optimizer steps a shard of each unit (ZeRO-1 and up)
    shards_params = False  # only a shard of the weights is kept at rest (ZeRO-3)
    #: Start each unit's reduction as soon as its gradients are all computed, overlapping the
    #: backward of the units before it (then its full gradients can be dropped). ZeRO-1 waits
    #: for the whole backward instead, holding every full gradient until then.
    reduce_as_ready = True
    #: Reductions left in flight after each issue. A new reduction is issued first, then the
    #: oldest are waited for (which frees their full gradient buffers) until this many remain:
    #: so as one is issued, this many plus one units' packed full gradients are alive (three).
    max_reductions_in_flight = 2

    def __init__(self, model: nn.Module, *, units=None, param_dtype=None, reduce_dtype=None):
        self.model = model
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.state = TrainingState.IDLE
        self.sync = True  # False inside no_sync(): keep gradients local, communicate later
        self.optimizer = lambda: None  # parallelize sets a weak reference to the optimizer it returns
        events.set_phase("init")
        groups = group_params(model, find_unit_modules(model, units))
        # mixed precision: params (and forward, backward) in param_dtype, masters in their own
        self.mixed = param_dtype not in (None, groups[0][2][0].dtype)
        check_same_model_on_every_rank(groups, self.world_size)
        broadcast_untrained_state(model)
        self.units: list[FlatUnit] = []
        for index, (name, module, params) in enumerate(groups):
            unit = FlatUnit(name, params, rank=self.rank, world_size=self.world_size, index=index, module=module)
            comm.broadcast(unit.full, src=0, unit=name, owner=unit)  # every rank starts from rank 0's weights
            unit.master = nn.Parameter(self.make_master(unit))
            unit.cast(param_dtype if self.mixed else unit.master_dtype)
            self.units.append(unit)
        self.root = self.units[-1] if self.units[-1].module is model else None
        self.others = [u for u in self.units if u is not self.root]
        #: the fixed order of reductions: reverse registration order, the root (used first and last) last
        self.reduce_order = self.others[::-1] + ([self.root] if self.root else [])
        self.param_dtype = self.units[0].full.dtype  # what forward and backward compute in
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # Stage 0 in full precision: the averaged full gradients are the params' own (views).
        self.grads_in_params = not self.shards_optimizer_state and not self.mixed and self.reduce_dtype == self.param_dtype
        self.param_ids = frozenset(id(p) for u in self.units for p in u.params)
        self._in_flight: list[Reduction] = []
        self._next_reduction = 0  # index into reduce_order
        check_backend_keeps_sign(self.reduce_dtype, self.units[0].full.device)
        model.register_forward_pre_hook(self._on_root_forward, with_kwargs=True)
        model.register_forward_hook(self._on_root_forward_end)  # first: backward starts here
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._on_grad_ready(unit))
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self.pre_forward(u))
            unit.module.register_forward_hook(lambda m, args, out, u=unit: self.post_forward(u, out))

    @property
    def state(self) -> TrainingState:
        return self._state

    @state.setter
    def state(self, state: TrainingState) -> None:
        """The one place the state changes; the ledger files collectives under it (idle keeps the last)."""
        self._state = state
        if state is not TrainingState.IDLE:
            events.set_phase(state.value)

    @property
    def params_hold_grads(self) -> bool:
        """After backward, each ``p.grad`` is what an optimizer over ``model.parameters()`` must step."""
        return self.shards_params or self.grads_in_params

    # -- the stage's decisions ----------------------------------------------------------------
    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        raise NotImplementedError

    def reduce_grads(self, unit: FlatUnit) -> Reduction:
        raise NotImplementedError

    def keep_grads(self, reduction: Reduction) -> None:
        raise NotImplementedError

    def after_step(self, unit: FlatUnit) -> None:
        raise NotImplementedError

    # -- forward ----------------------------------------------------------------------------
    def _on_root_forward(self, module, args, kwargs):
        self.state = TrainingState.FORWARD
        self.root_pre_forward()
        if self.mixed:  # cast floating-point inputs to the compute dtype
            cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _on_root_forward_end(self, module, args, output) -> None:
        self.root_post_forward()
        self.state = TrainingState.IDLE
        if torch.is_grad_enabled():
            on_output_grad(output, self._start_backward)

    def root_pre_forward(self) -> None:
        """The root's forward begins (before any unit's)."""

    def pre_forward(self, unit: FlatUnit) -> None:
        events.emit(events.FORWARD, unit=unit.name)

    def post_forward(self, unit: FlatUnit, output) -> None:
        """Stages 0-2 have nothing to free; when traced, mark where the unit's backward starts."""
        events.emit(events.FORWARD_DONE, unit=unit.name)
        if events.active() and torch.is_grad_enabled():
            on_output_grad(output, lambda: events.emit(events.BACKWARD, unit=unit.name))

    def root_post_forward(self) -> None:
        """The root's forward returned."""

    # -- backward ---------------------------------------------------------------------------
    def _start_backward(self) -> None:
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _on_grad_ready(self, unit: FlatUnit) -> None:
        """Called after each parameter's gradient is accumulated; a unit is done at zero."""
        self._start_backward()
        if unit.backward_count.reduced:
            raise RuntimeError(
                f"unit {unit.name!r} got a gradient after its reduction started: at stage 3 units must run "
                "in registration order (ranks may skip units), and a unit run twice in one forward must be "
                "so on every rank; register the modules in the order they run, or use stage 2")
        if unit.backward_count.got_grad():
            events.emit(events.BACKWARD_DONE, unit=unit.name)
            self.post_backward(unit)

    def post_backward(self, unit: FlatUnit) -> None:
        """A unit's gradients are all computed: start the reductions that are due (async)."""
        if self.reduce_as_ready:
            self.issue_reductions()

    def issue_reductions(self, due=lambda unit: False, keep: int | None = None) -> None:
        """Start, in the fixed order, each reduction whose unit is ready (or ``due(unit)``);
        after each, wait for the oldest until ``keep`` remain (default ``max_reductions_in_flight``).

        ``due(unit)`` says a unit's missing gradients will not come on this rank: it reduces
        ``-0.0`` for them. Only when ``sync``: inside ``no_sync`` gradients stay local.
        """
        keep = self.max_reductions_in_flight if keep is None else keep
        while self.sync and self._next_reduction < len(self.reduce_order):
            unit = self.reduce_order[self._next_reduction]
            if unit.backward_count.grads_to_come > 0 and not due(unit):
                return
            unit.backward_count.start_reduction()
            self._next_reduction += 1
            self._in_flight.append(self.reduce_grads(unit))
            self._finish_reductions(keep=keep)

    def _finish_reductions(self, keep: int = 0) -> None:
        """Wait for the oldest reductions until ``keep`` remain in flight, and keep their result."""
        while len(self._in_flight) > keep:
            reduction = self._in_flight.pop(0)
            reduction.pending.wait()
            self.keep_grads(reduction)

    def root_post_backward(self) -> None:
        """Autograd is done, before the last reductions are issued."""

    def _finalize_backward(self) -> None:
        """Every rank: the reductions not started yet (units unused here), in the fixed order."""
        self.root_post_backward()
        self.issue_reductions(due=lambda unit: True, keep=len(self.units))  # all at once: backward is over
        self._finish_reductions(keep=0)
        if self.sync:
            self._hand_out_grads()
        for unit in self.units:  # a second backward (retain_graph) reduces again
            unit.backward_count.rearm()
        self._next_reduction = 0
        self.state = TrainingState.IDLE

    def _hand_out_grads(self) -> None:
        """Params no rank used get ``grad = None``; a master with nothing used is not stepped."""
        for unit in self.units:
            unit.master.grad = grad = unit.mark_unused(unit.master.grad)
            if self.params_hold_grads:
                unit.set_param_grads(grad, skip=unit.unused)

    def accumulate(self, unit: FlatUnit, total: torch.Tensor) -> None:
        """Give the optimizer ``total / N`` (``total``: a reduced SUM); add it to an earlier
        one unless the params already did. ``add_average`` keeps ``-0.0`` meaning "no rank
        used it" through the division and the cast (``missing_grads.py``)."""
        earlier = None if unit.master.grad is None or self.grads_in_params else unit.master.grad
        unit.master.grad = add_average(earlier, total, self.world_size, unit.master.dtype)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients, or (``set_to_none=False``) zero them in place as torch does: a
        param that had a gradient then steps with zeros, one that had none (unused) stays so."""
        for unit in self.units:
            grad = unit.master.grad
            if set_to_none or grad is None:
                unit.master.grad = None
                unit.set_param_grads(None)
                continue
            for i, (a, b) in enumerate(unit.ranges(grad)):
                if i not in unit.unused:
                    grad[a:b].zero_()
