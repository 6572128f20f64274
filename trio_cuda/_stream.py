"""Streams and the events that mark points in them.

A :class:`Stream` counts the work enqueued on it (``seq``) and remembers how far it
is known to have completed (``done_seq``). A point in a stream is a *marker*, the
pair ``(stream, seq)``. Markers are free: no driver call is made until another
stream actually has to wait for one, and then a single pooled event, recorded once,
serves every waiter of that point and every earlier one. This is what makes
same-stream chains cost nothing extra while cross-stream dependencies stay exact.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from ._errors import DeviceFault

if TYPE_CHECKING:
    from ._device import Device

__all__ = ["Event", "Stream"]


class Event:
    """A completion point in a stream: done when everything enqueued before it is.

    Events come from a per-device pool and go back to it when no longer referenced.
    """

    __slots__ = ("stream", "seq", "handle", "done", "generation")

    def __init__(self, stream: "Stream", seq: int, handle: Any) -> None:
        self.stream = stream
        self.seq = seq
        self.handle = handle
        self.done = False
        self.generation = stream._generation

    def query(self) -> bool:
        """True once the work before this event has completed.

        Raises:
            DeviceFault: The device faulted.
        """
        if self.done:
            return True
        stream = self.stream
        if stream.device._driver.query(self.handle):
            self.done = True
            if stream.done_seq < self.seq:
                stream.done_seq = self.seq
            return True
        return False

    def synchronize(self) -> None:
        """Block the calling thread until the event completes (spins briefly, then sleeps)."""
        if self.done:
            return
        stream = self.stream
        stream.device._driver.synchronize(self.handle)
        self.query()

    def __del__(self) -> None:
        try:
            device = self.stream.device
            if self.generation == device._generation:  # events die with a device reset
                device._event_pool.append(self.handle)
        except Exception:  # interpreter shutdown
            pass


class Stream:
    """An ordered queue of device work. Create streams with :meth:`Device.create_stream`."""

    __slots__ = (
        "device",
        "handle",
        "seq",
        "done_seq",
        "_last_event",
        "_waited",
        "_keep",
        "_generation",
        "__weakref__",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Stream cannot be constructed directly; use device.create_stream()")

    @classmethod
    def _new(cls, device: "Device") -> "Stream":
        self = object.__new__(cls)
        self.device = device
        self._attach()
        return self

    def _attach(self) -> None:
        """(Re)create the driver stream, e.g. after the device was reset."""
        device = self.device
        self.handle = device._driver.create_stream()
        self._generation = device._generation
        self.seq = 0
        self.done_seq = 0
        self._last_event: Event | None = None
        self._waited: dict[Stream, int] = {}
        self._keep: collections.deque[tuple[int, Any]] = collections.deque()

    def __repr__(self) -> str:
        return f"<trio_cuda.Stream of device {self.device.ordinal} at {id(self):#x}>"

    # -- markers --------------------------------------------------------------
    def mark(self) -> int:
        """Close the current point: returns the seq that covers all work enqueued so far."""
        self.seq += 1
        return self.seq

    def event_at(self, seq: int) -> Event:
        """An event that completes no earlier than point ``seq`` (recorded now if needed)."""
        last = self._last_event
        if last is not None and last.seq >= seq:
            return last
        device = self.device
        pool = device._event_pool
        handle = pool.pop() if pool else device._driver.create_event()
        if self.seq < seq:
            self.seq = seq
        device._driver.record(handle, self.handle)
        ev = Event(self, self.seq, handle)
        self._last_event = ev
        return ev

    def wait_for(self, other: "Stream", seq: int) -> bool:
        """Order future work on this stream after point ``seq`` of ``other``.

        Returns True if a driver wait was enqueued.
        """
        if other is self or other.done_seq >= seq or self._waited.get(other, 0) >= seq:
            return False
        ev = other.event_at(seq)
        self.device._driver.wait_event(self.handle, ev.handle)
        self._waited[other] = ev.seq
        self.device._stats.stream_waits += 1
        return True

    # -- keep-alive -----------------------------------------------------------
    def keep(self, obj: Any) -> None:
        """Keep ``obj`` (host memory a pending copy uses) alive until the current point completes."""
        self._keep.append((self.seq + 1, obj))

    def retire(self) -> None:
        """Drop keep-alive references whose point is known complete."""
        keep = self._keep
        if not keep:
            return
        if keep[0][0] > self.done_seq and self._last_event is not None:
            try:
                self._last_event.query()
            except DeviceFault:
                return
        done = self.done_seq
        while keep and keep[0][0] <= done:
            _, obj = keep.popleft()
            release = getattr(obj, "release", None)
            if release is not None:
                release()

    # -- blocking -------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until all work enqueued so far has completed (plain code only)."""
        from ._execution import check_blocking_allowed

        check_blocking_allowed("Stream.synchronize()")
        with self.device._lock:
            ev = self.event_at(self.mark())
        ev.synchronize()
        with self.device._lock:
            self.retire()
