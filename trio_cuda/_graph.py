"""CUDA graphs: capture a DAG once, replay it with one driver call.

``op.graph_on(stream)`` (or ``op.graph()``) plans the op's DAG exactly like a
submission and enqueues it with the stream in capture mode: kernel launches and
copies become graph nodes instead of running. The result is a :class:`CudaGraph`:

* ``graph.take_output()`` returns the captured output (the tensors the graph writes)
  once;
* ``graph.update(op)`` submits ``op`` (typically ``api.memcpy(input_buffer, new_data)``)
  on the graph's stream, ordered before later launches: the captured buffers get new
  contents, the graph is not re-instantiated;
* ``graph.launch()`` is a DeviceOp that replays the whole graph with one driver call
  (``await``, ``.sync()``, ``.sync_on(stream)``) and whose output is the captured output.

``trio_cuda.capture_graph(stream)`` is the scope form: ops are recorded imperatively
with ``scope.record(op)`` and the graph is ``scope.graph`` after the block.

Captures are scoped (see :mod:`trio_cuda._capture`): a capture takes only the streams it
records on, by default a private stream, so other tasks keep working on the device;
work that touches a capturing stream or a buffer the open capture recorded is refused
with :class:`GraphCaptureError`. Only graph-safe ops may be captured (kernel launches
and copies between existing tensors, or from host data, which the graph keeps);
allocating or reading back to the host inside a capture raises GraphCaptureError,
before anything is recorded.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from ._capture import Capture
from ._errors import GraphCaptureError
from ._guard import LOCK, check_not_forked, check_not_nested
from ._op import DeviceOp, TensorValuedOp, extensions, is_tensor_like
from ._plan import Lane, Plan
from ._registry import current_device
from ._stream import Stream
from ._submission import submit_blocking

if TYPE_CHECKING:
    from ._device import Device
    from ._memory import Buffer
    from ._tensor import Tensor

__all__ = ["CudaGraph", "GraphScope", "capture_graph"]

T = TypeVar("T")


def _private_stream(device: Device) -> Stream:
    return device.create_stream()


def capture_op(op: DeviceOp[T], stream: Stream | None) -> CudaGraph[T]:
    """Capture ``op``'s DAG on ``stream`` (None: a private stream) into a graph."""
    check_not_nested("capturing a graph")
    if stream is None:
        stream = _private_stream(current_device())
    device = stream.device
    cap = Capture(device, stream)
    cap.auto_end = True
    _, value = submit_blocking(op, stream, cap)
    return CudaGraph._new(device, stream, cap.graph, value, cap)


extensions["capture"] = capture_op


class CudaGraph(Generic[T]):
    """A captured DAG that replays with one driver call. Made by ``op.graph_on(stream)``.

    Attributes:
        device: The device the graph runs on.
        stream: The stream it was captured on (used by :meth:`update`).
        nodes: The number of nodes in the graph.
    """

    device: Device
    stream: Stream
    nodes: int
    _handle: Any
    _output: Any
    _taken: bool
    _accesses: tuple[tuple[Buffer, bool], ...]
    _keep: list[Any]
    _generation: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("CudaGraph cannot be constructed directly; use op.graph_on(stream) or trio_cuda.capture_graph()")

    @classmethod
    def _new(cls, device: Device, stream: Stream, handle: Any, output: Any, cap: Capture) -> CudaGraph[T]:
        self = object.__new__(cls)
        self.device = device
        self.stream = stream
        self._handle = handle
        self._output = output
        self._taken = False
        self._accesses = tuple(cap.accesses.items())  # keeps the buffers alive
        self._keep = cap.keep  # host data copied by the graph
        self._generation = device.generation
        self.nodes = device._driver.graph_nodes(handle)
        return self

    def __repr__(self) -> str:
        return f"<trio_cuda.CudaGraph of {self.nodes} nodes on device {self.device.ordinal}>"

    def take_output(self) -> T:
        """The captured output (the tensors the graph fills), handed out once."""
        if self._taken:
            raise RuntimeError("the graph's output was taken already (take_output() hands it out once)")
        self._taken = True
        return self._output  # type: ignore[no-any-return]

    def update(self, op: DeviceOp[Any]) -> Any:
        """Submit ``op`` (e.g. ``api.memcpy(input_buffer, new_data)``) on the graph's stream now.

        The op is submitted, not awaited: later launches of the graph (and any other
        op touching the same tensors) are ordered after it. Host data is read at once.
        Returns the op's output. (It blocks only if host staging memory must be pinned
        first, which happens for the first copies of a device. In trio,
        ``await api.memcpy(buf, data).then(lambda _: graph.launch())`` does both in
        one await.)
        """
        if not isinstance(op, DeviceOp):
            raise TypeError(f"update() needs a DeviceOp, got {op!r}")
        self._check_live()
        _, value = submit_blocking(op, self.stream)
        return value

    @overload
    def launch(self: CudaGraph[Tensor]) -> TensorValuedOp[Tensor]: ...
    @overload
    def launch(self) -> DeviceOp[T]: ...
    def launch(self) -> Any:
        """A DeviceOp that replays the graph; its output is the captured output (of a
        tensor, a :class:`~trio_cuda.TensorValuedOp`)."""
        self._check_live()
        if is_tensor_like(self._output):
            return _TensorGraphLaunch(self)
        return _GraphLaunch(self)

    def _check_live(self) -> None:
        if self._generation != self.device.generation:
            check_not_forked()  # (a forked child's devices are stale too)
            raise ValueError(f"{self!r} was captured before device {self.device.ordinal} was reset")

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            try:
                self.device._recycle_graph(self._generation, handle)
            except Exception:  # interpreter shutdown
                pass


def _graph_step(lane: Lane, g: CudaGraph[Any]) -> None:
    for buf, written in g._accesses:
        if written:
            lane.write(buf)
        else:
            lane.read(buf)
    g.device._driver.graph_launch(g._handle, lane.stream.handle)
    if g._keep:
        lane.keep(g._keep)  # the graph's host data stays until this replay is done
    seq = lane.end()
    for buf, written in g._accesses:
        if written:
            lane.wrote(buf, seq)
        else:
            lane.was_read(buf, seq)
    g.device._stats.graph_launches += 1


class _GraphLaunch(DeviceOp[T]):
    __slots__ = ("_graph",)

    def __init__(self, graph: CudaGraph[T]) -> None:
        super().__init__()
        self._graph = graph

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> T:
        g = self._graph
        if lane.device is not g.device:
            raise ValueError(f"{g!r} runs on device {g.device.ordinal}, not on device {lane.device.ordinal}")
        if plan.capture is not None:
            raise GraphCaptureError("launching a graph inside another capture is not supported", device=g.device.ordinal)
        g._check_live()
        for buf, _ in g._accesses:
            plan.use(buf, "a buffer of the graph")
        plan.step(lane, _graph_step, g)
        plan.ops.append(f"graph of {g.nodes} nodes")
        return g._output  # type: ignore[no-any-return]


class _TensorGraphLaunch(_GraphLaunch[T], TensorValuedOp[T]):
    __slots__ = ()


class GraphScope:
    """The scope form of capture: record ops imperatively, get the graph at the end.

    ::

        with trio_cuda.capture_graph() as scope:
            scope.record(rms_norm(h_n.partition(...), h, w))
            scope.record(matvec(q.partition(...), wq, h_n))
        graph = scope.graph

    While the scope is open, only its stream and the buffers it recorded are off
    limits to other work.
    """

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.graph: CudaGraph[list[Any]] | None = None
        self._cap: Capture | None = None
        self._outputs: list[Any] = []
        self._thread = threading.get_ident()

    def __enter__(self) -> GraphScope:
        check_not_nested("capturing a graph")
        dev = self.stream.device
        cap = Capture(dev, self.stream)
        with LOCK:
            dev.check_usable()
            dev._current_stream(self.stream)
            cap.begin()
        self._cap = cap
        return self

    def record(self, op: DeviceOp[T]) -> T:
        """Capture ``op`` (graph-safe ops only); returns its output."""
        cap = self._cap
        if cap is None:
            raise GraphCaptureError("the capture scope is not open")
        if threading.get_ident() != self._thread:
            raise GraphCaptureError("record ops from the thread that opened the capture")
        _, value = submit_blocking(op, cap.stream, cap)
        self._outputs.append(value)
        return value  # type: ignore[no-any-return]

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        cap = self._cap
        self._cap = None
        if cap is None:
            return
        keep = exc_type is None and not cap.broken
        with LOCK:
            handle = cap.end(keep)
        if keep:
            self.graph = CudaGraph._new(cap.device, self.stream, handle, list(self._outputs), cap)
        elif exc_type is None:
            raise GraphCaptureError(
                "a record failed half-way while the capture was open; the scope made no graph",
                device=cap.device.ordinal,
            )


def capture_graph(stream: Stream | None = None) -> GraphScope:
    """Open a capture scope on ``stream`` (default: a private stream of the current device)."""
    if stream is None:
        stream = _private_stream(current_device())
    elif not isinstance(stream, Stream):
        raise TypeError(f"capture_graph() needs a Stream, got {stream!r}")
    return GraphScope(stream)
