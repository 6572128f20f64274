"""Submission: plan the whole DAG, then enqueue it; and the waits in between.

A submission has two phases:

1. **Plan** (host work only, no driver call): the DAG is walked iteratively (any
   depth) in dependency order. ``then`` callbacks run, arguments are resolved and
   validated, every op appends its *steps* (what it will enqueue) to the plan, and
   allocations are sized. A bad argument anywhere raises here: nothing of the DAG ran.
2. **Enqueue** (driver calls): allocations first (so an out-of-memory error leaves
   nothing half-run), then the steps in order, each on its *lane* (a stream): before a
   step touches a buffer its lane waits for the buffer's pending accesses on other
   streams, afterwards the step is registered as the buffer's writer or reader. The
   submission ends with one event on the root lane.

Both phases run under the runtime lock, in one hold in the common case. Between them a
submission may have to *wait*, with the lock released: for a first-launch kernel
compilation, for pinned staging memory, for the communicators of a collectives group
(NCCL's setup, slow), for another unfinished submission whose shared op or buffer it uses, or (out of memory) for the device's pending work before
one retry. Under ``await`` these waits happen in a worker thread or in trio, and are
cancellable: a submission cancelled before it enqueues did not happen (its ops are not
consumed), unless another submission already relies on it, in which case it completes
(shielded; bounded by the wait) and then raises Cancelled.

Host values produced by device work (``to_host``) are *pending* until the
submission's event completes; they are resolved, and ``map`` callbacks over them
applied, afterwards.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _loop, _trace
from ._capture import Capture
from ._errors import DeviceError
from ._guard import LOCK, _tls, check_blocking_allowed, check_not_nested
from ._loop import cancel_shielded_checkpoint, checkpoint_if_cancelled
from ._needs import Need
from ._notifier import wait_event, wait_steps
from ._pending import checked, resolve
from ._plan import PLANNED, Plan, check_generations, counts, name_fault
from ._registry import current_device
from ._staging import Staging, copies_completed

if TYPE_CHECKING:
    from ._stream import Stream

__all__ = ["SubmissionStatistics", "Submitted", "await_op", "begin", "run_sync", "statistics", "submit_async", "submit_blocking"]
#: False sends every submission through a plan (a test hook: tests compare the two paths).
direct_on = True


@dataclass(frozen=True)
class SubmissionStatistics:
    """What submissions did so far (see :func:`trio_cuda.lowlevel.submission_statistics`).

    Attributes:
        planned: Submissions planned (a bad argument raises before this counts).
        enqueued: Submissions that enqueued their work.
        abandoned: Submissions abandoned before they enqueued (cancelled, or an error
            while they waited); nothing of them ran.
        failed: Submissions whose enqueue failed part-way (a driver error, or an
            ``external`` call that raised).
        waited_for_kernels: Waits for a first-launch compilation.
        waited_for_staging: Waits for pinned host memory.
        waited_for_submission: Waits for another submission's shared op or buffer.
        waited_for_memory: Out-of-memory waits for the device's pending work.
        direct: Of the enqueued, submissions planned and enqueued in one step without
            a plan: a lone kernel launch or a replayed ``ops`` call of one launch or
            GEMM, on memory already allocated (see docs/runtime.md).
        waited_for_communicators: Waits for a collectives group's communicators to be
            made (its first collective, and the first after a reset of its devices).
    """

    planned: int
    enqueued: int
    abandoned: int
    failed: int
    waited_for_kernels: int
    waited_for_staging: int
    waited_for_submission: int
    waited_for_memory: int
    direct: int
    waited_for_communicators: int


def statistics() -> SubmissionStatistics:
    c = counts
    return SubmissionStatistics(
        c["planned"],
        c["enqueued"],
        c["abandoned"],
        c["failed"],
        c["kernels"],
        c["staging"],
        c["plan"],
        c["memory"],
        c["direct"],
        c["communicators"],
    )


# -- entry points ---------------------------------------------------------------------------------
def begin(op: Any, stream: Stream, capture: Capture | None = None) -> tuple[Plan, Any, Need | None]:
    """Plan ``op`` on ``stream`` and enqueue it if nothing is missing.

    Returns (plan, output value, what to wait for before enqueueing, or None).
    """
    tls = _tls
    if tls.submitting:
        check_not_nested("executing a DeviceOp")
    with LOCK:
        plan = Plan(stream, capture)
        if _trace.active is not None:
            _trace.active.begin(plan)
        tls.submitting = True
        try:
            value = plan.walk(op)
        except BaseException as exc:
            tls.submitting = False
            plan.abort(exc)
            raise
        tls.submitting = False
        if plan.checks:  # the ops' device-side checks run before the output is returned
            value = checked(value, plan.checks)
            plan.pending += 1
        plan.state = PLANNED
        counts["planned"] += 1
        need = plan.advance()
    return plan, value, need


def _give_up(plan: Plan, exc: BaseException) -> None:
    """Abandon ``plan`` after ``exc`` ended its wait. The submissions relying on it fail
    with ``exc``, or, where ``exc`` interrupted its task alone (KeyboardInterrupt, a
    cancel, a coroutine closed with its loop), with a DeviceError saying so: the
    interruption is not theirs to raise."""
    if not isinstance(exc, Exception):
        exc = DeviceError(f"a submission it relies on was abandoned before it enqueued ({type(exc).__name__} in its task)")
    with LOCK:
        plan.abort(exc)


def submit_blocking(op: Any, stream: Stream, capture: Capture | None = None) -> tuple[Plan, Any]:
    """Plan and enqueue ``op``, waiting in the calling thread when needed; no completion wait."""
    plan, value, need = begin(op, stream, capture)
    while need is not None:
        try:
            need.wait_blocking()
        except BaseException as exc:
            _give_up(plan, exc)
            raise
        with LOCK:
            need = plan.advance()
    return plan, value


async def _finish_shielded(plan: Plan, need: Need | None) -> None:
    """Complete ``plan``, which another submission relies on, whatever cancels the
    caller; a wait that fails abandons it (its dependents raise the error instead of
    waiting for it forever)."""

    async def finish() -> None:  # (run again by shielded where its own task is cancelled)
        nonlocal need
        while need is not None:
            try:
                await need.wait_async()
            except _loop.CANCELLED:
                raise
            except BaseException as exc:
                _give_up(plan, exc)
                raise
            with LOCK:
                need = plan.advance()

    await _loop.shielded(finish)


class Submitted:
    """A submission that has been enqueued (see :func:`trio_cuda.lowlevel.submit`).

    It keeps only what waiting needs (not the plan, whose steps reference tensors).

    Attributes:
        event: The event its work completes at (None if it enqueued no device work).
    """

    __slots__ = ("_generations", "_ops", "_ordinal", "_pending", "_staging", "_taken", "event", "value")

    def __init__(self, plan: Plan, value: Any) -> None:
        self.value = value
        self.event = plan.event
        self._generations = plan.generations
        self._pending = bool(plan.pending)
        self._ops = plan.ops
        self._ordinal = plan.root.device.ordinal
        self._taken = False
        self._staging = _completed_staging(plan)

    async def wait(self) -> Any:
        """Wait for the work (a checkpoint) and return the op's output (once)."""
        if self._taken:
            raise RuntimeError("the output of this submission was taken already")
        # (a cancellation point also where the work is done already: the output stays for a later wait)
        await checkpoint_if_cancelled()
        ev = self.event
        if ev is None:
            await cancel_shielded_checkpoint()
        else:
            try:
                await wait_event(ev, tuple(self._ops))  # (the adaptive wait learns by the ops' names)
            except DeviceError as err:
                raise name_fault(err, self._ops, self._ordinal) from err
        if len(self._generations) > 1:
            check_generations(self._generations, self._ops)
        self._taken = True
        value, self.value = self.value, None
        staging, self._staging = self._staging, ()
        return _finish(value, self._pending, staging)


def _completed_staging(plan: Plan) -> tuple[Staging, ...]:
    """The staging buffers of ``plan``'s copies, to give back once its event is seen
    done (every copy of the submission is before that event: the root lane joins every
    fork first). None without an event, and none of a graph capture: its buffers stay
    with the graph, whose replays copy through them again."""
    if not plan.staging or plan.capture is not None or plan.event is None:
        return ()
    return tuple(slot.staging for slot in plan.staging if slot.staging is not None)


def _finish(value: Any, pending: Any, staging: tuple[Staging, ...]) -> Any:
    """The output of a submission whose event was seen done: host values copied out,
    then its staging buffers back to their pools at once (not at the next submission),
    so idle pinned memory beyond the cap is let go before the caller resumes."""
    try:
        return resolve(value) if pending else value
    finally:
        if staging:
            copies_completed(staging)


async def _enqueue_async(plan: Plan, need: Need | None) -> None:
    """Wait for what the plan needs (in the task's loop) until it enqueues."""
    while need is not None:
        try:
            await need.wait_async()
        except _loop.CANCELLED:
            # Decided under LOCK: a submission starting to rely on this one takes LOCK too,
            # so it either sees this one abandoned (and plans the ops itself) or is counted.
            with LOCK:
                relied_on = plan.dependents > 0
                if not relied_on:
                    plan.abort(DeviceError("cancelled"))
            if relied_on:
                # Another submission relies on this one: complete it, then honour the cancel.
                await _finish_shielded(plan, need)
            raise
        except BaseException as exc:
            _give_up(plan, exc)
            raise
        with LOCK:
            need = plan.advance()


async def submit_async(op: Any, stream: Stream | None = None) -> Submitted:
    """Plan and enqueue ``op`` (waiting in the task's loop where needed); do not wait for its work."""
    await checkpoint_if_cancelled()
    if stream is None:
        stream = current_device()._submission_stream()
    plan, value, need = begin(op, stream)
    if need is not None:
        await _enqueue_async(plan, need)
    return Submitted(plan, value)


def await_op(op: Any, stream: Stream | None = None) -> Generator[Any, Any, Any]:
    """``await op`` (``DeviceOp.__await__``): submit on ``stream`` (default: the current
    device's policy) and wait in the task's loop (trio or asyncio, through their public
    checkpoints). A generator rather than a coroutine: the common await is then one frame
    of its own."""
    yield from checkpoint_if_cancelled().__await__()
    if stream is None:
        stream = current_device()._submission_stream()
    submit_now = op._submit_now
    if submit_now is None or not direct_on or _trace.active is not None:  # a trace sees every plan
        return (yield from _run_planned(op, stream).__await__())
    done = submit_now(stream)
    if done is None:  # not planned and enqueued in one step (see _Launch._submit_now)
        return (yield from _run_planned(op, stream).__await__())
    value, ev, names = done
    if ev is None:
        yield from cancel_shielded_checkpoint().__await__()
        return value
    try:
        yield from wait_steps(ev, names)  # (names: one Names per launch geometry or recipe, the kind)
    except DeviceError as err:
        raise name_fault(err, names, stream.device.ordinal) from err
    return value


async def _run_planned(op: Any, stream: Stream) -> Any:
    """The general path of ``await op`` (after the cancel check): plan, enqueue (waiting
    in the task's loop where needed), wait for the submission's event."""
    plan, value, need = begin(op, stream)
    if need is not None:
        await _enqueue_async(plan, need)
    ev = plan.event
    if ev is None:
        await cancel_shielded_checkpoint()
    else:
        try:
            await wait_event(ev, tuple(plan.ops))  # (the adaptive wait learns by the ops' names)
        except DeviceError as err:
            raise plan.fault(err) from err
    if len(plan.generations) > 1:
        check_generations(plan.generations, plan.ops)
    return _finish(value, plan.pending, _completed_staging(plan))


def run_sync(op: Any, stream: Stream | None = None, what: str = "op.sync()") -> Any:
    """``op.sync()``: submit and block the calling (non-trio) thread until done (``what``:
    the call, as a refusal on a loop's thread names it)."""
    check_blocking_allowed(what)
    if stream is None:
        stream = current_device()._submission_stream()
    submit_now = op._submit_now
    if submit_now is not None and direct_on and _trace.active is None:  # a trace sees every plan
        done = submit_now(stream)
        if done is not None:  # planned and enqueued in one step (see _Launch._submit_now)
            value, ev, names = done
            if ev is not None:
                try:
                    ev.device.wait_blocking(ev)
                except DeviceError as err:
                    raise name_fault(err, names, stream.device.ordinal) from err
            return value
    plan, value = submit_blocking(op, stream)
    ev = plan.event
    if ev is not None:
        try:
            ev.device.wait_blocking(ev)
        except DeviceError as err:
            raise plan.fault(err) from err
    if len(plan.generations) > 1:
        check_generations(plan.generations, plan.ops)
    return _finish(value, plan.pending, _completed_staging(plan))
