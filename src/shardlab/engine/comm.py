"""The only door to the network: every collective the engine issues goes through here.

Four collectives are all ZeRO and FSDP need, each on a flat 1-D buffer:

* ``all_gather``     every rank contributes its shard, every rank receives the full buffer;
* ``reduce_scatter`` every rank contributes a full buffer, every rank receives the SUM of its shard;
* ``all_reduce``     every rank contributes a full buffer, every rank receives the full SUM;
* ``broadcast``      rank ``src`` sends a buffer to all.

We always reduce with SUM and let the caller divide, because ``ReduceOp.AVG`` is missing or
silently wrong on gloo in several torch releases. Each call emits an ``events.COMM`` event when
issued (kind, ``numel`` of the full buffer, dtype, device, world size, unit, start) and
``events.COMM_DONE`` when it lands (+ end), or ``events.COMM_FAILED`` if it raises instead
(+ error), so that the instruments (:mod:`shardlab.instruments.traffic`,
:mod:`shardlab.instruments.timeline`, :mod:`shardlab.instruments.link`) can count, time and slow
down traffic without the engine knowing.
From its issue until it lands, a collective is listed by :func:`in_flight` with the buffers it
reads and writes, so that :mod:`shardlab.instruments.memory` counts them at every event between,
the two events of the collective itself included.

The rest of the package lines its ranks up through here too (``barrier``, ``all_reduce_max``,
``gather_lists``): bookkeeping, not training traffic, so those emit no event. No module outside
this one calls a ``torch.distributed`` collective (``tests/test_layout_rules.py`` checks it).
"""

from __future__ import annotations

import itertools
import time
import weakref

import torch
import torch.distributed as dist

from shardlab.engine import events

# torch >= 2.12 names the tensor-native collectives *_single; the older names warn in 2.13.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """An issued collective. ``wait()`` blocks until its result is in place (once), or raises
    if the call failed at an earlier wait: a failed call never reads as landed.

    It holds the buffers it reads and writes (``buffers``) until it has landed: gloo and NCCL
    read them after an async call returns. It is listed by :func:`in_flight` from *before* its
    ``COMM`` event until *after* its ``COMM_DONE`` event: a memory sample taken at either event
    sees the buffers, which are allocated then. (Registered any later, the sample at a
    reduce-scatter's own issue would miss the gradient buffer just packed for it, which the
    engine has not yet queued.) A call that raises leaves the list *before* its ``COMM_FAILED``
    event: it holds nothing in flight any more.

    ``unit`` is the name the events carry; ``owner`` the unit object itself, held weakly. Two
    models of one architecture have units of the same names, so the memory tally matches a
    collective to a unit by ``owner``, never by name.
    """

    def __init__(self, kind: str, unit, buffers: tuple, owner=None):
        self.kind, self.unit = kind, unit
        self._owner = weakref.ref(owner) if owner is not None else None
        self._buffers = buffers
        self._work = None
        self._event: dict | None = None
        self._error: str | None = None  # why it failed, for a later wait() (text: no frames kept)
        self._number = next(_issued)
        _live[self._number] = self  # weakly: a Pending nobody holds leaves the list by itself

    @property
    def owner(self):
        """The unit whose collective this is (None: no unit's, or a unit no longer alive)."""
        return self._owner() if self._owner is not None else None

    def announce(self, event: dict) -> None:
        """Emit the ``COMM`` event; ``wait()`` emits its ``COMM_DONE``, with ``end`` added."""
        self._event = event
        events.emit(events.COMM, **event)

    def started(self, work) -> None:
        """The backend's handle of an async call: ``wait()`` waits on it."""
        self._work = work

    def wait(self) -> None:
        """Block until the result is in place, then emit ``COMM_DONE``; raise if it never will."""
        if self._error is not None:  # waiting again must not say it landed
            of = f" of {self.unit}" if self.unit else ""
            why = (f"this {self.kind}{of} failed earlier ({self._error}): its result never arrived. "
                   "Parallelize a fresh model; after a timeout or a lost rank, restart the ranks "
                   "(or the cluster) first: the process group is broken")
            raise RuntimeError(why) from None
        if self._work is not None:
            # A timeout, a rank gone: it never landed. An interrupt (not an Exception) leaves it
            # in flight instead: the call may still land, and a later wait() waits again.
            try:
                self._work.wait()
            except Exception as exc:
                self._failed(exc)
                raise
            self._work = None
        try:
            if self._event is not None:
                event, self._event = self._event, None
                event["end"] = time.perf_counter()
                events.emit(events.COMM_DONE, **event)  # an interrupt may come out of a listener
        finally:  # landed either way: not in flight, and the caller keeps what it still needs
            self._buffers = ()
            _live.pop(self._number, None)

    def _failed(self, exc: BaseException) -> None:
        """The call raised: it is not in flight, whoever still holds it (a traceback's frame).

        An announced call emits ``COMM_FAILED``, so that a ledger or an emulated link that booked
        its ``COMM`` takes the booking back: it never landed, so no call is counted as made.
        """
        self._error = f"{type(exc).__name__}: {exc}"
        event, self._buffers, self._work, self._event = self._event, (), None, None
        _live.pop(self._number, None)
        if event is not None:
            events.emit(events.COMM_FAILED, **event, error=self._error)

    @property
    def buffers(self) -> tuple:
        """The buffers this collective reads or writes, until it has landed (then empty)."""
        return self._buffers


_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # issue number -> Pending
_issued = itertools.count()


def in_flight() -> list[Pending]:
    """The collectives issued and not yet landed on this rank, oldest first (each with
    ``kind``, ``unit``, ``owner`` and ``buffers``). Memory instruments count their buffers."""
    return [p for _, p in sorted(_live.items())]


def _issue(kind, fn, out, inp, *, unit, owner, async_op, **kw) -> Pending:
    pending = Pending(kind, unit, tuple(t for t in (out, inp) if t is not None), owner)
    try:
        if events.active():
            pending.announce(dict(
                kind=kind,
                numel=(inp if kind == "reduce_scatter" else out).numel(),  # the full buffer
                dtype=out.dtype,
                device=out.device.type,  # cuda: NCCL carries it, no socket of this process does
                world_size=dist.get_world_size(),
                unit=unit,
                start=time.perf_counter(),
                phase=events.phase,
            ))
        work = fn(*pending.buffers, async_op=async_op, **kw)
    except BaseException as exc:
        pending._failed(exc)
        raise
    if async_op:
        pending.started(work)
    else:
        pending.wait()
    return pending


def all_gather(full: torch.Tensor, shard: torch.Tensor, *, unit=None, owner=None, async_op=False) -> Pending:
    """Fill ``full`` (N x len(shard) elements) with every rank's ``shard``, in rank order.

    ``unit``: the name the events carry; ``owner``: the unit object (the memory tally's match)."""
    return _issue("all_gather", _all_gather, full, shard, unit=unit, owner=owner, async_op=async_op)


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, *, unit=None, owner=None, async_op=False) -> Pending:
    """Put into ``shard`` this rank's slice of the SUM over ranks of ``full``. Caller divides."""
    return _issue("reduce_scatter", _reduce_scatter, shard, full, unit=unit, owner=owner, async_op=async_op,
                  op=dist.ReduceOp.SUM)


def all_reduce(tensor: torch.Tensor, *, unit=None, owner=None, async_op=False) -> Pending:
    """Replace ``tensor`` by its SUM over ranks, in place. Caller divides."""
    return _issue("all_reduce", dist.all_reduce, tensor, None, unit=unit, owner=owner, async_op=async_op,
                  op=dist.ReduceOp.SUM)


def broadcast(tensor: torch.Tensor, src: int = 0, *, unit=None, owner=None) -> Pending:
    """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
    return _issue("broadcast", dist.broadcast, tensor, None, unit=unit, owner=owner, async_op=False, src=src)


# -- bookkeeping: what the instruments, the course and the bench need to line ranks up -----------
# These move no training data, so they emit no event: no ledger counts them and no emulated link
# slows them. Like every collective here they give up after the process group's timeout, set
# when the rank joined (:func:`shardlab.launch.init_rank`), rather than hang.


def dist_ready() -> bool:
    """True when this process is in a process group (False alone in a notebook, without ranks)."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait until every rank gets here, so that what follows starts together (no-op without ranks)."""
    if dist_ready():
        dist.barrier()


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Replace ``tensor`` by its elementwise MAX over ranks, in place, and return it.

    For bookkeeping such as "the slowest rank's time" (a collective ends when its last rank
    does). MAX, unlike AVG, is exact on every backend, so there is no sum to divide here.
    """
    if dist_ready():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def gather_lists(items: list) -> list:
    """Every rank's Python ``items`` concatenated in rank order, on every rank (no-op on one process).

    The instruments use it to pool what each rank recorded. It is bookkeeping, not training
    traffic, so it emits no event and no ledger counts it.
    """
    if not dist_ready() or dist.get_world_size() == 1:
        return list(items)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(items))
    return [x for rank_items in everyone for x in rank_items]
