"""Stage 3's walk: every rank gathers the same units in the same order, whatever it runs.

Gathers are collectives, and which units a rank runs can depend on its data (an expert no
token chose). So every rank walks the units in one fixed order per phase::

    forward:   registration order, the root first
    backward:  the reverse of the order in which units finish their forward, the root first

(The reductions have an order of their own, ``base.reduce_order``: reverse registration, the
root *last*, since the root's gradients are complete only when backward ends.)

On reaching a unit, a rank first does, for each unit it skipped, what the ranks that ran it
do: gather and free (in forward), gather, free and join the reduction with ``-0.0`` (in
backward, as soon as :meth:`UnitWalk.walked_past` says that unit's backward is over on every
rank). When a phase ends, :meth:`UnitWalk.finish` catches up on the units nobody here reached.
The price of that rule, as in FSDP: a unit that runs twice in one forward (weights reused)
must do so on every rank.

``pre_backward`` can run several times for one unit (once per output tensor whose gradient
arrives, ``base.on_output_grad``): the walk has passed the unit by then, so the second call
only finds it gathered (``FlatUnit.gather`` does nothing to a gathered unit).
"""

from __future__ import annotations

from shardlab.engine.base import TrainingState
from shardlab.engine.flat import FlatUnit


def backward_order(units: list[FlatUnit], last_inside: dict[FlatUnit, int]) -> list[FlatUnit]:
    """The reverse of the order in which ``units`` finish their forward.

    A unit finishes its forward just after the last unit nested inside it (``last_inside``: that
    one's index, or its own), so sort by that, latest first; a parent comes before the child it
    finishes with. Example: ``a``, ``b``, ``c`` registered in that order, ``b`` inside ``a``.
    Forward finishes ``b``, ``a``, ``c``, so backward runs ``c``, ``a``, ``b``: keys (last
    inside, -index) are a (1, 0), b (1, -1), c (2, -2), sorted latest first.
    """
    return sorted(units, key=lambda u: (last_inside[u], -u.index), reverse=True)


class UnitWalk:
    """One stage-3 engine's walk over its units: where each phase has come to, and what is due."""

    def __init__(self, engine):
        #: the engine walked for: its ``prefetch`` flag, ``prefetch_next`` and ``issue_reductions``
        self.engine = engine
        others = engine.others
        #: per unit, the index of the last unit nested inside it (its own index if none)
        self.last_inside = {u: u.index for u in engine.units}
        for unit in others:  # units are in registration order: a unit's children come after it
            inside = {id(m) for m in unit.module.modules()}
            self.last_inside[unit] = max(u.index for u in others if id(u.module) in inside)
        root = [engine.root] if engine.root else []
        self.order = {TrainingState.FORWARD: root + others,
                      TrainingState.BACKWARD: root + backward_order(others, self.last_inside)}
        self._position = {phase: {u: i for i, u in enumerate(order)} for phase, order in self.order.items()}
        self._next = 0  # how far this phase's walk has come

    def new_forward(self) -> None:
        """A root forward begins: count each unit's calls afresh."""
        for unit in self.engine.units:
            unit.backward_count.new_forward()

    def forward_to(self, unit: FlatUnit) -> None:
        """Gather ``unit`` for its forward; gather and free first each unit this rank skipped."""
        unit.backward_count.ran_forward()
        self._walk_to(TrainingState.FORWARD, unit, skipped=self.engine.free_after_forward)

    def backward_to(self, unit: FlatUnit) -> None:
        """Gather ``unit`` for its backward; first gather, free and reduce each unit skipped."""
        self._walk_to(TrainingState.BACKWARD, unit, skipped=FlatUnit.free)

    def finish(self, phase: TrainingState, then=None) -> None:
        """End ``phase``'s walk. With ``then``, first enter each unit not reached yet (nobody
        here ran it) and call ``then(unit)`` after each. The next walk starts from the top."""
        if then is not None:
            for unit in self.order[phase][self._next :]:
                self._enter(phase, unit)
                then(unit)
        self._next = 0

    def walked_past(self, unit: FlatUnit, entering: FlatUnit) -> bool:
        """The backward walk is entering ``entering``: is ``unit``'s backward over on every rank?

        Backward runs the units in reverse: once the walk reaches ``entering``, every unit
        registered after the last one nested in it has had its backward, on the ranks that ran
        it; a rank that skipped such a unit must reduce it now (with ``-0.0``), at the same point
        in its sequence of collectives as the others. Two exceptions wait for the end of backward
        instead: a unit run twice in this forward (its earlier use's gradients are still to
        come), and the root (used first and last).
        """
        return (unit.index > self.last_inside[entering] and unit.backward_count.forward_calls < 2
                and unit is not self.engine.root)

    def _walk_to(self, phase: TrainingState, unit: FlatUnit, skipped) -> None:
        order, position = self.order[phase], self._position[phase][unit]
        if position < self._next:  # passed already: a unit run twice (every rank must do so)
            unit.gather()
            return
        for other in order[self._next : position]:
            self._enter(phase, other)
            skipped(other)
        self._enter(phase, unit)

    def _enter(self, phase: TrainingState, unit: FlatUnit) -> None:
        order = self.order[phase]
        self._next = self._position[phase][unit] + 1
        if phase is TrainingState.BACKWARD:  # the units after this one's subtree are done: reduce them now
            self.engine.issue_reductions(due=lambda u: self.walked_past(u, entering=unit))
        unit.gather()  # waits here if a prefetch already started it
        if self.engine.prefetch:
            self.engine.prefetch_next(order, unit)
