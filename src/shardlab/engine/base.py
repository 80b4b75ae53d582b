"""What every ZeRO stage shares: units, gradient-ready hooks, the reductions' order, no_sync.

The stage contract. Each stage file defines exactly the public methods listed for it here
(``tests/test_stage_contract.py`` reads this table, so it cannot drift); everything else lives
in this file, once::

    ddp.py    shard, reduce_grads, keep_grads, after_step
    zero1.py  shard, reduce_grads, after_step
    zero2.py  (none: one class attribute)
    zero3.py  __init__, shard, reduce_grads, after_step, forward_start, pre_forward, post_forward,
              forward_done, post_backward, backward_done, pre_backward, prefetch_next,
              count_accumulators, holding, held_backward

* ``shard(unit)``              which part of a unit the optimizer steps on this rank (the master);
* ``reduce_grads(unit)``       start combining a unit's gradients across ranks; *returns* the
  :class:`~shardlab.engine.flat.Reduction` (the base queues it and waits for it);
* ``keep_grads(reduction)``    what is kept when that reduction lands;
* ``after_step(unit)``         how the updated weights reach the parameters again;
* ``forward_start()``, ``pre_forward(unit)``, ``post_forward(unit, output)``, ``forward_done()``,
  ``post_backward(unit)``, ``backward_done()``: the points of a step where stage 3 gathers and
  frees (stages 0-2 keep the base's versions). The rest of ``zero3.py``'s list is its own:
  ``pre_backward`` (a unit's output gradient arrived: gather it), ``prefetch_next``, and what
  several forwards before one backward need (``count_accumulators``, ``holding``, ``held_backward``);

and sets class attributes instead of testing stage numbers: ``shards_optimizer_state`` and
``shards_params`` (the paper's P_os and P_p), ``reduce_as_ready`` (ZeRO-2's P_g: see below).

Every rank issues the same collectives in the same order, whatever its control flow: each
unit's reduction starts in one fixed order (the units in reverse registration order, the root
unit last), as soon as its gradients and those of the units before it are ready. A unit that got
no gradient on this rank (an expert no token chose) joins with ``-0.0`` when backward ends (at
stage 3, when the backward walk passes it), as FSDP2's root post-backward callback does. The
ranks then issue one sequence and differ only in timing, so a rank that waits, waits for a
collective the others will issue: nobody drifts, aborts or hangs. A parameter no rank gave a
gradient keeps ``grad = None`` and is not stepped (``missing_grads.py`` says how that is known
with no extra collective).
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
from shardlab.engine.missing_grads import check_backend_keeps_sign
from shardlab.engine.units import find_unit_modules, group_params


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
    #: Reductions allowed in flight at once. Waiting for the oldest one frees its full gradient
    #: buffer, so at most this many units' full gradients are alive during backward.
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
        self._check_same_model_on_every_rank(groups)
        self._broadcast_untrained_state()
        self.units: list[FlatUnit] = []
        for index, (name, module, params) in enumerate(groups):
            unit = FlatUnit(name, params, rank=self.rank, world_size=self.world_size, index=index)
            comm.broadcast(unit.full, src=0, unit=name)  # every rank starts from rank 0's weights
            unit.module = module
            unit.master = nn.Parameter(self.shard(unit))
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
    def params_hold_grads(self) -> bool:
        """After backward, each ``p.grad`` is what an optimizer over ``model.parameters()`` must step."""
        return self.shards_params or self.grads_in_params

    # -- the stage's decisions ----------------------------------------------------------------
    def shard(self, unit: FlatUnit) -> torch.Tensor:
        raise NotImplementedError

    def reduce_grads(self, unit: FlatUnit) -> Reduction:
        raise NotImplementedError

    def keep_grads(self, reduction: Reduction) -> None:
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
        self.state = TrainingState.FORWARD
        self.forward_start()
        if self.mixed:  # cast floating-point inputs to the compute dtype
            cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _on_root_forward_end(self, module, args, output) -> None:
        self.forward_done()
        self.state = TrainingState.IDLE
        if torch.is_grad_enabled():
            on_output_grad(output, self._start_backward)

    def forward_start(self) -> None:
        """The root's forward begins (before any unit's)."""

    def pre_forward(self, unit: FlatUnit) -> None:
        events.emit("forward", unit=unit.name)

    def post_forward(self, unit: FlatUnit, output) -> None:
        """Stages 0-2 have nothing to free; when traced, mark where the unit's backward starts."""
        events.emit("forward_done", unit=unit.name)
        if events.active() and torch.is_grad_enabled():
            on_output_grad(output, lambda: events.emit("backward", unit=unit.name))

    def forward_done(self) -> None:
        """The root's forward returned."""

    # -- backward ---------------------------------------------------------------------------
    def _start_backward(self) -> None:
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            events.set_phase("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad_ready(self, unit: FlatUnit) -> None:
        """Called after each parameter's gradient is accumulated; a unit is done at zero."""
        self._start_backward()
        if unit.reduced:
            raise RuntimeError(
                f"unit {unit.name!r} got a gradient after its reduction started: at stage 3 units must "
                "run their forward in registration order (ranks may skip units), and a unit run twice in "
                "one forward must be so on every rank; register the modules in the order they run, "
                "or use stage 2")
        unit.grads_to_come -= 1
        if unit.grads_to_come == 0:
            events.emit("backward_done", unit=unit.name)
            self.post_backward(unit)

    def post_backward(self, unit: FlatUnit) -> None:
        """A unit's gradients are all computed: start the reductions that are due (async)."""
        if self.reduce_as_ready:
            self.issue_reductions()

    def issue_reductions(self, force=lambda unit: False, keep: int | None = None) -> None:
        """Start, in the fixed order, each reduction whose unit is ready (or ``force(unit)``),
        keeping at most ``keep`` in flight (default ``max_reductions_in_flight``).

        A forced unit is one whose missing gradients will not come on this rank: it reduces
        ``-0.0`` for them. Only when ``sync``: inside ``no_sync`` gradients stay local.
        """
        keep = self.max_reductions_in_flight if keep is None else keep
        while self.sync and self._next_reduction < len(self.reduce_order):
            unit = self.reduce_order[self._next_reduction]
            if unit.grads_to_come > 0 and not force(unit):
                return
            unit.grads_to_come, unit.reduced = 0, True
            self._next_reduction += 1
            self._in_flight.append(self.reduce_grads(unit))
            self._finish_reductions(keep=keep)

    def reductions_in_flight(self) -> list[tuple[FlatUnit, list[torch.Tensor]]]:
        """Each pending reduction's unit and the gradient buffers it holds until it lands."""
        return [(r.unit, [r.grad, *r.pending.buffers]) for r in self._in_flight]

    def _finish_reductions(self, keep: int = 0) -> None:
        """Wait for the oldest reductions until ``keep`` remain in flight, and keep their result."""
        while len(self._in_flight) > keep:
            reduction = self._in_flight.pop(0)
            reduction.pending.wait()
            self.keep_grads(reduction)

    def backward_done(self) -> None:
        """Autograd is done, before the last reductions are issued."""

    def _end_of_backward(self) -> None:
        """Every rank: the reductions not started yet (units unused here), in the fixed order."""
        self.backward_done()
        self.issue_reductions(force=lambda unit: True, keep=len(self.units))  # all at once: backward is over
        self._finish_reductions(keep=0)
        if self.sync:
            self._hand_out_grads()
        for unit in self.units:  # a second backward (retain_graph) reduces again
            unit.grads_to_come, unit.reduced = unit.grads_per_backward, False
        self._next_reduction = 0
        self.state = TrainingState.IDLE

    def _hand_out_grads(self) -> None:
        """Params no rank used get ``grad = None``; a master with nothing used is not stepped."""
        for unit in self.units:
            unit.master.grad = grad = unit.mark_unused(unit.master.grad)
            if self.params_hold_grads:
                unit.set_param_grads(grad, skip=unit.unused)

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
