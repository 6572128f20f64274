"""Devices: streams, memory, events, faults and reset of one GPU (or simulated GPU).

``Device`` objects are per-process singletons obtained from :func:`trio_cuda.devices`,
:func:`trio_cuda.device` or :func:`trio_cuda.current_device`.

Ownership. A device owns its driver, its generation (bumped by :meth:`Device.reset`),
its streams' driver handles, its pooled events, its memory accounting and deferred
frees. All of it changes only under the runtime lock (:data:`trio_cuda._guard.LOCK`).
Finalizers (of buffers, streams, events) never lock: they append to lock-free queues
that the device drains under the lock at its next operation.

Reset contract. :meth:`Device.reset` first bumps the generation (under the lock), so
every event, buffer, graph and waiter of the old generation knows it is stale; wakes
every waiter (blocking and trio) so each raises :class:`DeviceReset`; waits for host
reads of pinned memory in progress; and only then resets the driver (under the
device's slow lock, not the runtime lock: other devices keep working meanwhile).
Submissions to a device being reset are refused at once with DeviceUnavailable.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from . import _reclaim, _reset
from ._backends._boundary import DeviceDriver, Waker
from ._device_stats import Counters, DeviceStatistics
from ._errors import DeviceError, DeviceFault, DeviceOutOfMemory, DeviceReset, DeviceUnavailable, fresh
from ._guard import LOCK, check_blocking_allowed, check_not_forked, lock_acquire, lock_release
from ._staging import drain as _staging_drain
from ._stream import Event, Stream, dropped_stream

__all__ = ["Device", "DeviceStatistics", "set_default_policy_factory"]

_SPIN_NS = 100_000  # a blocking wait spins this long before sleeping on a waker
_REPOLL_S = 0.02  # a sleeping wait re-polls this often (a faulted device posts nothing)


# Polls answer from the stream where they can (see Device.poll); False asks the driver
# about the awaited event only (benchmarks/probes/probe_poll.py measures both in one process).
poll_by_stream = True


class SchedulingPolicy(Protocol):
    """What a device uses of its scheduling policy. The policies (trio_cuda._scheduling)
    are made for a device, so they stand above it: it names them by this protocol."""

    @property
    def device(self) -> Device: ...
    def next_stream(self) -> Stream: ...


_default_policy_factory: Callable[[Device], SchedulingPolicy] | None = None


def set_default_policy_factory(factory: Callable[[Device], SchedulingPolicy]) -> None:
    """Set how a device makes its default policy (the scheduling layer registers
    StreamPoolByLoad here: devices do not know the policies)."""
    global _default_policy_factory
    _default_policy_factory = factory


class Device:
    """One GPU (or simulated GPU). Get devices from :func:`trio_cuda.devices` / :func:`trio_cuda.device`.

    Attributes:
        ordinal: The device ordinal.
        generation: Bumped by each :meth:`reset`; objects of an older generation are stale.
    """

    ordinal: int
    generation: int
    _driver: DeviceDriver
    _backend_name: str
    _new_waker: Callable[[], Waker]
    _resetting: bool
    _slow_lock: threading.Lock
    _streams: weakref.WeakSet[Stream]
    _utility: Stream | None
    _policy: SchedulingPolicy | None
    _pick: Callable[[], Stream] | None  # the policy's choice of a submission's stream
    _dead_streams: collections.deque[Stream]
    # destroyed streams whose last work may still run: final event, keeps, and the
    # driver stream, destroyed once that work is done (None: another library's)
    _lingering: list[tuple[Event, collections.deque[tuple[int, Any]], Any]]
    _event_pool: collections.deque[tuple[int, Any]]
    _dead_buffers: collections.deque[tuple[int, int, int, list[tuple[Stream, int]], Any]]
    _dead_graphs: collections.deque[tuple[int, Any]]
    _bytes_in_use: int
    _stats: Counters
    _reset_callbacks: list[Callable[[Device], None]]
    _blocking: set[Waker]
    _peer_readers: list[Event]  # work of other devices reading its memory (peer copies)
    _idle_wakers: list[Waker]
    _host_cond: threading.Condition
    _host_readers: int
    _foreign_streams: bool  # another library's stream was wrapped (it may pull ours into its capture)
    _cross_device: bool  # work here waited for or copied another device's work, or ran a collective (see poll)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Device cannot be constructed directly; use trio_cuda.device(i) or trio_cuda.devices()")

    @classmethod
    def _new(cls, ordinal: int, driver: DeviceDriver, backend_name: str, new_waker: Callable[[], Waker]) -> Device:
        self = cls.__new__(cls)  # (not object.__new__: compiled, this is an extension type)
        self.ordinal = ordinal
        self._driver = driver
        self._backend_name = backend_name
        self._new_waker = new_waker
        self.generation = 0
        self._resetting = False
        self._slow_lock = threading.Lock()
        self._streams = weakref.WeakSet()
        self._utility = None
        self._policy = None
        self._pick = None
        # Lock-free queues, filled by finalizers and drained under LOCK.
        self._dead_streams = collections.deque()
        self._lingering = []
        self._event_pool = collections.deque()
        self._dead_buffers = collections.deque()
        self._dead_graphs = collections.deque()
        self._bytes_in_use = 0
        self._stats = Counters()
        self._reset_callbacks = []
        self._blocking = set()
        self._peer_readers = []
        self._idle_wakers = []
        self._host_cond = threading.Condition(threading.Lock())
        self._host_readers = 0
        self._foreign_streams = False
        self._cross_device = False
        return self

    # -- identity ---------------------------------------------------------------
    @property
    def name(self) -> str:
        """The device's name as the driver reports it."""
        return self._driver.name

    @property
    def compute_capability(self) -> tuple[int, int]:
        """(major, minor) compute capability."""
        return self._driver.compute_capability

    @property
    def total_memory(self) -> int:
        """Total device memory in bytes."""
        return self._driver.total_memory

    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"sim"``."""
        return self._backend_name

    def __repr__(self) -> str:
        return f"<trio_cuda.Device {self.ordinal}: {self.name}>"

    # -- streams ------------------------------------------------------------------
    def create_stream(self) -> Stream:
        """A new stream on this device, destroyed when nothing references it any more."""
        with LOCK:
            self.check_usable()
            self._housekeeping()
            s = Stream._new(self, self._driver.create_stream())
            self._streams.add(s)
            return s

    def external_stream(self, handle: int) -> Stream:
        """Another library's stream of this device (a ``cudaStream_t`` as an int) as a
        trio_cuda Stream: ops may be submitted on it and are ordered like on any stream;
        trio-cuda never destroys it (see :func:`trio_cuda.lowlevel.external_stream`)."""
        if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
            raise TypeError(f"external_stream: the handle must be a stream's address as an int, not {handle!r}")
        with LOCK:
            self.check_usable()
            s = Stream._new(self, self._driver.foreign_stream(handle))
            s._foreign = True
            self._foreign_streams = True
            self._streams.add(s)
            return s

    def _current_stream(self, s: Stream) -> None:
        """Give ``s`` a driver stream of the current generation (after a reset). Under LOCK.

        Raises:
            ValueError: ``s`` was dropped (reached again through a weak reference).
        """
        if s._dropped:
            raise dropped_stream(s)
        if s.generation != self.generation:
            if s._foreign:
                raise ValueError(
                    f"an external stream of device {self.ordinal} belongs to the device's state before its reset; "
                    "wrap the library's new stream with lowlevel.external_stream"
                )
            s._bind(self._driver.create_stream())

    def _utility_stream(self) -> Stream:
        """An internal stream no policy or capture uses (deferred frees). Under LOCK."""
        u = self._utility
        if u is None:
            u = self._utility = Stream._new(self, self._driver.create_stream())
            self._streams.add(u)
        else:
            self._current_stream(u)
        return u

    def _recycle_stream(self, stream: Stream) -> None:
        # Called from Stream.__del__ in any thread: no lock, just queue it.
        self._dead_streams.append(stream)

    def _recycle_graph(self, generation: int, handle: Any) -> None:
        # Called from CudaGraph.__del__ in any thread: no lock, just queue it.
        self._dead_graphs.append((generation, handle))

    def _housekeeping(self) -> None:
        """Destroy streams and graphs nothing references any more (under LOCK)."""
        _reclaim.housekeeping(self)

    # -- policy -------------------------------------------------------------------
    @property
    def policy(self) -> SchedulingPolicy:
        """The scheduling policy ``await op`` and ``op.sync()`` use on this device.

        Defaults to :class:`~trio_cuda.StreamPoolByLoad` (4 streams, growing to 16). Assign
        another policy (for this device) to change it.
        """
        p = self._policy
        if p is None:
            with LOCK:
                p = self._policy
                if p is None:
                    assert _default_policy_factory is not None, "trio_cuda._scheduling is not imported"
                    p = _default_policy_factory(self)
                    self._pick = getattr(p, "submission_stream", None) or p.next_stream
                    self._policy = p
        return p

    @policy.setter
    def policy(self, policy: SchedulingPolicy) -> None:
        device = getattr(policy, "device", None)
        if not callable(getattr(policy, "next_stream", None)) or device is None:
            raise TypeError(f"expected a SchedulingPolicy, got {policy!r}")
        if device is not self:
            raise ValueError(f"the policy schedules on device {device.ordinal}, not device {self.ordinal}")
        with LOCK:
            self._pick = getattr(policy, "submission_stream", None) or policy.next_stream
            self._policy = policy

    def _submission_stream(self) -> Stream:
        """The stream for a submission that names none (``await op``, ``op.sync()``,
        ``lowlevel.submit(op)``): the policy's ``submission_stream`` if it has one, else
        its ``next_stream``."""
        pick = self._pick
        if pick is None:
            self.policy  # noqa: B018 (makes the default policy, and _pick)
            pick = self._pick
            assert pick is not None
        return pick()

    # -- faults and reset -----------------------------------------------------------
    @property
    def is_faulted(self) -> bool:
        """True after an asynchronous fault, until a successful :meth:`reset`."""
        return self._driver.fault() is not None

    def check_usable(self) -> None:
        """Raise if the device cannot take work now (faulted, being reset, or in a forked child)."""
        if self._resetting:
            check_not_forked()
            raise DeviceUnavailable("the device is being reset; submit again once reset() returns", device=self.ordinal)
        fault = self._driver.fault()
        if fault is not None:
            raise DeviceFault(
                f"the device refuses new work until it is reset: it faulted earlier ({fault}); "
                f"call trio_cuda.device({self.ordinal}).reset() to recover",
                device=self.ordinal,
                op=getattr(fault, "op", None),
            ) from fault

    def on_reset(self, callback: Callable[[Device], None]) -> None:
        """Call ``callback(device)`` right after each reset bumps the generation (any thread;
        it must not block). Used by the notifier and the staging pools."""
        with LOCK:
            self._reset_callbacks.append(callback)

    def reset(self) -> None:
        """Discard the device's state and clear a fault (plain code only; blocks).

        All memory of the device is released: tensors, graphs and events made before
        the reset refuse use. Streams (and policies) keep working with fresh driver
        streams. Every task or thread still waiting for work of this device gets
        :class:`DeviceReset`. Other devices keep working during the reset.

        Raises:
            DeviceFault: The driver cannot bring the device back in this process (on CUDA,
                after an illegal address: the process must be restarted).
            DeviceUnavailable: Another reset of this device is in progress.
        """
        _reset.reset(self)

    def _orphan(self) -> None:
        """In a forked child: the device refuses new work for good (see _reset.orphan)."""
        _reset.orphan(self)

    def _read_by_peer(self, ev: Event) -> None:
        """Note work of another device (done at ``ev``) that reads this device's memory:
        a reset waits for it first (under LOCK)."""
        readers = self._peer_readers
        if len(readers) > 16:
            keep = []
            for e in readers:
                if e.done or e.generation != e.device.generation:
                    continue
                try:
                    if e.device._driver.query(e.handle):
                        continue
                except DeviceError:
                    continue
                keep.append(e)
            self._peer_readers = readers = keep
        readers.append(ev)

    def begin_host_read(self, generation: int) -> bool:
        """Start reading pinned host memory of ``generation``; False if it is gone (reset)."""
        with self._host_cond:
            if generation != self.generation:
                return False
            self._host_readers += 1
            return True

    def end_host_read(self) -> None:
        with self._host_cond:
            self._host_readers -= 1
            if not self._host_readers:
                self._host_cond.notify_all()

    # -- memory -----------------------------------------------------------------------
    def _alloc(self, nbytes: int, stream: Stream, what: str) -> int:
        """Stream-ordered allocation (under LOCK). Raises DeviceOutOfMemory."""
        try:
            ptr = self._driver.alloc(nbytes, stream.handle)
        except DeviceOutOfMemory as err:
            raise DeviceOutOfMemory(err.message, device=self.ordinal, op=what) from None
        self._bytes_in_use += nbytes
        self._stats.allocations += 1
        self._stats.bytes_allocated += nbytes
        return ptr

    def _free_now(self, ptr: int, nbytes: int, stream: Stream) -> None:
        """Free an allocation no work has used yet (under LOCK)."""
        self._driver.free(ptr, stream.handle)
        self._bytes_in_use -= nbytes
        self._stats.frees += 1
        self._stats.bytes_freed += nbytes

    def _defer_free(
        self, generation: int, ptr: int, nbytes: int, accesses: list[tuple[Stream, int]], release: Any = None
    ) -> None:
        # Called from Buffer.__del__ in any thread: no lock, just queue it. With
        # ``release`` (foreign memory): call it after the accesses instead of freeing.
        self._dead_buffers.append((generation, ptr, nbytes, accesses, release))

    def flush_frees(self) -> None:
        """Enqueue deferred frees, each after every pending access to its memory (under LOCK)."""
        _reclaim.flush_frees(self)

    def memory_in_use(self) -> int:
        """Bytes of device memory held by live tensors (and frees not yet enqueued)."""
        return self._bytes_in_use

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes, as the driver reports it."""
        with LOCK:
            self.check_usable()
            return self._driver.mem_info()

    # -- completion ---------------------------------------------------------------------
    def poll(self, ev: Event) -> bool:
        """True if ``ev`` has completed (non-blocking; any thread).

        Raises:
            DeviceReset: The device was reset after the event was recorded.
            DeviceFault: The work before the event failed, or the device faulted.
        """
        if ev.done:
            if ev.error is not None:
                raise fresh(ev.error)
            return True
        lock_acquire()  # (rather than `with`: half the cost, on every await)
        try:
            if ev.generation != self.generation:
                check_not_forked()
                raise DeviceReset(
                    "the device was reset while this work was pending; its results are gone",
                    device=self.ordinal,
                )
            s = ev._stream()
            if (
                s is not None
                and poll_by_stream
                and not self._cross_device
                and s.generation == ev.generation
                and self._driver._fault is None
            ):
                # Answer from the stream: a stream runs in order, so once a later point
                # of it is seen done, every earlier one is. Many tasks awaiting tiny ops
                # on a few streams then skip most driver queries (a query that first sees
                # an event done costs 1.4-1.9 us on an H200). Only while no work of this
                # device has depended on another device's: such a dependency can fail
                # one submission while later work on its stream succeeds. And only while
                # no fault of the device is known: then every event not yet seen done fails.
                if ev.seq <= s._ok_seq:
                    ev.done = True
                    return True
                last = s._last_event
                if (
                    last is not None
                    and last.seq > ev.seq
                    and last.seq != s._newest_pending
                    and not last.done
                    and last.generation == ev.generation
                    and s.capture is None
                    and self._newest_done(s, last)
                ):
                    ev.done = True
                    return True
            try:
                done = self._driver.query(ev.handle)
            except DeviceError as err:
                if isinstance(err, DeviceFault) and self._driver._fault is None:
                    # The work before the event failed (it waited for another device that
                    # faulted), not the device: the event is done, with this error. Any
                    # other error (a query the driver refused) says nothing about the work.
                    ev.error = fresh(err)
                    ev.done = True
                    s = ev._stream()
                    if s is not None:
                        s.observe(ev.seq)
                raise fresh(err) from None
            if done:
                ev.done = True
                if s is not None:  # the stream learns how far it is known complete
                    s._succeeded(ev.seq)  # (ev is of the current generation, and so is s)
                return True
        finally:
            lock_release()
        return False

    def _newest_done(self, s: Stream, last: Event) -> bool:
        """Ask the driver about ``s``'s newest event ``last`` (under LOCK): True if it is
        done, so every earlier point of ``s`` is. A pending answer is remembered and that
        event is not asked about again: the polls of older events behind it ask about
        their own (until a newer event is recorded), so a long kernel at the end of a
        stream costs one extra query, not one per poll."""
        try:
            done = self._driver.query(last.handle)
        except DeviceError:
            done = False  # says nothing about the event polled: ask about that one
        if not done:
            s._newest_pending = last.seq
            return False
        last.done = True
        s._succeeded(last.seq)
        return True

    def arm(self, ev: Event, waker: Waker) -> bool:
        """Have ``waker`` posted when ``ev`` completes; False if it already has (or is stale)."""
        with LOCK:
            if ev.done or ev.generation != self.generation:
                return False
            s = ev._stream()
            # The event's stream only while it still has that driver stream (a destroyed
            # or rebound one is not named: the driver must not key anything by it).
            handle = ev.stream_handle if s is not None and s.handle is ev.stream_handle else None
            self._driver.arm(ev.handle, handle, waker)
            return True

    def wait_blocking(self, ev: Event) -> None:
        """Block the calling (non-trio) thread until ``ev`` completes.

        Spins briefly, then sleeps on a waker the event posts (re-polling every 20 ms,
        because a faulted device posts nothing). A reset posts it too.

        Raises:
            DeviceReset, DeviceFault: as :meth:`poll`.
        """
        deadline = time.perf_counter_ns() + _SPIN_NS
        while not self.poll(ev):
            if time.perf_counter_ns() > deadline:
                break
        else:
            return
        with LOCK:
            waker = self._idle_wakers.pop() if self._idle_wakers else self._new_waker()
            self._blocking.add(waker)
        try:
            self.arm(ev, waker)
            while not self.poll(ev):
                waker.wait(_REPOLL_S)
        finally:
            with LOCK:
                self._blocking.discard(waker)
                # A post may still arrive later; the next user re-polls after every wake.
                self._idle_wakers.append(waker)

    def synchronize(self) -> None:
        """Block until all work enqueued on the device's streams has completed (plain code only).

        Also enqueues deferred frees first, so memory of dropped tensors returns to the pool.

        Raises:
            DeviceFault: Work of the device failed.
            DeviceReset: The device was reset meanwhile.
        """
        check_blocking_allowed("Device.synchronize()")
        with LOCK:
            self.check_usable()
            self.flush_frees()
            self._housekeeping()
            events = self.pending_events()
        for ev in events:
            try:
                self.wait_blocking(ev)
            except DeviceFault:
                if self.is_faulted:
                    raise
                # One op's failure (reported to whoever awaited it): that work is over.
        with LOCK:
            for s in list(self._streams):
                if s.generation == self.generation:
                    s.retire()
            if self._lingering:
                self._housekeeping()  # dropped streams whose work just finished are destroyed
            _staging_drain(self)  # the buffers of the copies just retired: idle beyond the cap let go

    def pending_events(self) -> list[Event]:
        """An event at the current point of each stream with unfinished work (under LOCK).

        For a stream recording a graph capture, the work from before the capture; for a
        destroyed stream whose last work may still run, the event after that work.
        """
        out = []
        for s in list(self._streams):
            if s.generation != self.generation or s.seq <= s.done_seq or s.handle is None:
                continue
            ev = s.event_at(s.seq) if s.capture is None else s.capture.outside_event(s, 0)
            if ev is not None and not ev.done:
                out.append(ev)
        for ev, _, _ in self._lingering:  # the last work of dropped streams
            if not ev.done:
                out.append(ev)
        return out

    def statistics(self) -> DeviceStatistics:
        """A frozen snapshot of this device's counters."""
        c = self._stats
        return DeviceStatistics(
            ordinal=self.ordinal,
            backend=self._backend_name,
            generation=self.generation,
            submissions=c.submissions,
            launches=c.launches,
            graph_launches=c.graph_launches,
            allocations=c.allocations,
            frees=c.frees,
            copies=c.copies,
            stream_waits=c.stream_waits,
            bytes_in_use=self.memory_in_use(),
            streams=len(self._streams),
            streams_destroyed=c.streams_destroyed,
            staging_bytes=c.staging_bytes,
            staging_pins=c.staging_pins,
            staging_unpins=c.staging_unpins,
            faulted=self.is_faulted,
            bytes_allocated=c.bytes_allocated,
            bytes_freed=c.bytes_freed,
            queue_depths=tuple(max(0, st.seq - st.done_seq) for st in list(self._streams)),
            staging_unpinning=c.staging_unpinning,
        )
