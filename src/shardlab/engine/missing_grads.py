"""Parameters that get no gradient: the one convention, explained once, and its rules.

On some step a parameter may get no gradient on a rank: an expert no token chose, a branch its
data did not take, a spare layer. One process, and DDP, leave such a parameter alone: its
``grad`` stays None and the optimizer skips it; one used on only some ranks gets the sum of the
gradients that exist, divided by N. Flat shards make two things hard:

1. **The ranks must still issue the same collectives, in the same order,** or they drift apart,
   abort or hang. The base reduces units in one fixed order and, when backward ends, makes a
   rank join the reductions of the units it never ran (``due`` in ``base.issue_reductions``);
   stage 3 walks the units in one order too, and ``lockstep.UnitWalk.walked_past`` says when a
   skipped unit's reduction is due during backward.
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

import torch

from shardlab.engine import comm


def send_missing(out: torch.Tensor) -> None:
    """This rank has no gradient for this part: send ``-0.0``."""
    out.fill_(-0.0)


def send_present(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Copy a gradient that exists, turning any ``-0.0`` into ``+0.0`` (adding ``+0.0`` does)."""
    torch.add(grad, 0.0, out=out)


def is_missing(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``-0.0``, the value only a sum of "no gradient here" gives."""
    return (t == 0) & t.signbit()


def find_unused(ranges: list[tuple[int, int]], grad: torch.Tensor) -> list[int]:
    """Indices of the params whose part of the reduced ``grad`` is all ``-0.0`` (no rank used them).

    ``ranges`` says where each param lies in ``grad`` (``FlatUnit.ranges``). The rule is
    ``is_missing(grad[a:b]).all()``; reading each part's first element first, all in one
    tensor, is only a shortcut: a used param almost always fails there, so the whole part is
    scanned only for the few that may be unused.

    The ``.tolist()`` is a host sync: the answer decides on the host which ``p.grad`` become
    None. :func:`mark_unused` calls this only for a unit where this rank gave some param no
    gradient, so a step where every rank used every param reads nothing on the host. It runs
    after every reduction has landed (``base._finalize_backward``), so it waits for no
    collective and overlaps nothing.
    """
    spans = [(i, a, b) for i, (a, b) in enumerate(ranges) if b > a]
    if not spans:
        return []
    firsts = is_missing(grad[torch.tensor([a for _, a, _ in spans], device=grad.device)]).tolist()
    return [i for (i, a, b), first in zip(spans, firsts, strict=True) if first and bool(is_missing(grad[a:b]).all())]


def mark_unused(ranges: list[tuple[int, int]], grad: torch.Tensor | None,
                no_grad_here: set[int]) -> tuple[list[int], torch.Tensor | None]:
    """The unused params of a unit, from its reduced ``grad`` (this rank's part), and what the
    optimizer should step: ``grad``, or None when every param with elements here went unused.

    ``no_grad_here``: the params this rank gave no gradient when it packed them.
    """
    if grad is None:
        return [], None
    # This rank sent ``grad + 0.0`` (never -0.0) for every param it gave a gradient, and a sum
    # with one term that is not -0.0 is not -0.0: when it gave every param one, no param of
    # this unit can be unused, and there is nothing to read (no host sync on the usual step).
    unused = find_unused(ranges, grad) if no_grad_here else []
    all_unused = bool(unused) and len(unused) == sum(b > a for a, b in ranges)
    # A piece with no elements here cannot say whether another rank used its param: it counts
    # as unused (grad None) only if this rank gave it no gradient either.
    unused += [i for i, (a, b) in enumerate(ranges) if a == b and i in no_grad_here]
    return unused, None if all_unused else grad


def check_backend_keeps_sign(dtype: torch.dtype, device: torch.device) -> None:
    """One all-reduce of ``-0.0`` at start-up: warn if the backend's SUM loses the sign of zero."""
    probe = torch.full((1,), -0.0, dtype=dtype, device=device)
    comm.all_reduce(probe)
    if not bool(probe.signbit()):
        warnings.warn("this backend's SUM loses the sign of zero: parameters no rank uses will be "
                      "stepped with a zero gradient instead of skipped", stacklevel=4)
