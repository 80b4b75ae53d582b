"""Pretend the ranks talk over a slower network: slow-link emulation for every engine collective.

On one machine the ranks talk through loopback memory, so communication looks almost free and
ZeRO-3's extra gathers cost nothing. ``emulate_link`` makes each collective take as long as a
link of a given bandwidth and latency would need, by the textbook ring cost (α-β model)::

    all_gather, reduce_scatter   (N-1)·α  +  (N-1)/N · bytes / β
    all_reduce                  2(N-1)·α + 2(N-1)/N · bytes / β      (= reduce-scatter + all-gather)
    broadcast                    (N-1)·α  +           bytes / β      (pipelined ring broadcast)

``bytes`` is the FULL buffer (N shards), α the per-message latency, β the per-direction
bandwidth of each rank's link. One rank sends nothing, so N = 1 costs nothing.

The emulated link charges the RING's bytes, as NCCL would, not the bytes gloo really writes
on loopback. They differ: gloo runs a reduce-scatter as an all-reduce of the full buffer, twice
the ring's bytes, and its broadcast is a tree (:mod:`shardlab.instruments.wire` measures both).
Charging gloo's bytes would make ZeRO-1/2/3 look dearer on the emulated cluster than on a real
GPU one, whose NCCL reduce-scatter is a ring; so the link models the network the course is
about, and the ledger's ``wire_bytes`` shows what this machine's loopback carried instead.

Why sleep when the collective completes (``comm_done``) and not when it is issued: a transfer
on a real link starts when it is issued and runs while the rank computes; an async op only
blocks at ``wait()``. Sleeping at issue would block the issuing thread and make overlap
(prefetch) look useless. So at issue we book the transfer on this rank's link, which carries
one transfer at a time (two gathers in flight share it), and at completion we sleep only until
the booked finish time. Compute done in between hides the transfer, as on a real network; a
synchronous op simply takes ``max(loopback time, link time)``. ``overlap=False`` is the
pessimistic bound instead: every op sleeps its full link time on completion, hiding nothing.
A call that raises instead (``comm_failed``) is taken off the link: the calls queued behind it are
booked again without it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from shardlab.engine import events


@dataclass(frozen=True)
class Link:
    """A named link: per-direction bandwidth in Gbit/s (10^9 bits/s) and per-message latency in µs."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    note: str = ""


#: Every network the course names, in one table: per GPU and direction inside a node (NVLink),
#: per NIC and direction between nodes. Round numbers of the right order of magnitude from the
#: vendors' data sheets, for teaching; not benchmarks. The planner (``shardlab.planner``) reads
#: it too; how many NICs a node has is the planner's cluster's business, not the link's.
NETWORKS = {
    "nvlink2": Link("NVLink 2 (V100)", 1200.0, 2.0, "V100 SXM2: 6 NVLink 2 links, 150 GB/s per GPU per direction"),
    "nvlink3": Link("NVLink 3 (A100)", 2400.0, 2.0, "A100 SXM: 12 NVLink 3 links, 300 GB/s per GPU per direction"),
    "nvlink4": Link("NVLink", 3600.0, 2.0, "NVLink 4 (H100 SXM): 450 GB/s per direction, ~2 µs per hop inside a node"),
    "ib-hdr": Link("InfiniBand HDR", 200.0, 5.0, "one 200 Gbit/s HDR NIC (25 GB/s)"),
    "ib-ndr": Link("InfiniBand", 400.0, 5.0, "NDR InfiniBand, one 400 Gbit/s NIC per GPU, ~5 µs through NCCL"),
    "100gbe": Link("100 Gb Ethernet", 100.0, 20.0, "one 100 Gbit/s Ethernet NIC, RoCE or TCP"),
    "25gbe": Link("25 Gb Ethernet", 25.0, 30.0, "one 25 Gbit/s Ethernet NIC, TCP"),
    "10gbe": Link("10GbE", 10.0, 50.0, "10 Gigabit Ethernet with TCP: ~50 µs per message"),
    "1gbe": Link("1GbE", 1.0, 100.0, "Gigabit Ethernet with TCP: ~100 µs per message"),
}
_OTHER_NAMES = {"nvlink": "nvlink4", "infiniband": "ib-ndr", "ndr": "ib-ndr", "hdr": "ib-hdr"}


def find_link(name_or_link) -> Link:
    """A :class:`Link` by any of its names, in any case: 'ib-ndr', 'InfiniBand', '10GbE', 'nvlink3'.

    A Link passes through. One lookup for the emulator and the planner, so every name works in both.
    """
    if isinstance(name_or_link, Link):
        return name_or_link
    key = str(name_or_link).lower().replace(" ", "")
    key = _OTHER_NAMES.get(key, key)
    if key not in NETWORKS:
        raise ValueError(f"unknown link {name_or_link!r}; choose one of {sorted(NETWORKS)}")
    return NETWORKS[key]


#: The four links the course emulates on this machine (notebook 05, ``python -m shardlab slow-link``).
LINKS = {name: find_link(name) for name in ("NVLink", "InfiniBand", "10GbE", "1GbE")}

_ITEMSIZE = {
    "float64": 8, "double": 8, "fp64": 8, "int64": 8, "long": 8,
    "float32": 4, "float": 4, "fp32": 4, "int32": 4, "int": 4,
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def _itemsize(dtype_or_itemsize) -> int:
    """Bytes per element from an int, a torch/numpy dtype, or a name like 'bf16'."""
    d = dtype_or_itemsize
    if isinstance(d, int) and not isinstance(d, bool):
        size = d
    elif hasattr(d, "itemsize"):
        size = int(d.itemsize)
    elif isinstance(d, str) and d.lower().removeprefix("torch.") in _ITEMSIZE:
        size = _ITEMSIZE[d.lower().removeprefix("torch.")]
    else:
        raise ValueError(f"cannot tell the element size of {d!r}; pass bytes per element or a dtype")
    if size <= 0:
        raise ValueError(f"element size must be positive, got {size}")
    return size


def _check_link(bandwidth_gbps, latency_us):
    if not isinstance(bandwidth_gbps, (int, float)) or isinstance(bandwidth_gbps, bool) or not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth_gbps must be a positive number (Gbit/s), got {bandwidth_gbps!r}")
    if not isinstance(latency_us, (int, float)) or isinstance(latency_us, bool) or not latency_us >= 0:
        raise ValueError(f"latency_us must be a number >= 0 (µs), got {latency_us!r}")


def link_delay(kind, numel, dtype_or_itemsize, world_size, bandwidth_gbps, latency_us) -> float:
    """Seconds a ring collective of ``kind`` on a FULL buffer of ``numel`` elements costs on the link."""
    _check_link(bandwidth_gbps, latency_us)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    n = world_size
    if n == 1:
        return 0.0
    alpha = latency_us * 1e-6
    seconds_per_byte = 8 / (bandwidth_gbps * 1e9)
    nbytes = numel * _itemsize(dtype_or_itemsize)
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * alpha + (n - 1) / n * nbytes * seconds_per_byte
    if kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * seconds_per_byte
    if kind == "broadcast":
        return (n - 1) * alpha + nbytes * seconds_per_byte
    raise ValueError(f"unknown collective {kind!r}; expected all_gather, reduce_scatter, all_reduce or broadcast")


@dataclass
class _Booking:
    """One transfer on the link: issued at ``start``, ``cost`` seconds long, done at ``finish``;
    ``landed`` once its ``comm_done`` came (its slot is then fixed: the link did carry it).
    Booked under its call's (kind, start, unit): perf_counter starts tell calls apart."""

    start: float
    cost: float
    finish: float
    landed: bool = False


class LinkEmulator:
    """The listener behind :func:`emulate_link`; also the object it yields, with what it added.

    ``link_time_s`` is what the link needed in total; ``slept_s`` the part that was not hidden
    behind loopback time or compute, i.e. what the emulation actually added to the run;
    ``free_at`` when the link has carried every transfer booked on it (perf_counter time).
    """

    def __init__(self, link: Link, overlap: bool = True):
        self.link = link
        self.overlap = overlap
        self.ops = 0
        self.link_time_s = 0.0
        self.slept_s = 0.0
        self.free_at = 0.0
        # The bookings in issue order, from the oldest that has not landed: when a call raises,
        # the queue is booked again without it (_unbook). A call never waited for (a prefetch left
        # hanging) holds every later booking here until the block ends: a few floats a call.
        self._queue: dict[tuple, _Booking] = {}
        # When the link was free before the queue's first booking (free_at, when it is empty).
        self._free_before_queue = 0.0
        self._lock = threading.Lock()

    def delay(self, fields: dict) -> float:
        return link_delay(fields["kind"], fields["numel"], fields["dtype"], fields["world_size"],
                          self.link.bandwidth_gbps, self.link.latency_us)

    def _book(self, key: tuple, fields: dict) -> _Booking:
        """Put the transfer on the link, behind every transfer booked before it (one at a time)."""
        cost = self.delay(fields)
        self.free_at = max(fields["start"], self.free_at) + cost
        self.ops += 1
        self.link_time_s += cost
        booking = self._queue[key] = _Booking(fields["start"], cost, self.free_at)
        return booking

    def _drop_landed_head(self) -> None:
        """Landed bookings at the queue's head are history: no failure behind them can move them."""
        while self._queue:
            key, head = next(iter(self._queue.items()))
            if not head.landed:
                return
            self._free_before_queue = self._queue.pop(key).finish

    def _unbook(self, key: tuple) -> None:
        """A booked call raised: take its cost back, and book the queue again without it. A call
        still queued can only move earlier; one that has landed keeps its slot (it did use the
        link then), and the calls behind it stay behind it."""
        if key not in self._queue:
            return
        failed = self._queue.pop(key)
        self.ops -= 1
        self.link_time_s -= failed.cost
        free = self._free_before_queue
        for booking in self._queue.values():
            if not booking.landed:
                booking.finish = max(booking.start, free) + booking.cost
            free = booking.finish
        self.free_at = free
        self._drop_landed_head()

    def __call__(self, name: str, fields: dict) -> None:
        if name not in (events.COMM, events.COMM_DONE, events.COMM_FAILED):
            return
        key = (fields["kind"], fields["start"], fields.get("unit"))
        with self._lock:
            if name == events.COMM:
                self._book(key, fields)
                return
            if name == events.COMM_FAILED:
                self._unbook(key)
                return
            booking = self._queue.get(key)
            if booking is None:  # issued before the emulation started: book it now
                booking = self._book(key, fields)
            booking.landed = True
            self._drop_landed_head()
            wait = booking.finish - time.perf_counter() if self.overlap else booking.cost
        if wait > 0:
            time.sleep(wait)
            self.slept_s += wait
            fields["end"] = time.perf_counter()  # later listeners (ledger, trace) see the slow link


_active: LinkEmulator | None = None


@contextmanager
def emulate_link(bandwidth_gbps=None, latency_us=None, preset=None, *, overlap=True):
    """Make every engine collective inside the block cost what it would on a slower link.

    ``emulate_link("10GbE")`` uses a network of :data:`NETWORKS` (any name :func:`find_link` knows); ``emulate_link(bandwidth_gbps=1,
    latency_us=100)`` a custom link; ``emulate_link(preset="1GbE", latency_us=0)`` a preset with
    an override. Bandwidth is in Gbit/s per direction. ``overlap=False`` adds every op's full
    link time, hiding none of it behind compute (see the module docstring). Yields a
    :class:`LinkEmulator` whose ``link_time_s`` and ``slept_s`` say what the link cost. One
    emulated link at a time.
    """
    global _active
    if isinstance(bandwidth_gbps, str):
        if preset is not None:
            raise ValueError("give the preset once: emulate_link('10GbE') or emulate_link(preset='10GbE')")
        preset, bandwidth_gbps = bandwidth_gbps, None
    if preset is not None:
        base = find_link(preset)
        bandwidth_gbps = base.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps
        latency_us = base.latency_us if latency_us is None else latency_us
        name = preset
    elif bandwidth_gbps is None:
        raise ValueError(f"give a bandwidth_gbps or a preset (one of {list(LINKS)})")
    else:
        name = "custom"
    latency_us = 0.0 if latency_us is None else latency_us
    _check_link(bandwidth_gbps, latency_us)
    if _active is not None:
        raise RuntimeError(f"a link is already emulated ({_active.link.name}); leave that block first")
    emulator = LinkEmulator(Link(name, float(bandwidth_gbps), float(latency_us)), overlap=bool(overlap))
    _active = emulator
    try:
        with events.listen(emulator, first=True):
            yield emulator
    finally:
        _active = None


def fit_link(kind: str, sizes_bytes, seconds, world_size: int) -> Link:
    """The α-β link that best explains measured collective times (least squares).

    ``sizes_bytes`` are FULL buffer sizes and ``seconds`` the measured time of one ``kind``
    collective on each. The ring model is linear in the size, t = a + b·bytes, with
    a = (N-1)·α and b = (N-1)/N · 8/β for all-gather and reduce-scatter (twice both for
    all-reduce), so a straight-line fit gives α and β back: feed the result to
    :func:`link_delay` or :func:`emulate_link` to predict a step on that network.
    """
    xs, ys = [float(s) for s in sizes_bytes], [float(t) for t in seconds]
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("fit_link needs times for at least two different sizes")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"fit_link needs world_size >= 2 (one rank sends nothing), got {world_size!r}")
    hops = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}.get(kind)
    if hops is None:
        raise ValueError(f"fit_link fits all_gather, reduce_scatter or all_reduce, not {kind!r}")
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if not slope > 0:
        raise ValueError("the measured times do not grow with the size: measure larger buffers")
    ring = hops * (world_size - 1) / world_size
    bandwidth_gbps = ring * 8 / slope / 1e9
    latency_us = max(0.0, intercept / (hops * (world_size - 1))) * 1e6
    return Link(f"fitted {kind}", bandwidth_gbps, latency_us, f"fitted to {n} sizes on {world_size} ranks")
