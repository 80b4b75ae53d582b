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
   extra collective. The convention: an element of the reduced gradient is ``-0.0`` exactly
   when every rank sent ``-0.0`` for it, that is when no rank gave its parameter a gradient.

How each step keeps the convention exact:

- **Sending.** A parameter with no gradient here is sent as ``-0.0`` (:func:`send_missing`);
  one with a gradient is copied into the pack's dtype and *then* ``+0.0`` is added
  (:func:`send_present`), so nothing it sends is ``-0.0``, even where the cast to a narrower
  dtype (fp32 to fp16) rounds a tiny negative gradient to zero.
- **Summing.** In IEEE arithmetic, rounding to nearest, a sum is ``-0.0`` only if every term
  is: terms that cancel exactly give ``+0.0``, and a nonzero sum of values of one dtype is a
  multiple of its smallest subnormal, so it never rounds to zero. ``parallelize`` checks once
  that the backend keeps the sign of zero (:func:`check_backend_keeps_sign`).
- **Dividing and keeping.** ÷N, the cast into the master's dtype, or the addition to an
  earlier micro-batch's gradient in a narrower dtype *can* round a tiny sum to ``-0.0``
  (in fp16 ÷N does it to a negative sum down to -N × 3e-8). :func:`add_average` reads which elements are
  missing before that arithmetic and writes that answer back after it (on the device, no host
  sync): ``-0.0`` where they were missing, ``+0.0`` for any other zero.

So every rank reads the same verdict from its reduced gradient: a parameter whose part is all
``-0.0`` was used by no rank (:func:`find_unused`). After backward :func:`mark_unused` lists a
unit's unused params; they keep ``grad = None``, and the optimizers, which step one piece per
parameter, give their pieces no gradient, so torch's optimizer skips them (``per_param.py``).
"""

from __future__ import annotations

import warnings

import torch

from shardlab.engine import comm


def send_missing(out: torch.Tensor) -> None:
    """This rank has no gradient for this part: send ``-0.0``."""
    out.fill_(-0.0)


def send_present(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Copy a gradient that exists, then turn any ``-0.0`` into ``+0.0`` (adding ``+0.0`` does).

    The ``+0.0`` is added after the copy, in ``out``'s dtype: a narrowing cast (fp32 to fp16)
    can round a tiny negative gradient to ``-0.0``, which would read as "no gradient here".
    """
    out.copy_(grad)
    out.add_(0.0)


#: The integer type of each float's width: ``-0.0`` is the float whose bits are the sign bit
#: alone, which as a signed integer is that type's minimum.
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_missing(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``-0.0``, the value only a sum of "no gradient here" gives.

    One comparison of the bits (``-0.0`` is the sign bit alone), where ``(t == 0) & t.signbit()``
    would take three passes over a full gradient on every step.
    """
    bits = _BITS.get(t.element_size())
    if bits is None or not t.is_floating_point():
        return (t == 0) & t.signbit()
    return t.view(bits) == torch.iinfo(bits).min


def add_average(into: torch.Tensor | None, total: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``into + total / n`` in ``dtype`` (``total / n`` when ``into`` is None), with the
    convention kept exact: ``-0.0`` where ``total`` (and ``into``) are ``-0.0``, nowhere else.

    ``total`` is a reduced SUM (divided in place); ``into`` an earlier micro-batch's average,
    added to in place. ÷N and a narrowing cast can round a tiny sum to ``-0.0``, and ranks
    that gave the parameter a gradient would then disagree with those that gave none about
    whether it was used (``mark_unused``). So the missing elements are read first and written
    back last: elementwise work on the device, no host sync.
    """
    missing = is_missing(total)
    if into is not None:
        missing &= is_missing(into)
    total.div_(n)  # SUM / N: sum, then divide, on every backend and torch version
    if into is None:
        into = total.to(dtype)
    else:
        into += total
    return into.add_(0.0).masked_fill_(missing, -0.0)  # every zero +0.0, then the missing ones -0.0


def find_unused(ranges: list[tuple[int, int]], grad: torch.Tensor, candidates: list[int]) -> list[int]:
    """Which params of ``candidates`` have a part of the reduced ``grad`` that is all ``-0.0``
    (no rank used them).

    ``ranges`` says where each param lies in ``grad`` (``FlatUnit.ranges``). The rule is
    ``is_missing(grad[a:b]).all()``; reading each part's first element first, all in one
    tensor, is only a shortcut: a used param almost always fails there, so the whole part is
    scanned only for the few that may be unused.

    The ``.tolist()`` is a host sync: the answer decides on the host which ``p.grad`` become
    None. :func:`mark_unused` asks only about the params this rank gave no gradient, so a step
    where every rank used every param reads nothing on the host. It runs after every reduction
    has landed (``base._finalize_backward``), so it waits for no collective and overlaps nothing.
    """
    spans = [(i, *ranges[i]) for i in candidates if ranges[i][1] > ranges[i][0]]
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
    # A param this rank gave a gradient was used: nothing it sent was -0.0, so its part of the
    # sum is not -0.0 (module docstring). Only the others are read, and a step where this rank
    # gave every param a gradient reads nothing on the host.
    unused = find_unused(ranges, grad, sorted(no_grad_here))
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
