"""Parameters that get no gradient: the one convention, explained once, and its rules.

On some step a parameter may get no gradient on a rank: an expert no token chose, a branch its
data did not take, a spare layer. One process, and DDP, leave such a parameter alone: its
``grad`` stays None and the optimizer skips it; one used on only some ranks gets the sum of the
gradients that exist, divided by N. Flat shards make two things hard:

1. **The ranks must still issue the same collectives, in the same order,** or they drift apart,
   abort or hang. The base reduces units in one fixed order and, when backward ends, makes a
   rank join the reductions of the units it never ran (``force`` in ``base.issue_reductions``);
   stage 3 walks the units in one order too, and :func:`walked_past` says when a skipped unit's
   reduction is due during backward.
2. **After the reduction every rank must know whether *any* rank used a parameter,** with no
   extra collective. The convention: when a unit packs its gradients, a parameter with no
   gradient here is sent as ``-0.0`` (:func:`send_missing`) and one with a gradient as
   ``grad + 0.0`` (:func:`send_present`, never ``-0.0``). In IEEE arithmetic a sum is ``-0.0``
   only if every term is, so a parameter whose part of the reduced gradient is all ``-0.0`` was
   used by no rank (:func:`find_unused`). ``parallelize`` checks once that the backend keeps the
   sign of zero (:func:`check_backend_keeps_sign`).

After backward :func:`mark_unused` lists a unit's unused params; they keep ``grad = None``, and
the optimizers, which step one piece per parameter, give their pieces no gradient, so torch's
optimizer skips them (``per_param.py``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from shardlab.engine import comm

if TYPE_CHECKING:
    from shardlab.engine.flat import FlatUnit


def send_missing(out: torch.Tensor) -> None:
    """This rank has no gradient for this part: send ``-0.0``."""
    out.fill_(-0.0)


def send_present(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Copy a gradient that exists, turning any ``-0.0`` into ``+0.0`` (adding ``+0.0`` does)."""
    torch.add(grad, 0.0, out=out)


def is_missing(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``-0.0``, the value only a sum of "no gradient here" gives."""
    return (t == 0) & t.signbit()


def find_unused(unit: FlatUnit, grad: torch.Tensor) -> list[int]:
    """Indices of the params whose part of the reduced ``grad`` is all ``-0.0`` (no rank used them)."""
    spans = [(i, a, b) for i, (a, b) in enumerate(unit.ranges(grad)) if b > a]
    if not spans:
        return []
    firsts = is_missing(grad[torch.tensor([a for _, a, _ in spans], device=grad.device)]).tolist()
    return [i for (i, a, b), first in zip(spans, firsts, strict=True) if first and bool(is_missing(grad[a:b]).all())]


def mark_unused(unit: FlatUnit, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Set ``unit.unused`` from the reduced ``grad`` (this rank's part); return what the optimizer
    should step: ``grad``, or None when every param with elements here went unused."""
    if grad is None:
        unit.unused = []
        return None
    unit.unused = find_unused(unit, grad)
    ranges = unit.ranges(grad)
    all_unused = bool(unit.unused) and len(unit.unused) == sum(b > a for a, b in ranges)
    # A piece with no elements here cannot say whether another rank used its param: it counts
    # as unused (grad None) only if this rank gave it no gradient either.
    unit.unused += [i for i, (a, b) in enumerate(ranges) if a == b and i in unit.no_grad_here]
    return None if all_unused else grad


def walked_past(unit: FlatUnit, entering: FlatUnit, root: FlatUnit | None) -> bool:
    """Stage 3's backward walk is entering ``entering``: is ``unit``'s backward over on every rank?

    Backward runs the units in reverse: once the walk reaches ``entering``, every unit
    registered after the last one nested in it has had its backward, on the ranks that ran it;
    a rank that skipped such a unit must reduce it now (with ``-0.0``), at the same point in its
    sequence of collectives as the others. Two exceptions wait for the end of backward instead:
    a unit run twice in this forward (its earlier use's gradients are still to come), and the
    root (used first and last).
    """
    return unit.index > entering.last_index and unit.forward_calls < 2 and unit is not root


def check_backend_keeps_sign(dtype: torch.dtype, device: torch.device) -> None:
    """One all-reduce of ``-0.0`` at start-up: warn if the backend's SUM loses the sign of zero."""
    probe = torch.full((1,), -0.0, dtype=dtype, device=device)
    comm.all_reduce(probe)
    if not bool(probe.signbit()):
        warnings.warn("this backend's SUM loses the sign of zero: parameters no rank uses will be "
                      "stepped with a zero gradient instead of skipped", stacklevel=4)
