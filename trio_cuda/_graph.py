"""CUDA graphs: capture a DAG once, replay it with one driver call.

``op.graph_on(stream)`` (or ``op.graph()``) walks the op's DAG exactly like a
submission, but with the stream in capture mode: kernel launches and copies become
graph nodes instead of running. The result is a :class:`CudaGraph`:

* ``graph.take_output()`` returns the captured output (the tensors the graph writes)
  once;
* ``graph.update(op)`` runs ``op`` (typically ``api.memcpy(input_buffer, new_data)``)
  on the graph's stream, ordered before later launches: the captured buffers get new
  contents, the graph is not re-instantiated;
* ``graph.launch()`` is a DeviceOp that replays the whole graph with one driver call
  (``await``, ``.sync()``, ``.sync_on(stream)``) and whose output is the captured output.

``trio_cuda.capture_graph(stream)`` is the scope form: ops are recorded imperatively
with ``scope.record(op)`` and the graph is ``scope.graph`` after the block.

Only graph-safe ops may be captured (kernel launches and copies between existing
tensors, or from host data, which the graph keeps); allocating, reading back to the
host, or executing another op on the device while the capture is open raises
:class:`GraphCaptureError`. Before capturing, the capture stream waits for all pending
work of the device, so the graph is ordered after everything submitted earlier; each
launch is ordered, like any op, after the pending accesses of the buffers it uses.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._errors import GraphCaptureError
from ._execution import LOCK, Lane, _check_not_nested, _tls, evaluate, submit
from ._op import DeviceOp
from ._stream import Stream

if TYPE_CHECKING:
    from ._device import Device
    from ._tensor import Buffer

__all__ = ["CudaGraph", "GraphScope", "capture_graph", "capture_op"]

T = TypeVar("T")


class _Capture:
    """The bookkeeping of one open capture (lanes of the capturing walk point at it)."""

    def __init__(self, device: "Device", stream: Stream) -> None:
        self.device = device
        self.stream = stream
        self.start: dict[Stream, int] = {}  # joined streams -> their seq when they joined
        self.saved_streams: dict[Stream, tuple[Any, dict[Stream, int]]] = {}
        self.saved_buffers: dict[Buffer, tuple[Any, dict[Stream, int]]] = {}
        self.accesses: dict[Buffer, bool] = {}  # buffer -> written by the graph
        self.keep: list[Any] = []

    # -- used by lanes ------------------------------------------------------------------
    def inside(self, stream: Stream, seq: int) -> bool:
        """True if point ``seq`` of ``stream`` was made inside this capture."""
        start = self.start.get(stream)
        return start is not None and seq > start

    def touch(self, buf: "Buffer", write: bool) -> None:
        if buf.device is not self.device:
            raise GraphCaptureError("a graph captures the work of one device; this op touches another", device=self.device.ordinal)
        if buf not in self.saved_buffers:
            self.saved_buffers[buf] = (buf.writer, dict(buf.readers))
        self.accesses[buf] = self.accesses.get(buf, False) or write

    def fork_stream(self, device: "Device") -> Stream:
        if device is not self.device:
            raise GraphCaptureError("a graph captures the work of one device; a branch runs on another", device=self.device.ordinal)
        s = device.policy.next_stream()
        if s not in self.start:
            self.join(s)
        return s

    def join(self, s: Stream) -> None:
        """Bring stream ``s`` into the capture, ordered after the capture stream's current point."""
        self.saved_streams[s] = (s._last_event, dict(s._waited))
        if s is not self.stream:
            origin = self.stream
            ev = origin.event_at(origin.mark())  # recorded inside the capture: a fork point
            self.device._driver.wait_event(s.handle, ev.handle)
            s._waited[origin] = ev.seq
        self.start[s] = s.mark()

    # -- begin / end ------------------------------------------------------------------------
    def begin(self) -> None:
        dev, cs = self.device, self.stream
        # Order the capture after all pending work of the device (real waits, before the
        # capture starts): inside, earlier work counts as done.
        for s in list(dev._streams):
            if s is not cs and s._generation == dev._generation and s.seq > s.done_seq:
                cs.wait_for(s, s.seq)
        dev._driver.begin_capture(cs.handle)
        dev._capturing += 1
        self.join(cs)

    def restore(self) -> None:
        """Undo the bookkeeping the walk did: nothing ran, the graph will."""
        for s, (last, waited) in self.saved_streams.items():
            s._last_event = last
            s._waited = waited
        for buf, (writer, readers) in self.saved_buffers.items():
            buf.writer = writer
            buf.readers = readers
        self.device._capturing -= 1


def _end(cap: _Capture, ok: bool) -> Any:
    drv = cap.device._driver
    try:
        handle = drv.end_capture(cap.stream.handle)
    except Exception:
        if ok:
            raise
        return None
    finally:
        cap.restore()
    if not ok:
        drv.graph_destroy(handle)
        return None
    return handle


def _open(stream: Stream) -> _Capture:
    """Begin a capture on ``stream`` (caller holds LOCK)."""
    device = stream.device
    if device._capturing:
        raise GraphCaptureError("a graph capture is open on this device already; finish it first", device=device.ordinal)
    device._check_usable()
    if stream._generation != device._generation:
        stream._attach()
    device._flush_frees(stream)
    stream.retire()
    cap = _Capture(device, stream)
    cap.begin()
    return cap


def _record(cap: _Capture, op: DeviceOp[T]) -> T:
    """Walk ``op`` into the open capture (caller holds LOCK); returns its output."""
    _tls.active = True
    try:
        lane = Lane(cap.stream, cap)
        value = evaluate(op, lane)
        lane.join()
    finally:
        _tls.active = False
    return value


def capture_op(op: DeviceOp[T], stream: Stream) -> "CudaGraph[T]":
    """Capture ``op``'s DAG on ``stream`` into a graph (``op.graph_on(stream)``)."""
    _check_not_nested("capturing a graph")
    with LOCK:
        cap = _open(stream)
        try:
            value = _record(cap, op)
        except BaseException:
            _end(cap, False)
            raise
        handle = _end(cap, True)
    return CudaGraph._new(stream.device, stream, handle, value, cap)


class CudaGraph(Generic[T]):
    """A captured DAG that replays with one driver call. Made by ``op.graph_on(stream)``.

    Attributes:
        device: The device the graph runs on.
        stream: The stream it was captured on (used by :meth:`update`).
        nodes: The number of nodes in the graph.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("CudaGraph cannot be constructed directly; use op.graph_on(stream) or trio_cuda.capture_graph()")

    @classmethod
    def _new(cls, device: "Device", stream: Stream, handle: Any, output: Any, cap: _Capture) -> "CudaGraph[T]":
        self = object.__new__(cls)
        self.device = device
        self.stream = stream
        self._handle = handle
        self._output = output
        self._taken = False
        self._accesses = tuple(cap.accesses.items())  # keeps the buffers (and their memory) alive
        self._keep = cap.keep  # host data copied by the graph
        self._generation = device._generation
        self.nodes = device._driver.graph_nodes(handle)
        return self

    def __repr__(self) -> str:
        return f"<trio_cuda.CudaGraph of {self.nodes} nodes on device {self.device.ordinal}>"

    def take_output(self) -> T:
        """The captured output (the tensors the graph fills), handed out once."""
        if self._taken:
            raise RuntimeError("the graph's output was taken already (take_output() hands it out once)")
        self._taken = True
        return self._output

    def update(self, op: DeviceOp[Any]) -> Any:
        """Run ``op`` (e.g. ``api.memcpy(input_buffer, new_data)``) on the graph's stream now.

        The op is submitted, not awaited: later launches of the graph (and any other
        op touching the same tensors) are ordered after it. Host data is read at once.
        Returns the op's output.
        """
        if not isinstance(op, DeviceOp):
            raise TypeError(f"update() needs a DeviceOp, got {op!r}")
        self._check_live()
        value, _, _ = submit(op, self.stream)
        return value

    def launch(self) -> DeviceOp[T]:
        """A DeviceOp that replays the graph; its output is the captured output."""
        self._check_live()
        return _GraphLaunch(self)

    def _check_live(self) -> None:
        if self._generation != self.device._generation:
            raise ValueError(f"{self!r} was captured before device {self.device.ordinal} was reset")

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and self._generation == self.device._generation:
            try:
                self.device._driver.graph_destroy(handle)  # in-flight replays finish first
            except Exception:
                pass


class _GraphLaunch(DeviceOp[T]):
    __slots__ = ("_graph",)

    def __init__(self, graph: CudaGraph[T]) -> None:
        super().__init__()
        self._graph = graph

    def _run(self, lane: Lane, args: Any) -> T:
        g = self._graph
        if lane.device is not g.device:
            raise ValueError(f"{g!r} runs on device {g.device.ordinal}, not on device {lane.device.ordinal}")
        if lane.capture is not None:
            raise GraphCaptureError("launching a graph inside another capture is not supported", device=g.device.ordinal)
        g._check_live()
        s = lane.stream
        for buf, written in g._accesses:
            if written:
                lane.write(buf)
            else:
                lane.read(buf)
        g.device._driver.graph_launch(g._handle, s.handle)
        seq = lane.end()
        for buf, written in g._accesses:
            if written:
                lane.wrote(buf, seq)
            else:
                lane.was_read(buf, seq)
        lane.ops.append(f"graph of {g.nodes} nodes")
        g.device._stats.graph_launches += 1
        return g._output


class GraphScope:
    """The scope form of capture: record ops imperatively, get the graph at the end.

    ::

        with trio_cuda.capture_graph() as scope:
            scope.record(rms_norm(h_n.partition(...), h, w))
            scope.record(matvec(q.partition(...), wq, h_n))
        graph = scope.graph
    """

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.graph: CudaGraph[list[Any]] | None = None
        self._cap: _Capture | None = None
        self._outputs: list[Any] = []
        self._thread = threading.get_ident()

    def __enter__(self) -> "GraphScope":
        _check_not_nested("capturing a graph")
        with LOCK:
            self._cap = _open(self.stream)
        return self

    def record(self, op: DeviceOp[T]) -> T:
        """Capture ``op`` (graph-safe ops only); returns its output."""
        cap = self._cap
        if cap is None:
            raise GraphCaptureError("the capture scope is not open")
        if threading.get_ident() != self._thread:
            raise GraphCaptureError("record ops from the thread that opened the capture")
        with LOCK:
            value = _record(cap, op)
        self._outputs.append(value)
        return value

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        cap = self._cap
        self._cap = None
        if cap is None:
            return
        with LOCK:
            handle = _end(cap, exc_type is None)
        if exc_type is None:
            self.graph = CudaGraph._new(cap.device, self.stream, handle, list(self._outputs), cap)


def capture_graph(stream: Stream | None = None) -> GraphScope:
    """Open a capture scope on ``stream`` (default: a stream of the current device's policy)."""
    from ._device import current_device

    if stream is None:
        stream = current_device().policy.next_stream()
    elif not isinstance(stream, Stream):
        raise TypeError(f"capture_graph() needs a Stream, got {stream!r}")
    return GraphScope(stream)
