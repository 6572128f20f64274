"""Stream and event internals for experts: ``from trio_cuda import lowlevel``.

Most programs never need these: ops order themselves through the tensors they touch.
They are for interop with other libraries' streams and for tests of ordering.

* :class:`Stream` and :class:`Event`: a stream counts its points (``seq``); an event
  marks one (``event.seq``) and completes when the work before it does.
* :func:`record` records an event at a stream's current point; :func:`stream_wait`
  orders a stream after an event (of any device); :func:`wait` waits for an event in
  trio (a checkpoint; DeviceFault/DeviceReset as for ops).
* :func:`submit` enqueues an op now and returns a handle to wait for it later
  (``await (await lowlevel.submit(op)).wait()`` is ``await op``).
* :func:`accesses` shows a tensor's pending writer and readers, as ``(stream, seq)``.
* :func:`notifier_statistics` counts awaits completed on the fast and the slow path;
  :func:`submission_statistics` counts submissions and what they waited for.
* :func:`compiled` names the modules that run compiled.
* The scheduling policies and :class:`~trio_cuda.ScheduledOp` are here too.
"""

from __future__ import annotations

from typing import Any

from . import _loop
from ._checks import arg_type
from ._compiled import compiled_modules
from ._device import Device
from ._errors import GraphCaptureError
from ._guard import LOCK
from ._notifier import NotifierStatistics, notifier, wait_event
from ._op import DeviceOp, ScheduledOp
from ._registry import as_device
from ._scheduling import PoolStatistics, SchedulingPolicy, SingleStream, StreamPoolByLoad, StreamPoolRoundRobin
from ._stream import Event, Stream
from ._submission import SubmissionStatistics, Submitted, submit_async
from ._submission import statistics as _submission_statistics

__all__ = [
    "Event",
    "NotifierStatistics",
    "PoolStatistics",
    "ScheduledOp",
    "SchedulingPolicy",
    "SingleStream",
    "Stream",
    "StreamPoolByLoad",
    "StreamPoolRoundRobin",
    "SubmissionStatistics",
    "Submitted",
    "accesses",
    "compiled",
    "external_stream",
    "notifier_statistics",
    "record",
    "stream_wait",
    "submission_statistics",
    "submit",
    "wait",
]


def compiled() -> tuple[str, ...]:
    """The modules of trio-cuda that run compiled (built by Cython from their own source
    at install, see docs/runtime.md); empty when everything runs interpreted."""
    return compiled_modules()


def record(stream: Stream) -> Event:
    """An event at the current point of ``stream`` (covering all work enqueued on it so far)."""
    if not isinstance(stream, Stream):
        raise TypeError(f"record() needs a Stream, got {stream!r}")
    with LOCK:
        stream.device.check_usable()
        stream.device._current_stream(stream)
        if stream.capture is not None:
            raise GraphCaptureError("the stream is recording a graph capture", device=stream.device.ordinal)
        return stream.event_at(stream.mark())


def external_stream(handle: int, device: Device | int | None = None) -> Stream:
    """Another library's CUDA stream (``torch.cuda.Stream().cuda_stream``,
    ``cupy.cuda.Stream().ptr``, a ``cudaStream_t`` as an int) of ``device`` (default: the
    current device) as a :class:`~trio_cuda.Stream`: submit ops on it with
    :func:`submit` or ``op.schedule``; they are ordered with the library's own work on that
    stream and, like on any stream, with trio-cuda's other streams. trio-cuda never
    destroys it, and uses it only while submitting: the library may destroy it once the
    work submitted on it is done (memory last used there is freed on a stream of
    trio-cuda's, after that work). After a reset of the device it refuses use. CUDA only
    (the simulated device has no CUDA streams: TypeError)."""
    return as_device(device).external_stream(handle)


def stream_wait(stream: Stream, event: Event) -> None:
    """Make later work on ``stream`` wait until ``event`` completes (no host wait)."""
    if not isinstance(stream, Stream) or not isinstance(event, Event):
        raise TypeError("stream_wait() needs a Stream and an Event")
    with LOCK:
        stream.device.check_usable()
        if event.generation != event.device.generation or event.done:
            return  # complete, or its device was reset: nothing of it is pending any more
        stream.device._current_stream(stream)
        if stream.capture is not None:
            raise GraphCaptureError("the stream is recording a graph capture", device=stream.device.ordinal)
        stream._enqueue_wait(event)


async def wait(event: Event) -> None:
    """Wait in trio until ``event`` completes (always a checkpoint)."""
    if not isinstance(event, Event):
        raise TypeError(f"wait() needs an Event, got {event!r}")
    await _loop.checkpoint_if_cancelled()  # (also where the event is complete already)
    await wait_event(event)


def accesses(tensor: Any) -> tuple[tuple[Stream, int] | None, dict[Stream, int]]:
    """The pending tracked accesses of ``tensor``'s memory: ``(writer, {reader: seq})``."""
    buf = tensor._as_tensor()._buffer
    with LOCK:
        return buf.writer, dict(buf.readers)


def notifier_statistics() -> NotifierStatistics:
    """How awaits completed so far: fast path (polling) vs slow path (parked), and the
    helper thread's wake-ups (it does not wake while nothing is parked)."""
    return notifier().statistics()


async def submit(op: Any, stream: Stream | None = None) -> Submitted:
    """Plan and enqueue ``op`` now (on ``stream``, default the current device's policy),
    without waiting for its work; ``await handle.wait()`` waits and returns the output.

    Cancellation before the op is enqueued means it did not happen, as for ``await op``.
    """
    if isinstance(op, ScheduledOp):
        raise TypeError("submit() needs a DeviceOp, got a ScheduledOp: submit(scheduled.op, scheduled.stream)")
    if not isinstance(op, DeviceOp):
        raise TypeError(f"submit() needs a DeviceOp, got {arg_type(op)}")
    return await submit_async(op, _stream_arg(stream))


def _stream_arg(stream: object) -> Stream | None:
    if stream is None or isinstance(stream, Stream):
        return stream
    policy = callable(getattr(stream, "next_stream", None))
    hint = " (for a policy's choice: submit(op, policy.next_stream()))" if policy else ""
    raise TypeError(f"submit() needs a Stream or None, got {arg_type(stream)}{hint}")


def submission_statistics() -> SubmissionStatistics:
    """Submissions planned, enqueued, abandoned and failed so far, and how often one had
    to wait before enqueueing (first-launch compilation, pinned memory, another
    submission, out of memory)."""
    with LOCK:
        return _submission_statistics()
