"""Streams and the events that mark points in them.

A :class:`Stream` counts the work enqueued on it (``seq``) and remembers how far it
is known to have completed (``done_seq``). A point in a stream is a *marker*, the
pair ``(stream, seq)``. Markers are free: no driver call is made until another
stream (or a waiter) actually needs one, and then a single pooled event, recorded
once, serves every waiter of that point and every earlier one. This is what makes
same-stream chains cost nothing extra while cross-stream dependencies stay exact.

Owner: every field of a stream is changed only under the runtime lock
(:data:`trio_cuda._guard.LOCK`), through the methods here, by the device that made
it and the submission machinery. A stream that nothing references any more is
destroyed (after its pending work) by its device; the finalizer only queues that.
"""

from __future__ import annotations

import collections
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from . import _trace
from ._guard import LOCK, check_blocking_allowed

if TYPE_CHECKING:
    from ._backends._boundary import DeviceDriver

__all__ = ["Event", "Stream", "StreamDevice"]


class StreamDevice(Protocol):
    """What streams and events use of their device. The device makes streams, so it
    stands above them: they name it by this protocol, not by its class."""

    ordinal: int
    generation: int
    _driver: DeviceDriver
    _stats: Any
    _cross_device: bool
    # (generation, handle) of driver events to reuse: events put theirs back when they
    # go (lock-free, from any thread); streams take them under the runtime lock
    _event_pool: collections.deque[tuple[int, Any]]

    def poll(self, ev: Event) -> bool: ...
    def wait_blocking(self, ev: Event) -> None: ...
    def _recycle_stream(self, stream: Stream) -> None: ...


class Event:
    """A completion point in a stream: done when everything enqueued before it is.

    Attributes:
        device: The device of the stream.
        seq: The point of the stream it marks.
        generation: The device generation it belongs to (a reset ends it).
    """

    __slots__ = (
        "__weakref__",
        "_pool",
        "_stream",
        "device",
        "done",
        "error",
        "generation",
        "handle",
        "seq",
        "stream_handle",
    )
    device: Any  # (the Device, typed loosely as Stream.device)
    _stream: weakref.ref[Stream]
    stream_handle: Any
    seq: int
    handle: Any
    done: bool
    error: BaseException | None  # the work before it failed (it is done)
    generation: int
    _pool: collections.deque[tuple[int, Any]]

    def __init__(self) -> None:
        raise TypeError("Event cannot be constructed directly; lowlevel.record(stream) records one")

    @property
    def stream(self) -> Stream | None:
        """The stream it was recorded on (None once that stream is gone)."""
        s = self._stream()
        return None if s is None or s._dropped else s

    def query(self) -> bool:
        """True once the work before this event has completed (non-blocking).

        Raises:
            DeviceFault: The work failed or the device faulted.
            DeviceReset: The device was reset since the event was recorded.
        """
        device: StreamDevice = self.device
        return device.poll(self)

    def __repr__(self) -> str:
        return f"<trio_cuda.Event at point {self.seq} of a stream of device {self.device.ordinal}>"

    def __del__(self) -> None:
        # Lock-free (deque.append is atomic): the device's pool takes the handle back.
        try:
            self._pool.append((self.generation, self.handle))
        except Exception:  # interpreter shutdown
            pass


def _new_event(stream: Stream, seq: int, handle: Any) -> Event:
    """An event of point ``seq`` of ``stream`` on the driver event ``handle`` (its fields
    set here: compiled, without a call through the type)."""
    ev = Event.__new__(Event)
    ev.device = stream.device
    ev._stream = stream._wref  # weak: no cycle with the stream's last event
    ev.stream_handle = stream.handle
    ev.seq = seq
    ev.handle = handle
    ev.done = False
    ev.error = None
    ev.generation = stream.generation
    ev._pool = stream._events
    return ev


def dropped_stream(stream: Stream) -> ValueError:
    """The error for using a stream after its last (strong) reference went away."""
    return ValueError(
        f"this stream of device {stream.device.ordinal} was dropped (its last reference went away) "
        "and is destroyed; a weak reference to it cannot bring it back: keep a reference to streams you use"
    )


class _Token:
    """Names one binding of a stream to a driver stream (a reset rebinds it), weakly."""

    __slots__ = ("wref",)

    def __init__(self, wref: weakref.ref[Stream] | None) -> None:
        self.wref = wref


class Stream:
    """An ordered queue of device work. Create streams with :meth:`Device.create_stream`.

    Attributes:
        device: The device the stream belongs to.
        seq: Points of work enqueued so far (see the module docstring).
        done_seq: The last point known to have completed.
    """

    __slots__ = (
        "__weakref__",
        "_dropped",
        "_events",
        "_final",
        "_foreign",
        "_keep",
        "_last_event",
        "_newest_pending",
        "_ok_seq",
        "_token",
        "_waited",
        "_wref",
        "capture",
        "device",
        "done_seq",
        "generation",
        "handle",
        "seq",
    )

    # The Device. Typed loosely: its class stands above streams (it makes them), and the
    # layers above read more of it than StreamDevice says. _new takes a StreamDevice.
    device: Any
    handle: Any
    seq: int
    done_seq: int
    generation: int
    capture: Any  # the graph capture recording this stream, if any
    _last_event: Event | None
    _ok_seq: int  # the last point whose event a poll saw succeed (<= done_seq; see Device.poll)
    _newest_pending: int  # the point of the newest event a poll last found pending
    _waited: dict[_Token, int]
    _token: _Token
    _keep: collections.deque[tuple[int, Any]]
    _final: Event | None  # after the handle is destroyed: an event after its last work
    _dropped: bool  # its last reference went away: it is (being) destroyed
    _foreign: bool  # another library's stream (lowlevel.external_stream): never destroyed here
    _wref: weakref.ref[Stream]
    _events: collections.deque[tuple[int, Any]]  # the device's event pool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Stream cannot be constructed directly; use device.create_stream()")

    @classmethod
    def _new(cls, device: StreamDevice, handle: Any) -> Stream:
        """A stream of ``device`` around a driver handle (called under the runtime lock)."""
        self = cls.__new__(cls)  # (not object.__new__: compiled, Stream is an extension type)
        self.device = device
        self._events = device._event_pool
        self.capture = None
        self._dropped = False
        self._foreign = False
        self._wref = weakref.ref(self)
        self._bind(handle)
        return self

    def _bind(self, handle: Any) -> None:
        old = getattr(self, "_token", None)
        if old is not None:
            old.wref = None  # waits recorded against the old driver stream are void
        self._token = _Token(self._wref)
        self.handle = handle
        self.generation = self.device.generation
        self.seq = 0
        self.done_seq = 0
        self._ok_seq = 0
        self._newest_pending = 0
        self._last_event = None
        self._waited = {}
        self._keep = collections.deque()
        self._final = None
        self.capture = None

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (version 0, the ``CUstream`` handle as an int), so
        libraries that take stream objects (cuda.core, CuPy, PyTorch's ExternalStream
        through ``int(...)[1]``) can enqueue on this stream."""
        handle = self.handle
        if handle is None or self.generation != self.device.generation:
            raise ValueError("this stream has no live CUDA stream (destroyed, or its device was reset)")
        try:
            return (0, int(handle))
        except TypeError:
            raise TypeError("the simulated device's streams are not CUDA streams") from None

    def __repr__(self) -> str:
        return f"<trio_cuda.Stream of device {self.device.ordinal} at {id(self):#x}>"

    def __del__(self) -> None:
        # Lock-free: the device destroys the driver stream at its next operation. This
        # object is kept (resurrected) until then: a finalizer of the same garbage (a
        # buffer's) may still refer to it, and work may still be queued on it. A weak
        # reference can still reach it (CPython clears weak references after finalizers):
        # it is marked dropped, and using it again is refused (see Device._current_stream).
        self._dropped = True
        try:
            self.device._recycle_stream(self)
        except Exception:  # interpreter shutdown
            pass

    # -- markers (under the runtime lock) --------------------------------------------
    def mark(self) -> int:
        """Close the current point: returns the seq that covers all work enqueued so far."""
        self.seq += 1
        return self.seq

    def event_at(self, seq: int) -> Event:
        """An event that completes no earlier than point ``seq`` (recorded now if needed).

        A destroyed stream answers with the event after its last work.
        """
        if self.handle is None:
            assert self._final is not None
            return self._final
        last = self._last_event
        if last is not None and last.seq >= seq:
            return last
        if self.seq < seq:
            self.seq = seq
        device = self.device
        handle = None
        pool = self._events
        gen = device.generation
        while pool:  # a pooled handle of the device's generation (older ones are gone)
            g, h = pool.pop()
            if g == gen:
                handle = h
                break
        driver = device._driver
        if handle is None:
            handle = driver.create_event()
        ev = _new_event(self, self.seq, handle)
        driver.record(handle, self.handle)
        self._last_event = ev
        return ev

    def wait_for(self, other: Stream, seq: int, *, ordering_only: bool = False) -> bool:
        """Order future work on this stream after point ``seq`` of ``other``.

        With ``ordering_only`` (a free waiting for the last accesses of its memory), a
        failure of the work waited for does not fail this stream's later work.
        Returns True if a driver wait was enqueued.
        """
        if other is self or other.done_seq >= seq:
            return False
        last = other._last_event
        if last is not None and last.done and last.seq >= seq:
            other.done_seq = last.seq  # known complete: nothing to wait for
            return False
        token = other._token
        waited = self._waited
        if waited.get(token, 0) >= seq:
            return False
        if other.generation != other.device.generation:
            return False  # the other device was reset: nothing of that stream is pending
        if other.handle is None and (other._final is None or other._final.done):
            return False  # destroyed with nothing pending
        cap = other.capture
        if cap is not None and cap is not self.capture:
            ev = cap.outside_event(other, seq)  # work from before the capture, or refused
            if ev is None:
                return False
        else:
            ev = other.event_at(seq)
        if ev.done:
            return False
        self._enqueue_wait(ev, ordering_only=ordering_only)
        if _trace.active is not None:
            _trace.active.wait(self, other, seq)
        if len(waited) > 32:
            self._waited = waited = {t: v for t, v in waited.items() if t.wref is not None and t.wref() is not None}
        waited[token] = ev.seq
        self.device._stats.stream_waits += 1
        return True

    def _enqueue_wait(self, ev: Event, *, ordering_only: bool = False) -> None:
        """Enqueue a driver wait for ``ev`` on this stream (under LOCK): every wait of one
        of our streams goes through here. A wait for another device's work (unless
        ordering only) turns polls answered from the stream off for this device: a
        failure there fails one submission of this stream while later ones succeed
        (see Device.poll)."""
        if ev.device is not self.device and not ordering_only:
            self.device._cross_device = True
        self.device._driver.wait_event(self.handle, ev.handle, ordering_only=ordering_only)

    def observe(self, seq: int) -> None:
        """Note that point ``seq`` has completed (done_seq only grows)."""
        if self.done_seq < seq:
            self.done_seq = seq

    def _succeeded(self, seq: int) -> None:
        """Note that point ``seq`` has completed and a poll saw its event succeed:
        done_seq and _ok_seq (see Device.poll) only grow."""
        if self.done_seq < seq:
            self.done_seq = seq
        if self._ok_seq < seq:
            self._ok_seq = seq

    # -- keep-alive ---------------------------------------------------------------
    def keep(self, obj: Any) -> None:
        """Keep ``obj`` alive until the point being built completes; then call its
        ``stream_done()`` if it has one (staging memory goes back to its pool)."""
        self._keep.append((self.seq + 1, obj))

    def retire(self) -> None:
        """Drop keep-alive references whose point is known complete (under the lock)."""
        keep = self._keep
        if not keep:
            return
        last = self._last_event
        if self.capture is not None:
            # Recording a graph: its last event may be a node of the capture (querying it
            # would invalidate the capture); what completed before it began is known.
            last = None
        if keep[0][0] > self.done_seq and last is not None:
            try:
                if last.query():
                    self.observe(last.seq)
            except Exception:  # a fault or a reset: the keeps stay until the reset clears them
                return
        done = self.done_seq
        while keep and keep[0][0] <= done:
            _, obj = keep.popleft()
            release = getattr(obj, "stream_done", None)
            if release is not None:
                release()

    # -- blocking -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until all work enqueued so far has completed (plain code only).

        Raises:
            DeviceFault: The work failed.
            DeviceReset: The device was reset meanwhile.
        """
        check_blocking_allowed("Stream.synchronize()")
        device = self.device
        if self._dropped:
            raise dropped_stream(self)
        with LOCK:
            if self.generation != device.generation or self.seq <= self.done_seq:
                return
            cap = self.capture
            if cap is not None:  # recording a graph: what ran is what came before the capture
                ev = cap.outside_event(self, 0)
                if ev is None:
                    return
            else:
                ev = self.event_at(self.seq)
        device.wait_blocking(ev)
        with LOCK:
            self.retire()
