"""Scheduling policies: which stream an op runs on. Nothing else.

Dependencies between streams are tracked elsewhere (per buffer), so a policy is free
to spread work: any stream choice is correct, the choice only affects overlap. A
policy owns its streams; a dropped policy's streams are destroyed once their work is
done (see :class:`~trio_cuda.Stream`).
"""

from __future__ import annotations

import abc
import itertools
import threading
from dataclasses import dataclass

from ._checks import as_int
from ._device import Device, set_default_policy_factory
from ._errors import DeviceError
from ._guard import LOCK, check_not_forked, lock_acquire, lock_release
from ._loop import current_task
from ._registry import as_device
from ._stream import Stream

__all__ = ["PoolStatistics", "SchedulingPolicy", "SingleStream", "StreamPoolByLoad", "StreamPoolRoundRobin"]

#: How many streams the default policy grows its pool to (see StreamPoolByLoad).
MAX_STREAMS = 16
# Streams whose newest event one choice may ask the driver about: one (the next from the
# cursor, the least recently handed out). When every stream is busy, as with many tasks
# on few streams, the asks find nothing and each costs a driver query.
_ASK = 1
_HANDED_FOR = 64  # choices after which a stream handed out and given no work counts as idle again


class SchedulingPolicy(abc.ABC):
    """Decides the stream of each submission (and of each independent ``zip`` branch).

    Attributes:
        device: The device whose streams this policy hands out.
    """

    device: Device

    @abc.abstractmethod
    def next_stream(self) -> Stream:
        """The stream for the next submission or independent branch (any thread)."""

    def submission_stream(self) -> Stream:
        """The stream for a submission that names none (``await op``, ``op.sync()``,
        ``lowlevel.submit(op)``); independent branches inside it use :meth:`next_stream`.
        By default :meth:`next_stream` (any thread)."""
        return self.next_stream()

    @property
    @abc.abstractmethod
    def streams(self) -> tuple[Stream, ...]:
        """Every stream the policy may return."""


class StreamPoolRoundRobin(SchedulingPolicy):
    """Rotates over a fixed pool of streams so independent work overlaps (the reference's
    policy; the default is :class:`StreamPoolByLoad`).

    A submission goes to the stream the previous submission got while that stream is
    known to be idle (everything on it seen complete), and to the next stream of the
    pool otherwise: work submitted while earlier work still runs is spread, one await
    after another stays on one stream (measured on an H200: ~3 us less per await than
    moving to an idle stream each time). Independent branches of one submission always
    rotate.

    Args:
        device: The device (default: the current device).
        num_streams: Size of the pool (default 4).
    """

    def __init__(self, device: Device | int | None = None, num_streams: int = 4) -> None:
        n = as_int(num_streams, "num_streams", minimum=1)
        self.device = as_device(device)
        self._streams = tuple(self.device.create_stream() for _ in range(n))
        # itertools.cycle's __next__ is one C call: atomic under the GIL, no lock needed.
        self._next = itertools.cycle(self._streams).__next__
        self._last: Stream | None = None  # a race only picks another stream: any choice is correct

    def next_stream(self) -> Stream:
        return self._next()

    def submission_stream(self) -> Stream:
        last = self._last
        if last is not None and last.seq <= last.done_seq:
            return last
        s = self._last = self._next()
        return s

    @property
    def streams(self) -> tuple[Stream, ...]:
        return self._streams

    def __repr__(self) -> str:
        return f"StreamPoolRoundRobin(device={self.device.ordinal}, num_streams={len(self._streams)})"


class SingleStream(SchedulingPolicy):
    """Pins all work to one stream: everything runs in submission order.

    Args:
        device: The device (default: the current device, or the stream's device).
        stream: The stream to use (default: a new stream of the device).
    """

    def __init__(self, device: Device | int | None = None, stream: Stream | None = None) -> None:
        if stream is not None:
            if not isinstance(stream, Stream):
                raise TypeError(f"expected a Stream, got {stream!r}")
            if device is not None and as_device(device) is not stream.device:
                raise ValueError("the stream belongs to another device")
            self.device = stream.device
            self._stream = stream
        else:
            self.device = as_device(device)
            self._stream = self.device.create_stream()

    def next_stream(self) -> Stream:
        return self._stream

    @property
    def streams(self) -> tuple[Stream, ...]:
        return (self._stream,)

    def __repr__(self) -> str:
        return f"SingleStream(device={self.device.ordinal})"


@dataclass(frozen=True)
class PoolStatistics:
    """How :class:`StreamPoolByLoad` chose its streams (counts since it was made).

    Attributes:
        streams: Streams in the pool now.
        kept: Submissions that stayed on the stream of their task's previous one (it was
            idle, or the pool was at its cap and the work pending there was that task's own).
        idle: Submissions (and independent branches) moved to a stream known to be idle.
        grown: Streams added to the pool because none was idle.
        shared: Choices that had to share a stream with another task's pending work
            (every stream busy, the pool at its cap): the least loaded one.
        asked: Driver queries a choice made, with no stream known idle, about a
            stream's newest work (one a choice at most; those that found it done
            count in ``idle`` too).
    """

    streams: int
    kept: int
    idle: int
    grown: int
    shared: int
    asked: int


def _owner() -> int:
    """Who submits: the current trio or asyncio task, or else the calling thread (an id:
    a policy must not keep tasks alive; a reused id only costs a less good choice)."""
    task = current_task()
    return id(task) if task is not None else threading.get_ident()


class StreamPoolByLoad(SchedulingPolicy):
    """Chooses streams by what is pending on them (the default policy).

    A task's submission stays on the stream of its previous one while that stream is
    idle: one await after another needs no cross-stream wait. Otherwise it goes to a
    stream known to be idle (everything on it seen complete), so it never queues behind
    pending work while such a stream exists; with none idle the pool grows by one
    stream, up to ``max_streams``; at the cap a task stays on its previous stream if all
    the work pending there is its own, else it takes the stream with the least pending
    work.
    Independent branches of one submission (``zip``) each take an idle stream the same
    way, so they overlap. Dependencies between streams are ordered by the runtime
    whatever the choice (per buffer).

    "Idle" is what polls have seen; when no stream is known idle, the driver is asked
    about the newest work of one stream, the next in rotation (work nobody awaits is
    seen done only so; with every stream busy more asks would only cost queries). A
    stream handed out and given no work yet is not idle (a zip's branches get distinct
    streams).

    Args:
        device: The device (default: the current device).
        num_streams: Streams in use from the start (default 4).
        max_streams: The most the pool grows to (default 16). All are made at once, the
            rest kept for growing: making a CUDA stream can block the calling thread
            until the work running on the device completes. CUDA maps streams onto
            ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (8 unless set), so more
            streams than that may wait for each other in hardware.
    """

    def __init__(self, device: Device | int | None = None, num_streams: int = 4, max_streams: int = MAX_STREAMS) -> None:
        n = as_int(num_streams, "num_streams", minimum=1)
        cap = as_int(max_streams, "max_streams", minimum=1)
        if cap < n:
            raise ValueError(f"max_streams ({cap}) must be at least num_streams ({n})")
        self.device = as_device(device)
        self._pool = _Pool(self.device, n, cap)

    def submission_stream(self) -> Stream:
        return self._pool.submission_stream()

    def next_stream(self) -> Stream:
        return self._pool.next_stream()

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of how streams were chosen."""
        pool = self._pool
        with LOCK:
            return PoolStatistics(len(pool.streams), pool.kept, pool.idle, pool.grown, pool.shared, pool.asked)

    @property
    def streams(self) -> tuple[Stream, ...]:
        with LOCK:
            return tuple(self._pool.streams)

    def __repr__(self) -> str:
        return f"StreamPoolByLoad(device={self.device.ordinal}, streams={len(self._pool.streams)}, max_streams={self._pool.cap})"


class _Pool:
    """What :class:`StreamPoolByLoad` knows of its streams, and its choices (a class of
    its own, so that compiled its fields are typed: the choice runs on every await)."""

    __slots__ = (
        "asked",
        "cap",
        "choices",
        "cursor",
        "device",
        "grown",
        "handed",
        "handed_at",
        "idle",
        "kept",
        "of",
        "owners",
        "shared",
        "spare",
        "streams",
    )

    def __init__(self, device: Device, n: int, cap: int) -> None:
        self.device = device
        self.cap = cap
        self.streams: list[Stream] = [device.create_stream() for _ in range(n)]
        # The streams it may grow by, made now: the pool grows while every stream is busy,
        # and making a CUDA stream can block the calling thread (the event loop's) until
        # the work running on the device completes.
        self.spare: list[Stream] = [device.create_stream() for _ in range(cap - n)]
        self.owners: list[int] = [0] * n  # who submitted last to each stream
        # Each stream's seq when it was last handed out: a stream handed out and not yet
        # given work (a submission being planned, a zip's other branches) is not idle.
        self.handed: list[int] = [-1] * n
        self.choices = 0  # choices made (a hand-out lapses after _HANDED_FOR of them)
        self.handed_at: list[int] = [0] * n
        self.of: dict[int, int] = {}  # owner -> index of its last stream
        self.cursor = 0
        self.kept = 0
        self.idle = 0
        self.grown = 0
        self.shared = 0
        self.asked = 0

    def submission_stream(self) -> Stream:
        me = _owner()
        lock_acquire()  # (re-entrant: callers may hold it)
        try:
            i = self.of.get(me, -1)
            if i >= 0:
                s = self.streams[i]
                if s.seq <= s.done_seq:  # its last stream, idle: stay (no cross-stream wait)
                    self.hand_out(i, me)
                    self.kept += 1
                    return s
            return self.choose(me, i)
        finally:
            lock_release()

    def next_stream(self) -> Stream:
        me = _owner()
        with LOCK:
            return self.choose(me, -1)

    def choose(self, me: int, own: int) -> Stream:
        """An idle stream (rotating from the cursor); else a new stream; else ``own``
        (the index of the task's last stream, -1: none) while its pending work is the
        task's alone; else the least loaded (under LOCK)."""
        streams = self.streams
        n = len(streams)
        start = self.cursor
        self.choices += 1
        pick = -1
        for k in range(n):
            i = (start + k) % n
            s = streams[i]
            if s.seq <= s.done_seq and not self.reserved(i):
                pick = i
                self.idle += 1
                break
        if pick < 0:
            # None known idle: ask the driver about a few streams' newest work (work that
            # finished is seen only when something polls it; fire-and-forget never is).
            check_not_forked()  # (a forked child reaches no driver: ForkedProcessError)
            asked = 0
            for k in range(n):
                i = (start + k) % n
                s = streams[i]
                if self.reserved(i) or s.capture is not None or s.handle is None:
                    continue
                dev = s.device
                if s.generation != dev.generation or dev._resetting:
                    continue  # (a reset is under way: no driver calls on its streams)
                self.asked += 1
                try:
                    idle = dev.poll(s.event_at(s.seq))  # (an event of its newest point)
                except DeviceError:
                    idle = False
                if idle:
                    pick = i
                    self.idle += 1
                    break
                asked += 1
                if asked == _ASK:
                    break
        if pick < 0 and self.spare:  # (below the cap: the streams and the spares make it up)
            streams.append(self.spare.pop())
            self.owners.append(0)
            self.handed.append(-1)
            self.handed_at.append(0)
            pick = n
            self.grown += 1
        if pick < 0 and own >= 0 and self.owners[own] == me:
            pick = own
            self.kept += 1
        if pick < 0:
            best = None
            for i in range(n):
                s = streams[i]
                load = s.seq - s.done_seq + self.reserved(i)  # (handed out: work is coming)
                if best is None or load < best or (load == best and self.owners[i] == me):
                    best, pick = load, i
            self.shared += 1
        self.cursor = pick + 1
        self.hand_out(pick, me)
        if len(self.of) > 4096:  # owners come and go: forget the old ones
            self.of.clear()
        self.of[me] = pick
        return streams[pick]

    def reserved(self, i: int) -> bool:
        """Stream ``i`` was handed out and has been given no work since, within the last
        _HANDED_FOR choices (later, a submission that enqueued nothing or was cancelled)."""
        return self.handed[i] == self.streams[i].seq and self.handed_at[i] >= self.choices - _HANDED_FOR

    def hand_out(self, i: int, me: int) -> None:
        """Note that stream ``i`` goes to ``me`` now."""
        self.owners[i] = me
        self.handed[i] = self.streams[i].seq
        self.handed_at[i] = self.choices


set_default_policy_factory(StreamPoolByLoad)
