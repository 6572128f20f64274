"""The bookkeeping of an open CUDA graph capture.

A capture is *scoped*: it takes only the streams it records on (its origin stream and
private streams for ``zip`` branches, never a policy's stream unless the caller names
one), and it marks the buffers it touches. Other tasks keep working on the device;
only work that touches a capturing stream or a captured buffer is refused with
GraphCaptureError while the capture is open.

Inside a capture nothing runs: when it ends, the streams' and buffers' bookkeeping is
restored to its state before the capture, and the graph remembers which buffers it
reads and writes (its launches order themselves like any op).

Everything here runs under the runtime lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import DeviceReset, GraphCaptureError

if TYPE_CHECKING:
    from ._device import Device
    from ._memory import Buffer
    from ._stream import Stream

__all__ = ["Capture"]

# Private streams for capture branches, per device, reused across captures.
_spare: dict[int, list[Stream]] = {}


class Capture:
    """One open capture (lanes of the capturing submissions point at it).

    Attributes:
        device: The device being captured.
        stream: The origin stream (capture begins and ends there).
        accesses: Buffer -> whether the graph writes it.
        keep: Host memory the graph's copies use (kept with the graph).
    """

    def __init__(self, device: Device, stream: Stream) -> None:
        self.device = device
        self.stream = stream
        self.generation = device.generation
        self.start: dict[Stream, int] = {}  # joined streams -> their seq when they joined
        # Per joined stream: its point when it joined and an event recorded before it
        # entered the capture (None if nothing was pending then). Work outside the
        # capture that waits for those points uses it: events recorded inside a capture
        # never complete.
        self.pre: dict[Stream, tuple[int, Any]] = {}
        self.saved_streams: dict[Stream, tuple[Any, dict[Any, int]]] = {}
        self.saved_buffers: dict[Buffer, tuple[Any, dict[Stream, int], dict[Stream, int]]] = {}
        self.accesses: dict[Buffer, bool] = {}
        self.shared: list[Any] = []  # shared ops executed inside (their output is the graph's)
        self.keep: list[Any] = []
        self.forks: list[Stream] = []
        self.open = False
        self.auto_end = False  # the expression form: the submission ends the capture
        self.broken = False  # the scope form: a record failed half-way
        self.graph: Any = None

    # -- used by lanes ----------------------------------------------------------------
    def inside(self, stream: Stream, seq: int) -> bool:
        """True if point ``seq`` of ``stream`` was made inside this capture."""
        start = self.start.get(stream)
        return start is not None and seq > start

    def outside_event(self, s: Stream, seq: int) -> Any:
        """For work outside the capture: the event that covers point ``seq`` of capturing
        stream ``s`` (None if nothing from before the capture is pending).

        Raises:
            GraphCaptureError: ``seq`` is a point recorded inside the capture (not run).
        """
        point, ev = self.pre.get(s, (0, None))
        if seq > point:
            raise GraphCaptureError(
                "this op waits for work recorded into a graph capture that is still open (it has not run)",
                device=self.device.ordinal,
            )
        return ev

    def touch(self, buf: Buffer, write: bool) -> None:
        """Record an access of the graph to ``buf`` (saving its state the first time)."""
        if buf.device is not self.device:
            raise GraphCaptureError(
                "a graph captures the work of one device; this op touches another", device=self.device.ordinal
            )
        if buf not in self.saved_buffers:
            self.saved_buffers[buf] = (buf.writer, dict(buf.readers), dict(buf.lifetime))
            buf.capture = self
        self.accesses[buf] = self.accesses.get(buf, False) or write

    def fork_stream(self, device: Device) -> Stream:
        """A private stream for a branch, joined to the capture when first used."""
        if device is not self.device:
            raise GraphCaptureError(
                "a graph captures the work of one device; a branch runs on another", device=self.device.ordinal
            )
        spare = _spare.setdefault(device.ordinal, [])
        while spare:
            s = spare.pop()
            if s.generation == device.generation:
                break
        else:
            s = device.create_stream()
        s.capture = self
        self.forks.append(s)
        return s

    def _pre(self, s: Stream) -> None:
        ev = s.event_at(s.seq) if s.seq > s.done_seq else None
        self.pre[s] = (s.seq, ev)

    def join(self, s: Stream) -> None:
        """Bring stream ``s`` into the capture, ordered after the origin's current point."""
        if s in self.start:
            return
        if s not in self.pre:
            self._pre(s)  # before it enters capture mode
        self.saved_streams[s] = (s._last_event, dict(s._waited))
        s.capture = self
        if s is not self.stream:
            origin = self.stream
            ev = origin.event_at(origin.mark())  # recorded inside the capture: a fork point
            s._enqueue_wait(ev)
            s._waited[origin._token] = ev.seq
        self.start[s] = s.mark()

    # -- begin / end --------------------------------------------------------------------
    def begin(self) -> None:
        """Put the origin stream in capture mode."""
        cs = self.stream
        if cs.capture is not None and cs.capture is not self:
            raise GraphCaptureError("the stream is recording another capture; finish it first", device=self.device.ordinal)
        self.generation = self.device.generation
        self._pre(cs)
        self.device._driver.begin_capture(cs.handle)
        self.open = True
        self.join(cs)

    def end(self, keep_graph: bool) -> Any:
        """End the capture; returns the graph handle (None if not kept). Restores the
        bookkeeping: nothing ran, the graph will.

        Raises:
            DeviceReset: The device was reset while the capture was open.
        """
        drv = self.device._driver
        self.open = False
        try:
            if self.generation != self.device.generation:
                raise DeviceReset("the device was reset while the graph capture was open", device=self.device.ordinal)
            if keep_graph:
                return drv.end_capture(self.stream.handle)
            drv.abort_capture(self.stream.handle)
            return None
        finally:
            self.restore()

    def restore(self) -> None:
        current = self.generation == self.device.generation
        if self.shared:
            # Its upstream was consumed by the capture and its output is what launching
            # the graph produces: a later consumer outside the graph gets this error.
            err = GraphCaptureError(
                "this shared op was captured into a graph: it has not run; its output is produced by "
                "launching the graph (use the graph's output)",
                device=self.device.ordinal,
            )
            for op in self.shared:
                op._captured(err)
            self.shared = []
        for s, (last, waited) in self.saved_streams.items():
            if current and s.generation == self.generation:
                s._last_event = last
                s._waited = waited
            s.capture = None
        for s in self.forks:
            s.capture = None
            if current:
                _spare.setdefault(self.device.ordinal, []).append(s)
        self.forks = []
        for buf, (writer, readers, lifetime) in self.saved_buffers.items():
            buf.writer = writer
            buf.readers = readers
            buf.lifetime = lifetime
            buf.capture = None
