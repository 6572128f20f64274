"""``trio_cuda.external``: a foreign library's stream-aware call as an op in a DAG.

``external(fn, reads=[...], writes=[...])`` is an op that, when its submission is
enqueued, orders its stream after the pending writes of ``reads`` and the pending reads
and writes of ``writes`` (like any op), then calls ``fn(stream)`` on the submitting
thread: ``fn`` enqueues its work on ``stream`` (a :class:`trio_cuda.Stream`; its
``handle`` is the CUDA stream, as ``torch.cuda.ExternalStream(stream.handle)`` or
``cupy.cuda.ExternalStream(stream.handle)`` take it) and returns at once. Later ops that
touch ``writes`` (or write ``reads``) are ordered after it. The op's output is what
``fn`` returned, once the work is done.

``fn`` must only enqueue: it must not wait for the stream or read device memory on the
host (the data is not there yet when it runs), and it must not execute trio-cuda ops.
Inside a graph capture its work is captured like the op's neighbours, if the library
enqueues capturable work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._op import DeviceOp
from ._ops._core import TensorOp, device_of, tensor_arg
from ._submit import Lane, Pending, Plan
from ._tensor import Partition, Tensor

__all__ = ["external"]


class External(TensorOp):
    __slots__ = ("_fn", "_nreads", "name")

    def __init__(self, fn: Callable[[Any], Any], reads: tuple[Any, ...], writes: tuple[Any, ...], name: str) -> None:
        self._fn = fn
        self._nreads = len(reads)
        self.name = name
        super().__init__((*reads, *writes))

    def _check(self, *args: Any) -> None:
        tensors = [tensor_arg(t, self.name, "reads/writes entry") for t in args]
        if tensors:
            device_of(self.name, tensors)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Any:
        tensors: list[Tensor] = [tensor_arg(t, self.name) for t in args]
        ln = lane.on(device_of(self.name, tensors, lane))
        for t in tensors:
            plan.use(t._buffer, t)
        box: list[Any] = []
        plan.step(ln, _external_step, (self._fn, tensors[: self._nreads], tensors[self._nreads :], box))
        plan.ops.append(self.name)
        plan.pending += 1
        return Pending(lambda: box[0] if box else None)


def _external_step(lane: Lane, arg: tuple[Callable[[Any], Any], list[Tensor], list[Tensor], list[Any]]) -> None:
    fn, reads, writes, box = arg
    for t in reads:
        lane.read(t._buffer, t._tracked)
    for t in writes:
        lane.write(t._buffer, t._tracked)
    box.append(fn(lane.stream))
    seq = lane.end()
    for t in writes:
        lane.wrote(t._buffer, seq, t._tracked)
    for t in reads:
        if all(t._buffer is not w._buffer for w in writes):
            lane.was_read(t._buffer, seq, t._tracked)


def external(
    fn: Callable[[Any], Any],
    *,
    reads: Sequence[Any] = (),
    writes: Sequence[Any] = (),
    name: str | None = None,
) -> DeviceOp[Any]:
    """An op that calls ``fn(stream)`` to enqueue foreign work on the op's stream,
    ordered after the pending accesses to ``reads`` and ``writes`` (tensors or
    tensor-producing ops, all on one device) and before later ones (see the module doc)."""
    if not callable(fn):
        raise TypeError(f"external: fn must be callable (it gets the stream), not {type(fn).__name__}")
    label = f"external {name or getattr(fn, '__name__', 'call')}"

    def entries(xs: Sequence[Any], what: str) -> tuple[Any, ...]:
        if isinstance(xs, (Tensor, DeviceOp, Partition)) or not isinstance(xs, Sequence):
            raise TypeError(f"{label}: {what} must be a list of tensors (or ops producing them)")
        out = []
        for x in xs:
            if isinstance(x, Partition):
                x = x.tensor
            if not isinstance(x, (Tensor, DeviceOp)):
                raise TypeError(f"{label}: {what} entries must be tensors or ops producing them, not {type(x).__name__}")
            out.append(x)
        return tuple(out)

    return External(fn, entries(reads, "reads"), entries(writes, "writes"), label)
