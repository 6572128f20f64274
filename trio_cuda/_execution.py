"""Execution: submitting a DAG of ops and waiting for it.

Submission walks the DAG iteratively (any depth), in dependency order, and
enqueues each op's work on its *lane*: a stream of the current device. ``then``
continuations stay on their lane; ``zip`` may fork independent branches onto
other streams of the policy and joins them back with event waits; tensors order
work across streams by themselves (see ``_tensor``). The whole submission is host
work under one lock: no await happens in the middle, so a submission is atomic with
respect to other tasks and threads. It ends with one event on the root lane, and the
caller waits for that event (trio: the notifier; plain code: the event).

Host values produced by device work (``to_host``) are *pending* until that event
completes; they are resolved, and ``map`` callbacks over them applied, afterwards.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import trio

from ._device import Device, current_device
from ._errors import DeviceFault, NestedExecutionError, OpAlreadyExecuted
from ._notifier import wait_event
from ._stream import Event, Stream

if TYPE_CHECKING:
    from ._op import DeviceOp
    from ._tensor import Buffer

__all__ = [
    "Continue",
    "Lane",
    "Pending",
    "check_blocking_allowed",
    "contains_pending",
    "resolve",
    "run_async",
    "run_sync",
    "submit",
]

LOCK = threading.RLock()


class _ThreadState(threading.local):
    active = False  # True while this thread is inside a submission


_tls = _ThreadState()


# -- pending host values ------------------------------------------------------------
class Pending:
    """A host value that exists once the submission's work has completed."""

    __slots__ = ("_fn", "_value", "_done")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = False
        self._value: Any = None

    def resolve(self) -> Any:
        if not self._done:
            self._value = self._fn()
            self._done = True
            self._fn = None  # type: ignore[assignment]
        return self._value


def contains_pending(v: Any) -> bool:
    t = type(v)
    if isinstance(v, Pending):
        return True
    if t is tuple or t is list:
        return any(contains_pending(x) for x in v)
    return False


def resolve(v: Any) -> Any:
    """Replace pending host values in ``v`` (and in tuples/lists inside it) by their values."""
    t = type(v)
    if isinstance(v, Pending):
        return v.resolve()
    if t is tuple:
        return tuple(resolve(x) for x in v) if contains_pending(v) else v
    if t is list:
        return [resolve(x) for x in v]
    return v


class Continue:
    """Returned by an op's ``_run`` to continue with another op on the same lane."""

    __slots__ = ("op",)

    def __init__(self, op: "DeviceOp[Any]") -> None:
        self.op = op


# -- lanes ----------------------------------------------------------------------------
class Lane:
    """Where a (part of a) submission enqueues: one stream, plus the lanes forked from it."""

    __slots__ = ("stream", "device", "start", "need", "forks", "pending", "capture", "ops")

    def __init__(self, stream: Stream, capture: Any = None) -> None:
        self.stream = stream
        self.device = stream.device
        self.start = stream.seq
        self.need = 0
        self.forks: list[Lane] = []
        self.pending = 0
        self.capture = capture
        self.ops: list[str] = []

    def fork(self, device: Device | None = None) -> "Lane":
        """A lane on another stream (of ``device``, default this lane's) joined at the end."""
        dev = device or self.device
        stream = self.capture.fork_stream(dev) if self.capture is not None else dev.policy.next_stream()
        lane = Lane(stream, self.capture)
        lane.ops = self.ops
        self.forks.append(lane)
        return lane

    def on(self, device: Device) -> "Lane":
        """This lane if it is on ``device``, else a forked lane on a stream of ``device``."""
        return self if device is self.device else self.fork(device)

    def depend(self, stream: Stream, seq: int) -> None:
        """Order the rest of this lane after point ``seq`` of ``stream``, and wait for it at the end."""
        s = self.stream
        if seq <= stream.done_seq:
            return
        cap = self.capture
        if cap is not None and not cap.inside(stream, seq):
            return  # work from before the capture: the capture is ordered after it
        if stream is s:
            if seq > self.need:
                self.need = seq
            return
        s.wait_for(stream, seq)
        self.need = s.mark()

    # dependency tracking -----------------------------------------------------------
    # read()/write() order this lane after the buffer's pending accesses (before the op
    # is enqueued); wrote()/was_read() register the op's access (after). Inside a graph
    # capture only accesses made within the capture are waited for (the capture joined
    # every stream of the device when it began), and the capture remembers each buffer's
    # state before it so that it can be restored: nothing really ran.
    def read(self, buf: "Buffer") -> None:
        cap = self.capture
        if cap is not None:
            cap.touch(buf, False)
        w = buf.writer
        if w is not None and w[0] is not self.stream and (cap is None or cap.inside(w[0], w[1])):
            self.stream.wait_for(w[0], w[1])

    def write(self, buf: "Buffer") -> None:
        cap = self.capture
        if cap is not None:
            cap.touch(buf, True)
        s = self.stream
        w = buf.writer
        if w is not None and w[0] is not s and (cap is None or cap.inside(w[0], w[1])):
            s.wait_for(w[0], w[1])
        for r, seq in buf.readers.items():
            if r is not s and (cap is None or cap.inside(r, seq)):
                s.wait_for(r, seq)

    def wrote(self, buf: "Buffer", seq: int) -> None:
        buf.writer = (self.stream, seq)
        buf.readers.clear()

    def was_read(self, buf: "Buffer", seq: int) -> None:
        buf.readers[self.stream] = seq

    def keep(self, obj: Any) -> None:
        """Keep host memory a pending copy uses alive until the copy is done (or the graph dies)."""
        if self.capture is not None:
            self.capture.keep.append(obj)
        else:
            self.stream.keep(obj)

    def end(self) -> int:
        """Close the point of the op just enqueued; returns its seq."""
        return self.stream.mark()

    def join(self) -> None:
        """Join every forked lane back into this one."""
        for f in self.forks:
            f.join()
            fs = f.stream
            seq = fs.seq if fs.seq > f.start else f.need
            if seq:
                self.depend(fs, seq)
            self.pending += f.pending
        self.forks = []

    def finish(self) -> Event | None:
        """Join forks and return the event the caller waits for (None if nothing to wait for)."""
        self.join()
        s = self.stream
        seq = s.seq if s.seq > self.start else self.need
        if seq == 0 or seq <= s.done_seq:
            return None
        return s.event_at(seq)


# -- the walk ---------------------------------------------------------------------------
def evaluate(root: "DeviceOp[Any]", lane: Lane) -> Any:
    """Enqueue the work of ``root`` and everything it depends on; return its output value."""
    if root._state is None and not root._inputs:
        # A lone op (the common `await launch(tensors...)`): no walk needed.
        root._state = True
        r = root._run(lane, ())
        if type(r) is not Continue:
            return r
        root = r.op
    values: list[Any] = []
    work: list[tuple[Any, Lane, int]] = [(root, lane, -1)]
    try:
        _walk(work, values)
    except BaseException as exc:
        # Shared ops whose execution this failure interrupted remember it, so later
        # consumers see the same error instead of a half-executed op.
        for op, _, n in work:
            if n >= 0 and hasattr(op, "_fail"):
                op._fail(exc)
        raise
    assert len(values) == 1
    return values[0]


def _walk(work: list[tuple[Any, Lane, int]], values: list[Any]) -> None:
    # Frames are (op, lane, n): n < 0 enters the op, n >= 0 runs it on its n input values.
    pop = work.pop
    push = work.append
    vpush = values.append
    while work:
        op, ln, n = pop()
        if n < 0:
            state = op._state
            if state is not None:
                # Already executed: only shared ops allow this.
                if state is True:
                    raise OpAlreadyExecuted(
                        f"{op!r} was executed already; an op describes work that happens once "
                        "(use .shared() for an op with several consumers)"
                    )
                vpush(op._reuse(ln))
                continue
            op._state = True
            inputs = op._inputs
            k = len(inputs)
            if k:
                push((op, ln, k))
                if op._forks:
                    lanes = op._lanes(ln, k)
                    for i in range(k - 1, -1, -1):
                        push((inputs[i], lanes[i], -1))
                elif k == 1:
                    push((inputs[0], ln, -1))
                else:
                    for i in range(k - 1, -1, -1):
                        push((inputs[i], ln, -1))
                continue
            r = op._run(ln, ())
        else:
            if n == 1:
                r = op._run(ln, (values.pop(),))
            else:
                args = values[-n:]
                del values[-n:]
                r = op._run(ln, args)
        if type(r) is Continue:
            push((r.op, ln, -1))
        else:
            vpush(r)


def _check_not_nested(what: str) -> None:
    if _tls.active:
        raise NestedExecutionError(
            f"{what} inside another op's submission (a then()/map() callback or an open graph "
            "capture); return the op from the callback instead of executing it"
        )


def submit(op: "DeviceOp[Any]", stream: Stream, capture: Any = None) -> tuple[Any, Event | None, Lane]:
    """Enqueue ``op`` on ``stream``; returns (output value, completion event or None, lane)."""
    if _tls.active:
        _check_not_nested("executing a DeviceOp")
    device = stream.device
    with LOCK:
        if device._capturing and capture is None:
            from ._errors import GraphCaptureError

            raise GraphCaptureError(
                "another op was executed while a graph capture is open on this device; "
                "finish the capture first (or record the op into the capture scope)",
                device=device.ordinal,
            )
        if device._driver.fault() is not None:
            device._check_usable()
        if stream._generation != device._generation:
            stream._attach()
        _tls.active = True
        try:
            if stream._keep:
                stream.retire()
            if device._pending_frees and capture is None:
                device._flush_frees(stream)
            lane = Lane(stream, capture)
            value = evaluate(op, lane)
            ev = lane.finish()
        finally:
            _tls.active = False
        device._stats.submissions += 1
    return value, ev, lane


def _describe(lane: Lane) -> str | None:
    if not lane.ops:
        return None
    names = list(dict.fromkeys(lane.ops))
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def _fault(fault: DeviceFault, lane: Lane) -> DeviceFault:
    ops = _describe(lane)
    if ops is None or fault.op is not None:
        return fault
    device = fault.device if fault.device is not None else lane.device.ordinal
    return DeviceFault(f"{fault.message} (in the work of this submission)", device=device, op=ops)


def check_blocking_allowed(what: str) -> None:
    """Raise if a blocking call would stall a running trio loop (or nest in a submission)."""
    _check_not_nested(what)
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return
    raise RuntimeError(
        f"{what} would block the trio event loop; use 'await' inside trio "
        "(or run the blocking call in a worker thread: await trio.to_thread.run_sync(op.sync))"
    )


async def run_async(op: "DeviceOp[Any]", stream: Stream | None = None) -> Any:
    """``await op``: submit on ``stream`` (default: the current device's policy) and wait in trio."""
    await trio.lowlevel.checkpoint_if_cancelled()
    if stream is None:
        stream = current_device().policy.next_stream()
    value, ev, lane = submit(op, stream)
    if ev is None:
        await trio.lowlevel.cancel_shielded_checkpoint()
    else:
        try:
            await wait_event(ev)
        except DeviceFault as f:
            raise _fault(f, lane) from f
    return resolve(value) if lane.pending else value


_SPIN_NS = 100_000


def run_sync(op: "DeviceOp[Any]", stream: Stream | None = None) -> Any:
    """``op.sync()``: submit and block the calling (non-trio) thread until done."""
    check_blocking_allowed("op.sync()")
    if stream is None:
        stream = current_device().policy.next_stream()
    value, ev, lane = submit(op, stream)
    if ev is not None:
        try:
            deadline = time.perf_counter_ns() + _SPIN_NS
            while not ev.query():
                if time.perf_counter_ns() > deadline:
                    ev.synchronize()
                    break
        except DeviceFault as f:
            raise _fault(f, lane) from f
    return resolve(value) if lane.pending else value
