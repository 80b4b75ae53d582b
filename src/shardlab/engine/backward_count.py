"""A unit's countdown to its reduction in one backward, kept in one record.

The base starts a unit's reduction when every gradient it expects has arrived; the post-
accumulate hook counts them down. The record is a field of each ``FlatUnit``
(``unit.backward_count``), and only its own methods below change it, so each rule that moves
the count is named once: the base counts down and re-arms it, stage 3's graph window adds
accumulators and starts a new graph, stage 3's walk counts forward calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BackwardCount:
    """A unit's countdown to its reduction, one record; only its own methods write it.

    Each post-accumulate hook call counts one gradient down (:meth:`got_grad`); at zero the
    unit's reduction can start. Usually a backward brings one call per param. In mixed
    precision at stage 3 a param used twice in one graph, with the unit freed in between, has
    two gradient accumulators, and each calls the hook (``graph_window.GraphWindow.count_accumulators``).
    """

    grads_to_come: int  # post-accumulate hook calls still to come in this backward
    reduced: bool = False  # this backward's reduction is issued
    #: per param, the gradient accumulators its uses in this graph hold (id -> node, kept
    #: alive so that an id stays unique while the graph lives)
    accumulators: list[dict[int, object]] = field(default_factory=list)
    forward_calls: int = 0  # times the unit ran in this forward (stage 3's walk reads it)

    @classmethod
    def for_params(cls, n: int) -> BackwardCount:
        return cls(grads_to_come=n, accumulators=[{} for _ in range(n)])

    def got_grad(self) -> bool:
        """One gradient arrived; True when it was the last one this backward brings."""
        self.grads_to_come -= 1
        return self.grads_to_come == 0

    def start_reduction(self) -> None:
        """The reduction is issued: nothing more is waited for (a missing gradient is ``-0.0``)."""
        self.grads_to_come, self.reduced = 0, True

    def note_accumulator(self, i: int, node) -> None:
        """Param ``i``'s gradient accumulator in one use of the unit: a second one in this
        graph means one more hook call will come."""
        seen = self.accumulators[i]
        if id(node) not in seen:
            self.grads_to_come += 1 if seen else 0
            seen[id(node)] = node

    def rearm(self) -> None:
        """After a backward: a second backward of the same graph (``retain_graph``) brings as
        many hook calls again, one per param and accumulator."""
        self.grads_to_come = sum(max(1, len(seen)) for seen in self.accumulators)
        self.reduced = False

    def new_graph(self) -> None:
        """A forward after a backward starts a new graph: forget the last one's accumulators."""
        self.accumulators = [{} for _ in self.accumulators]
        self.grads_to_come = len(self.accumulators)

    def new_forward(self) -> None:
        self.forward_calls = 0

    def ran_forward(self) -> None:
        self.forward_calls += 1
