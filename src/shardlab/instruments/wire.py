"""Bytes on the wire: what this rank's gloo threads really wrote to their sockets, from the kernel.

The ledger's ``ring_bytes`` is a formula, (N-1)/N × volume × element size: what NCCL's ring
sends on GPUs. This module measures instead. Linux counts, per thread, every byte a thread hands
to ``write``/``writev`` (``wchar`` in ``/proc/self/task/<tid>/io``), and gloo moves its data
only on threads it names: ``pt_gloo_runloop`` (ProcessGroupGloo's workers, which run every
collective, sync or async) and ``gloo_tcp_loop`` (gloo's TCP event loop, which finishes a
``writev`` when a socket's buffer was full). Summing ``wchar`` over those threads counts gloo's
socket writes and nothing else: not the rank's prints and files (the main thread), not
ipyparallel's zmq traffic (its own threads), not the rendezvous store. The process-wide
``/proc/self/io`` would count all of those, so it is not used. Bytes are TCP payload: gloo's
data plus its small message headers (about 50 bytes per message), no IP/TCP headers.

Why trust it: :func:`tcp_bytes_written` counts the same process's socket writes another way,
from each TCP connection's own sequence counters (``getsockopt(TCP_INFO)``: bytes sent minus
retransmitted, plus bytes written but not yet sent). ``tests/test_wire.py`` checks that the two
agree within 2% for every collective kind at 2, 3 and 4 ranks (they agree to the byte). That
count is not the instrument because it counts every TCP socket of the process (the store's,
and a notebook engine's zmq connections to its controller).

What the wire says on gloo (torch 2.13, measured on this course's machine, docs/instruments.md):
all-reduce and all-gather send the ring's bytes; broadcast is a binomial tree (the root sends
the whole buffer to ⌈log2 N⌉ peers, leaves send nothing: the ring's bytes on average over
ranks, not per rank); and **reduce-scatter sends twice the ring's**, 2(N-1)/N × the full
buffer. That is because torch runs a tensor reduce-scatter on gloo as an all-reduce of the
whole input: repository pytorch/pytorch, torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
``ProcessGroupGloo::_reduce_scatter_base`` calls ``reduce_scatter_tensor_coalesced``, which
clones each input, calls ``allreduce`` on the clone, and copies ``chunk(worldSize)[rank]`` into
the output. (It builds ``AllreduceOptions`` with the caller's op but never passes them, which is
also why AVG silently SUMmed there before torch 2.9.) NCCL's reduce-scatter is a ring, so on
GPUs the ring formula is what goes on the wire.

Where the kernel gives no count (macOS has no ``/proc``), a reading is :class:`Unavailable`: it
prints its reason and refuses arithmetic, so only the formula is shown, never a made-up number.
NCCL's traffic (GPU collectives) goes over NVLink, PCIe or InfiniBand, not these sockets, so a
ledger with a CUDA collective says unavailable too.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import struct
import sys
from contextlib import contextmanager

#: The names gloo gives the threads that write its data (c10d's workers, gloo's TCP loop).
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


class WireUnavailableError(RuntimeError):
    """Arithmetic on a wire count that does not exist on this machine."""


class Unavailable:
    """A wire count this machine cannot give, and why. Not a number: arithmetic raises.

    ``bool(x)`` is False, ``str(x)`` and ``f"{x}"`` say ``unavailable (reason)``, and in a
    formatted table column (``f"{x:>12.3f}"``) it prints ``unavailable`` in the column's width.
    """

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other) -> bool:
        return isinstance(other, Unavailable) and other.reason == self.reason

    def __hash__(self) -> int:
        return hash(self.reason)

    def __repr__(self) -> str:
        return f"Unavailable({self.reason!r})"

    def __str__(self) -> str:
        return f"unavailable ({self.reason})"

    def __format__(self, spec: str) -> str:
        if not spec:
            return str(self)
        width = re.match(r"\D*(\d*)", spec).group(1)
        return "unavailable".rjust(int(width) if width else 0)

    def _refuse(self, *_):
        raise WireUnavailableError(f"no wire count here: {self.reason}")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __float__ = __int__ = __lt__ = __gt__ = __le__ = __ge__ = _refuse


def unavailable_reason() -> str | None:
    """Why this machine cannot count wire bytes, or None where it can."""
    if not sys.platform.startswith("linux"):
        return (f"{sys.platform} has no per-thread I/O counters (/proc/self/task/<tid>/io is Linux's): "
                "only the ring formula is available")
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/io"):
        return ("this Linux kernel does not account task I/O (no /proc/self/task/<tid>/io): "
                "only the ring formula is available")
    return None


def _wchar(fd: int) -> int:
    text = os.pread(fd, 1024, 0)  # a /proc file re-reads fresh from offset 0
    start = text.index(b"wchar:") + 6
    return int(text[start:text.index(b"\n", start)])


class GlooWire:
    """This process's gloo threads' bytes written, all process groups together, since creation.

    ``read()`` returns a running total (an int) or :class:`Unavailable`. Each read lists the
    process's threads (a gloo thread born since the last read counts from 0) and re-reads the
    ``io`` file of each gloo thread through a file kept open (about 20 µs a thread).
    ``threads_seen`` says how many gloo threads it found: 0 means nothing ran on gloo.
    """

    def __init__(self):
        self.reason = unavailable_reason()
        self._files: dict[str, int] = {}  # tid -> open /proc/self/task/<tid>/io
        self._last: dict[str, int] = {}  # tid -> wchar at the last read
        self._base: dict[str, int] = {}  # tid -> wchar when first seen (0 if born after us)
        self._other: set[str] = set()  # tids that are not gloo's, named so for good
        self._first_scan = True
        if self.reason is None:
            self.read()

    @property
    def threads_seen(self) -> int:
        return len(self._base)

    @staticmethod
    def _inherited() -> set[str]:
        """Names a new thread carries until it names itself: its creator's (c10d names a gloo
        worker in ``ProcessGroupGloo::runLoop``, after the thread exists, so a scan can land
        between the two). Such a tid is looked at again on every scan, never filed as not gloo's."""
        names = set()
        for path in ("/proc/self/comm", "/proc/thread-self/comm"):
            try:
                with open(path) as f:
                    names.add(f.read().strip())
            except OSError:
                pass
        return names

    def _scan(self) -> None:
        inherited = self._inherited()
        for tid in os.listdir("/proc/self/task"):
            if tid in self._files or tid in self._other:
                continue
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
                if name not in GLOO_THREADS:
                    if name not in inherited:
                        self._other.add(tid)
                    continue
                fd = os.open(f"/proc/self/task/{tid}/io", os.O_RDONLY)
            except OSError:  # the thread ended between listdir and open
                continue
            self._files[tid] = fd
            self._base[tid] = _wchar(fd) if self._first_scan else 0
        self._first_scan = False

    def read(self):
        if self.reason is not None:
            return Unavailable(self.reason)
        self._scan()
        for tid, fd in list(self._files.items()):
            try:
                self._last[tid] = _wchar(fd)
            except (OSError, ValueError):  # the thread ended: keep what it had written
                os.close(self._files.pop(tid))
        return sum(self._last[t] - self._base[t] for t in self._base if t in self._last)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self):
        self.close()


class WireCount:
    """What :func:`count_wire` yields: ``bytes`` (int or :class:`Unavailable`) once the block ends."""

    def __init__(self, meter: GlooWire):
        self._meter = meter
        self._start = meter.read()
        self.bytes = None

    def so_far(self):
        """Bytes gloo's threads wrote since the block began (a live reading)."""
        now = self._meter.read()
        if isinstance(now, Unavailable):
            return now
        if self._meter.threads_seen == 0:
            return Unavailable("no gloo threads in this process: nothing here ran on gloo")
        return now - self._start

    def __repr__(self) -> str:
        return f"<WireCount {self.bytes if self.bytes is not None else 'running'} bytes>"


@contextmanager
def count_wire():
    """Count the bytes this rank's gloo threads write to their sockets inside the block.

    Works around anything, including torch's own ``fully_shard`` (no engine events needed)::

        with count_wire() as wire:
            loss_fn(model(x), y).backward(); optimizer.step()
        wire.bytes          # this rank's bytes on the wire for the step, measured
    """
    meter = GlooWire()
    count = WireCount(meter)
    try:
        yield count
    finally:
        count.bytes = count.so_far()
        meter.close()


# -- the independent count: each TCP connection's own sequence counters ------------------------
# struct tcp_info (include/uapi/linux/tcp.h): tcpi_notsent_bytes (u32) at byte 144,
# tcpi_bytes_sent (u64) at 200 and tcpi_bytes_retrans (u64) at 208, Linux >= 4.19.
_NOTSENT, _SENT, _RETRANS, _TCP_INFO_LEN = 144, 200, 208, 216


def tcp_bytes_written():
    """Bytes written to every TCP socket this process has open, by the kernel's TCP counters.

    Per connection: bytes sent, less those sent again (retransmits), plus those written but
    still queued (not yet sent), i.e. what the program wrote. A different mechanism from the
    threads' ``wchar``, used by the tests to check :class:`GlooWire`; it also counts the
    rendezvous store's and any zmq socket's bytes, so it is a cross-check, not the instrument.
    A connection's counters go with it when it closes, so read it while every rank is still in
    the process group (a barrier after the last reading): a peer that leaves early takes them.
    """
    if not hasattr(socket, "TCP_INFO") or not os.path.isdir("/proc/self/fd"):
        return Unavailable(f"no TCP_INFO socket counters on {sys.platform}")
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(int(fd))  # a duplicate: closing it leaves the program's fd open
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EBADF):  # closed since listdir (listdir's own fd)
                continue
            raise
        with socket.socket(fileno=dup) as sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) < _TCP_INFO_LEN:
                return Unavailable("this kernel's tcp_info has no tcpi_bytes_sent (Linux < 4.19)")
            (notsent,) = struct.unpack_from("I", info, _NOTSENT)
            sent, retrans = struct.unpack_from("QQ", info, _SENT)
            total += sent - retrans + notsent
    return total
