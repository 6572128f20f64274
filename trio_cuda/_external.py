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

If ``fn`` raises, the rest of the submission is not enqueued and the await raises
:class:`~trio_cuda.ExternalCallError` naming the ops enqueued before the call (they
complete) and those not run (docs/interop.md states the contract).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._checks import arg_type
from ._errors import ExternalCallError
from ._op import DeviceOp, is_function
from ._ops._core import LibraryOp, device_of, tensor_arg
from ._pending import Pending
from ._plan import Lane, Plan
from ._tensor import Partition, Tensor
from ._trace import work_labels

__all__ = ["external"]


class External(LibraryOp):
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
        call = _Call(self._fn, tensors[: self._nreads], tensors[self._nreads :], self.name)
        plan.step(ln, _external_step, call)
        plan.ops.append(self.name)
        plan.pending += 1
        return Pending(lambda: call.result[0] if call.result else None)


class _Call:
    """What an external step calls, on what, and what it returned."""

    __slots__ = ("fn", "name", "reads", "result", "writes")

    def __init__(self, fn: Callable[[Any], Any], reads: list[Tensor], writes: list[Tensor], name: str) -> None:
        self.fn = fn
        self.reads = reads
        self.writes = writes
        self.name = name
        self.result: list[Any] = []


def _external_step(lane: Lane, call: _Call) -> None:
    reads, writes = call.reads, call.writes
    for t in reads:
        lane.read(t._buffer, t._tracked)
    for t in writes:
        lane.write(t._buffer, t._tracked)
    try:
        call.result.append(call.fn(lane.stream))
    except BaseException as exc:
        # What fn enqueued before raising is on the stream: its tensors are kept alive
        # and later ops are ordered after it, as after work that completed.
        _accessed(lane, reads, writes)
        if isinstance(exc, Exception):
            raise _call_failed(lane, call, exc) from exc
        raise
    _accessed(lane, reads, writes)


def _accessed(lane: Lane, reads: list[Tensor], writes: list[Tensor]) -> None:
    seq = lane.end()
    for t in writes:
        lane.wrote(t._buffer, seq, t._tracked)
    for t in reads:
        if all(t._buffer is not w._buffer for w in writes):
            lane.was_read(t._buffer, seq, t._tracked)


def _call_failed(lane: Lane, call: _Call, exc: Exception) -> ExternalCallError:
    """The error of a call that raised: which ops of its submission were enqueued before
    it (they complete) and which were not (the plan's steps after it are not run)."""
    plan = lane.plan
    steps = plan.steps
    at = next(i for i, st in enumerate(steps) if st[2] is call)
    before, after = work_labels(steps[:at]), work_labels(steps[at + 1 :])
    if plan.capture is not None:
        # Nothing of a capture runs before its graph is launched, and this one is discarded.
        ran: tuple[str, ...] = ()
        not_run = before + after
        what = "inside a graph capture: nothing ran"
    else:
        ran, not_run = before, after
        what = f"enqueued before it (their work completes): {_listed(ran)}; not run: {_listed(not_run)}"
    return ExternalCallError(
        f"{call.name} raised {type(exc).__name__}: {exc}; {what}",
        device=lane.device.ordinal,
        op=call.name,
        ran=ran,
        not_run=not_run,
    )


def _listed(names: tuple[str, ...]) -> str:
    if not names:
        return "nothing"
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


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
    if not is_function(fn):
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
                raise TypeError(f"{label}: {what} entries must be tensors or ops producing them, not {arg_type(x)}")
            out.append(x)
        return tuple(out)

    return External(fn, entries(reads, "reads"), entries(writes, "writes"), label)
