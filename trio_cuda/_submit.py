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

import threading
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from . import _trace
from ._capture import Capture
from ._errors import DeviceError, DeviceFault, DeviceOutOfMemory, DeviceReset, GraphCaptureError, OpAlreadyExecuted, fresh
from ._guard import LOCK, _tls, check_blocking_allowed, check_not_nested
from ._memory import Buffer
from ._notifier import wait_event
from ._registry import current_device
from ._staging import Staging, StagingPool, copies_completed, pin, pool_of
from ._stream import dropped_stream

if TYPE_CHECKING:
    from ._backends._boundary import KernelSource
    from ._device import Device
    from ._stream import Event, Stream

__all__ = [
    "Continue",
    "Hold",
    "Lane",
    "Pending",
    "Plan",
    "contains_pending",
    "resolve",
    "Submitted",
    "run_sync",
    "submit_async",
    "submit_blocking",
]


# -- statistics ----------------------------------------------------------------------
# Counted under the runtime lock.
_counts = {
    "planned": 0,
    "enqueued": 0,
    "abandoned": 0,
    "failed": 0,
    "kernels": 0,
    "staging": 0,
    "plan": 0,
    "memory": 0,
    "direct": 0,
    "communicators": 0,
}


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


# -- direct submissions ---------------------------------------------------------------
# A lone op whose enqueue is one step on memory that is allocated and not captured
# (``await kernel(tensors...)``, a replayed ``ops.*`` call) is planned and enqueued in
# one step: the op checks its own arguments, direct_ready() tidies the device as the
# general path would and says whether that path would do anything more than run the
# step (raise, wait, capture), and direct_enqueue() runs it with the same effects. When
# it says no, the op takes the general path, which does (or explains) the rest.
#: False sends every submission through a plan (a test hook: tests compare the two paths).
direct_on = True


def direct_ready(s: Stream, generation: int) -> bool:
    """Whether a one-step submission made for device generation ``generation`` may
    enqueue on ``s`` now without a plan, after freeing the memory and destroying the
    streams and graphs the device holds for the next submission (under LOCK)."""
    device = s.device
    if (
        generation != device.generation
        or device._resetting
        or device._driver._fault is not None
        or s.generation != generation
        or s.capture is not None
        or s._dropped
    ):
        return False
    if device._dead_buffers or device._dead_streams or device._lingering or device._dead_graphs:
        direct_tidy(device)
    return True


def direct_tidy(device: Device) -> None:
    """What the general path does before its first driver call (under LOCK): free the
    memory, destroy the streams and graphs the device holds for the next submission. A
    failure counts as an abandoned submission, as there."""
    try:
        if device._dead_buffers:
            device.flush_frees()  # before streams are destroyed: a free may name one
        if device._dead_streams or device._lingering or device._dead_graphs:
            device._housekeeping()
    except BaseException:
        _counts["planned"] += 1
        _counts["abandoned"] += 1
        raise


def direct_failed() -> None:
    """Count a direct submission whose enqueue failed part-way, as the general path does."""
    _counts["planned"] += 1
    _counts["failed"] += 1


def direct_enqueue(s: Stream, step: Callable[[Stream, Any], None], arg: Any) -> Event | None:
    """Run ``step(s, arg)`` as the general path runs the one step of a plan of one lane
    (under LOCK, after direct_ready): counted as a submission; returns the event to
    wait for (None if the step enqueued nothing)."""
    start = s.seq
    tls = _tls
    tls.submitting = True
    try:
        if s._keep:
            s.retire()
        step(s, arg)
        seq = s.seq
        ev = s.event_at(seq) if seq > start and seq > s.done_seq else None
    except BaseException:
        direct_failed()
        raise
    finally:
        tls.submitting = False
    s.device._stats.submissions += 1
    counts = _counts
    counts["planned"] += 1
    counts["enqueued"] += 1
    counts["direct"] += 1
    return ev


class _NoPlan:
    """What a direct submission's lane has for a plan: no capture."""

    __slots__ = ()
    capture = None


_NO_PLAN: Any = _NoPlan()


def lane_step(s: Stream, arg: tuple[Callable[[Lane, Any], None], Any]) -> None:
    """A plan step ``fn(lane, a)`` (for ``arg = (fn, a)``) run by direct_enqueue on a lane of
    ``s``: for steps that use only the lane's accesses and see that nothing is captured."""
    fn, a = arg
    fn(Lane(_NO_PLAN, s), a)


def order_accesses(s: Stream, writes: Iterable[tuple[Buffer, bool]], reads: Iterable[tuple[Buffer, bool]]) -> None:
    """Order the next work on ``s`` after the pending accesses on other streams of what
    it writes (writer and readers) and reads (writer); (buffer, tracked) pairs. Not
    capturing (Lane.write / Lane.read otherwise). Under LOCK."""
    for b, tracked in writes:
        if tracked:
            w = b.writer
            if w is not None and w[0] is not s:
                s.wait_for(w[0], w[1])
            if b.readers:
                for r, rseq in b.readers.items():
                    if r is not s:
                        s.wait_for(r, rseq)
    for b, tracked in reads:
        if tracked:
            w = b.writer
            if w is not None and w[0] is not s:
                s.wait_for(w[0], w[1])


def note_accesses(s: Stream, seq: int, writes: Iterable[tuple[Buffer, bool]], reads: Iterable[tuple[Buffer, bool]]) -> None:
    """Register point ``seq`` of ``s`` as the writer / a reader of these buffers (an
    untracked one only keeps its memory until then). Under LOCK."""
    for b, tracked in writes:
        if tracked:
            b.writer = (s, seq)
            if b.readers:
                b.readers.clear()
        else:
            b.lifetime[s] = seq
    for b, tracked in reads:
        if tracked:
            b.readers[s] = seq
        else:
            b.lifetime[s] = seq


def statistics() -> SubmissionStatistics:
    c = _counts
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


# -- pending host values ------------------------------------------------------------
class Pending:
    """A host value that exists once the submission's work has completed.

    Resolving is thread-safe and happens once: a shared op's pending value may be
    resolved by several consumers at the same time; a failure is remembered and raised
    to each of them.
    """

    __slots__ = ("_done", "_error", "_fn", "_lock", "_value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = False
        self._error: BaseException | None = None
        self._value: Any = None
        self._lock = threading.Lock()

    def resolve(self) -> Any:
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        self._value = self._compute()
                    except BaseException as exc:
                        # A copy: the raised one collects the frames of the consumer it
                        # reaches (and keeps their locals alive while it is stored).
                        self._error = fresh(exc)
                        raise
                    finally:
                        self._done = True
                        self._fn = None  # type: ignore[assignment]
                    return self._value
        if self._error is not None:
            raise fresh(self._error)
        return self._value

    def _compute(self) -> Any:
        # Map callbacks over read-backs run here, after the wait; like every then/map
        # callback they must not execute ops (NestedExecutionError).
        tls = _tls
        was = tls.submitting
        tls.submitting = True
        try:
            return self._fn()
        finally:
            tls.submitting = was


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
    """Returned by an op's ``_plan`` to continue with another op on the same lane."""

    __slots__ = ("op",)

    def __init__(self, op: Any) -> None:
        self.op = op


# -- shared-op states ------------------------------------------------------------------
class Claimed:
    """A shared op claimed by an unfinished plan; its output value is known."""

    __slots__ = ("pending", "plan", "value")

    def __init__(self, plan: Plan, value: Any, pending: bool) -> None:
        self.plan = plan
        self.value = value
        self.pending = pending


class Done:
    """A shared op whose work was enqueued: consumers depend on (stream, seq)."""

    __slots__ = ("pending", "seq", "stream", "value")

    def __init__(self, value: Any, stream: Stream, seq: int, pending: bool) -> None:
        self.value = value
        self.stream = stream
        self.seq = seq
        self.pending = pending


class Failed:
    """A shared op whose execution failed: every consumer sees the error."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


EXECUTING = True  # the state of an op being planned (or executed, for single-use ops)


# -- lanes ----------------------------------------------------------------------------
_NO_FORKS: list[Any] = []  # shared by lanes without forks (replaced, never appended to)


class Lane:
    """Where a part of a submission enqueues: one stream.

    Made at plan time (the stream is chosen then); its other fields are enqueue-time
    state.
    """

    __slots__ = ("__weakref__", "device", "forks", "need", "plan", "start", "stream")

    def __init__(self, plan: Plan, stream: Stream) -> None:
        self.plan = plan
        self.stream = stream
        self.device = stream.device
        self.start = 0
        self.need = 0
        self.forks: list[Lane] = _NO_FORKS

    # -- plan time -------------------------------------------------------------------
    def fork(self, device: Device | None = None, *, join_at_end: bool = True) -> Lane:
        """A lane on another stream (of ``device``, default this lane's).

        It is joined back into this lane when the submission finishes, or, with
        ``join_at_end=False``, wherever the caller joins it (``zip``).
        """
        dev = device or self.device
        plan = self.plan
        stream = plan.capture.fork_stream(dev) if plan.capture is not None else dev.policy.next_stream()
        lane = plan.lane(stream)
        if join_at_end:
            if self.forks is _NO_FORKS:
                self.forks = []
            self.forks.append(lane)
        return lane

    def on(self, device: Device) -> Lane:
        """This lane if it is on ``device``, else a forked lane on a stream of ``device``."""
        return self if device is self.device else self.fork(device)

    # -- enqueue time ---------------------------------------------------------------------
    def depend(self, stream: Stream, seq: int) -> None:
        """Order the rest of this lane after point ``seq`` of ``stream``, and wait for it at the end."""
        if seq <= stream.done_seq or stream.generation != stream.device.generation:
            return  # done, or gone with a reset
        cap = self.plan.capture
        if cap is not None and not cap.inside(stream, seq):
            return  # work from before the capture: the graph's launches are ordered after it
        s = self.stream
        if stream is s:
            if seq > self.need:
                self.need = seq
            return
        s.wait_for(stream, seq)
        self.need = s.mark()

    def read(self, buf: Buffer, tracked: bool = True) -> None:
        """Order this lane after the buffer's pending write (before a read)."""
        cap = self.plan.capture
        if cap is not None:
            cap.touch(buf, False)
        if not tracked:
            return
        w = buf.writer
        if w is not None and w[0] is not self.stream and (cap is None or cap.inside(w[0], w[1])):
            self.stream.wait_for(w[0], w[1])

    def write(self, buf: Buffer, tracked: bool = True) -> None:
        """Order this lane after the buffer's pending write and reads (before a write)."""
        cap = self.plan.capture
        if cap is not None:
            cap.touch(buf, True)
        if not tracked:
            return
        s = self.stream
        w = buf.writer
        if w is not None and w[0] is not s and (cap is None or cap.inside(w[0], w[1])):
            s.wait_for(w[0], w[1])
        for r, seq in buf.readers.items():
            if r is not s and (cap is None or cap.inside(r, seq)):
                s.wait_for(r, seq)

    def wrote(self, buf: Buffer, seq: int, tracked: bool = True) -> None:
        if tracked:
            buf.writer = (self.stream, seq)
            buf.readers.clear()
        else:
            buf.lifetime[self.stream] = seq

    def was_read(self, buf: Buffer, seq: int, tracked: bool = True) -> None:
        if tracked:
            buf.readers[self.stream] = seq
        else:
            buf.lifetime[self.stream] = seq

    def keep(self, obj: Any) -> None:
        """Keep host memory a pending copy uses alive until the copy is done (or the graph dies)."""
        cap = self.plan.capture
        if cap is not None:
            cap.keep.append(obj)
        else:
            self.stream.keep(obj)

    def end(self) -> int:
        """Close the point of the op just enqueued; returns its seq."""
        return self.stream.mark()

    def join(self, forks: Iterable[Lane]) -> None:
        """Order the rest of this lane after everything the ``forks`` enqueued."""
        for f in forks:
            if f.forks:
                f.join(f.forks)
                f.forks = _NO_FORKS
            fs = f.stream
            seq = fs.seq if fs.seq > f.start else f.need
            if seq:
                self.depend(fs, seq)

    def finish(self) -> Event | None:
        """Join every fork and return the event the caller waits for (None if nothing to wait for)."""
        if self.forks:
            self.join(self.forks)
            self.forks = _NO_FORKS
        s = self.stream
        seq = s.seq if s.seq > self.start else self.need
        if seq == 0 or seq <= s.done_seq:
            return None
        return s.event_at(seq)


# -- the plan -------------------------------------------------------------------------------
PLANNING, PLANNED, ENQUEUED, ABORTED, FAILED = range(5)


class _StagingSlot:
    """A staging buffer a step will use, lent at enqueue time."""

    __slots__ = ("device", "host_hold", "nbytes", "staging")

    def __init__(self, device: Device, nbytes: int, host_hold: bool) -> None:
        self.device = device
        self.nbytes = nbytes
        self.host_hold = host_hold
        self.staging: Staging | None = None


class Hold:
    """Something a submission holds from planning until it finishes (enqueued, abandoned
    or failed): a collectives group's communicators (trio_cuda.collectives)."""

    def ready(self) -> bool:
        """Whether the submission can enqueue without :meth:`make` (under LOCK)."""
        raise NotImplementedError

    def make(self) -> None:
        """Make what :meth:`ready` lacks: slow, so without LOCK held (a worker thread for
        ``await``, the calling thread of ``sync()``)."""
        raise NotImplementedError

    def done(self) -> None:
        """The submission finished (under LOCK, once)."""
        raise NotImplementedError


class _KernelNeed:
    __slots__ = ("args", "device", "loaded", "signature", "source")

    def __init__(self, source: KernelSource, device: Device, signature: tuple[Any, ...], args: list[Any]) -> None:
        self.source = source
        self.device = device
        self.signature = signature
        self.args = args
        self.loaded: Any = None


class Need:
    """What a submission waits for before it can enqueue (see the module docstring)."""

    __slots__ = ("data", "kind")

    def __init__(self, kind: str, data: Any) -> None:
        self.kind = kind  # "kernels" | "staging" | "plan" | "memory" | "communicators"
        self.data = data
        _counts[kind] += 1

    def wait_blocking(self) -> None:
        kind, data = self.kind, self.data
        if kind == "kernels":
            _load_kernels(data)
        elif kind == "staging":
            for device, sizes in data:
                pin(device, sizes)
        elif kind == "plan":
            data.done.wait()
        elif kind == "communicators":
            for hold in data:
                hold.make()
        else:  # memory
            for ev in data:
                ev.device.wait_blocking(ev)

    async def wait_async(self) -> None:
        kind, data = self.kind, self.data
        if kind == "memory":
            for ev in data:
                await wait_event(ev)
        elif kind == "plan":
            # Another submission (perhaps in this trio run) finishes its own wait first.
            if not data.done.is_set():
                await trio.to_thread.run_sync(data.done.wait, abandon_on_cancel=True)
            await trio.lowlevel.checkpoint()
        else:
            await trio.to_thread.run_sync(self.wait_blocking, abandon_on_cancel=True)


def _load_kernels(needs: list[_KernelNeed]) -> None:
    """Compile and load kernels (slow: numba and module loading). No runtime lock held."""
    for n in needs:
        dev = n.device
        gen = dev.generation
        with dev._slow_lock:
            if dev.generation != gen:
                continue  # the next plan step re-checks against the reset device
            n.loaded = dev._driver.load_kernel(n.source, n.signature, n.args)


class Plan:
    """One submission: its lanes, its steps, what it allocates, and its state."""

    # Rarely used fields default to the class's values (empty tuples become lists on
    # first use): a submission of one launch sets only what it needs.
    capture: Capture | None = None
    buffers: list[tuple[Lane, Buffer, str]] = ()  # type: ignore[assignment]
    allocated: list[tuple[Stream, int]] = ()  # type: ignore[assignment]  # the buffers' allocation points
    shared: list[Any] = ()  # type: ignore[assignment]
    kernels: list[_KernelNeed] = ()  # type: ignore[assignment]
    staging: list[_StagingSlot] = ()  # type: ignore[assignment]
    waits: list[Plan] = ()  # type: ignore[assignment]
    foreign: list[Buffer] = ()  # type: ignore[assignment]
    holds: list[Hold] = ()  # type: ignore[assignment]
    staging_waits: list[StagingPool] = ()  # type: ignore[assignment]  # pools it waits to take from
    sources: dict[Device, int] = {}  # noqa: RUF012  # devices read without a lane (never mutated here)
    reused: list[Any] = ()  # type: ignore[assignment]  # shared ops other plans produce
    dependents = 0
    error: BaseException | None = None
    _done: threading.Event | None = None  # made when another thread waits for it
    pending = 0
    event: Event | None = None
    oom_retried = False
    started = False  # driver calls were made (a failure from here on is partial)
    _trace: dict[str, Any] | None = None  # while a trace is open (see _trace)

    def __init__(self, stream: Stream, capture: Capture | None = None) -> None:
        if capture is not None:
            self.capture = capture
        dev = stream.device
        if dev._resetting or dev._driver._fault is not None:
            dev.check_usable()
        if stream._dropped:
            raise dropped_stream(stream)
        self.root = root = Lane(self, stream)
        self.lanes: list[Lane] = [root]
        self.steps: list[tuple[Callable[[Lane, Any], None], Lane, Any]] = []
        self.claimed: list[Any] = []
        self.ops: list[str] = []
        self.state = PLANNING
        self.generations: dict[Device, int] = {dev: dev.generation}

    def lane(self, stream: Stream) -> Lane:
        if stream._dropped:
            raise dropped_stream(stream)
        lane = Lane(self, stream)
        self.lanes.append(lane)
        dev = lane.device
        gens = self.generations
        if dev not in gens:
            if dev._resetting or dev._driver._fault is not None:
                dev.check_usable()
            gens[dev] = dev.generation
        return lane

    @property
    def done(self) -> threading.Event:
        """Set once the plan has enqueued, been abandoned, or failed."""
        with LOCK:
            ev = self._done
            if ev is None:
                ev = self._done = threading.Event()
                if self.finished:
                    ev.set()
            return ev

    def _set_done(self) -> None:
        if self._done is not None:
            self._done.set()

    # -- used by ops at plan time -----------------------------------------------------------
    def step(self, lane: Lane, fn: Callable[[Lane, Any], None], arg: Any = None) -> None:
        """Enqueue ``fn(lane, arg)`` in the enqueue phase, after the steps before it."""
        self.steps.append((fn, lane, arg))

    def new_buffer(self, lane: Lane, nbytes: int, what: str) -> Buffer:
        """A buffer this submission allocates (on ``lane``'s stream) when it enqueues."""
        if self.capture is not None:
            raise GraphCaptureError(
                f"{what} inside a graph capture: allocate tensors before capturing and capture "
                "only kernel launches and copies into them",
                device=lane.device.ordinal,
            )
        buf = Buffer(lane.device, nbytes, self)
        if nbytes:
            if not self.buffers:
                self.buffers = []
            self.buffers.append((lane, buf, what))
        return buf

    def use(self, buf: Buffer, what: object) -> None:
        """Check that this submission may use ``buf`` (see Buffer.check); ``what`` names it
        in errors (its repr is taken only then)."""
        if buf.ptr is None or buf.capture is not None or buf.generation != buf.device.generation:
            buf.check(self, what if isinstance(what, str) else repr(what))
            if buf.owner is not None and buf.owner is not self:
                if not self.foreign:
                    self.foreign = []
                self.foreign.append(buf)

    def read_from(self, device: Device, generation: int) -> None:
        """Note a device this submission reads from without running work on it (the
        source of a peer copy): if it is reset before the submission enqueues, the
        submission raises DeviceReset instead of reading released memory."""
        if not self.sources:
            self.sources = {}
        self.sources[device] = generation

    def need_kernel(self, source: KernelSource, device: Device, signature: tuple[Any, ...], args: list[Any]) -> _KernelNeed:
        n = _KernelNeed(source, device, signature, args)
        if not self.kernels:
            self.kernels = []
        self.kernels.append(n)
        return n

    def need_staging(self, lane: Lane, nbytes: int, host_hold: bool) -> _StagingSlot:
        """Pinned host memory a copy step will use (lent when the submission enqueues)."""
        slot = _StagingSlot(lane.device, nbytes, host_hold)
        if not self.staging:
            self.staging = []
        self.staging.append(slot)
        return slot

    def hold(self, h: Hold) -> None:
        """Keep ``h`` from now until the submission finishes (see :class:`Hold`)."""
        if not self.holds:
            self.holds = []
        self.holds.append(h)

    def reuse(self, op: Any) -> None:
        """Note a shared op another plan produces (checked again before enqueueing)."""
        if not self.reused:
            self.reused = []
        self.reused.append(op)

    def wait_for_plan(self, other: Plan) -> None:
        if other.state in (ENQUEUED, ABORTED, FAILED) or other in self.waits:
            return
        if not self.waits:
            self.waits = []
        self.waits.append(other)
        other.dependents += 1

    def claim(self, op: Any) -> None:
        op._state = EXECUTING
        self.claimed.append(op)

    # -- the walk ---------------------------------------------------------------------------------
    def walk(self, root: Any) -> Any:
        """Plan ``root`` and everything it depends on; returns its output value."""
        lane = self.root
        if root._state is None and not root._inputs:
            # A lone op (the common `await launch(tensors...)`): no walk needed.
            root._state = EXECUTING
            self.claimed.append(root)
            r = root._plan(self, lane, ())
            if type(r) is not Continue:
                return r
            root = r.op
        values: list[Any] = []
        work: list[tuple[Any, Lane, int]] = [(root, lane, -1)]
        self._walk(work, values)
        assert len(values) == 1
        return values[0]

    def _walk(self, work: list[tuple[Any, Lane, int]], values: list[Any]) -> None:
        # Frames are (op, lane, n): n < 0 enters the op, n >= 0 plans it on its n input
        # values. The one input of an op (a chain), and the op a plan continues with, are
        # entered at once rather than through a frame.
        pop = work.pop
        push = work.append
        vpush = values.append
        claim = self.claimed.append
        while work:
            op, ln, n = pop()
            while True:
                if n < 0:
                    state = op._state
                    if state is not None:
                        if state is EXECUTING:
                            raise OpAlreadyExecuted(
                                f"{op!r} was executed already; an op describes work that happens once "
                                "(use .shared() for an op with several consumers)"
                            )
                        vpush(op._reuse(self, ln))  # only shared ops have other states
                        break
                    op._state = EXECUTING
                    claim(op)
                    inputs = op._inputs
                    k = len(inputs)
                    if k:
                        push((op, ln, k))
                        if op._forks:
                            lanes = op._lanes(ln, k)
                            for i in range(k - 1, -1, -1):
                                push((inputs[i], lanes[i], -1))
                        elif k == 1:
                            op = inputs[0]
                            continue
                        else:
                            for i in range(k - 1, -1, -1):
                                push((inputs[i], ln, -1))
                        break
                    r = op._plan(self, ln, ())
                elif n == 1:
                    r = op._plan(self, ln, (values.pop(),))
                else:
                    args = values[-n:]
                    del values[-n:]
                    r = op._plan(self, ln, args)
                if type(r) is Continue:
                    op, n = r.op, -1
                    continue
                vpush(r)
                break

    # -- between plan and enqueue ----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.state in (ENQUEUED, ABORTED, FAILED)

    def advance(self) -> Need | None:
        """Enqueue if nothing is missing; else say what to wait for (under LOCK)."""
        while self.waits:
            w = self.waits[-1]
            if not w.finished:
                return Need("plan", w)
            self.waits.pop()
            w.dependents -= 1
        for op in self.reused:
            st = op._state
            if st.__class__ is Failed:  # its producer failed while this plan waited for it
                raise fresh(st.exc)
        if self.kernels:
            missing = []
            for n in self.kernels:
                if n.loaded is None:
                    n.loaded = n.device._driver.loaded_kernel(n.source, n.signature)
                    if n.loaded is None:
                        missing.append(n)
            if missing:
                return Need("kernels", missing)
        if self.holds:
            lacking = [h for h in self.holds if not h.ready()]
            if lacking:
                return Need("communicators", lacking)
        try:
            return self._enqueue()
        except BaseException as exc:
            if self.started:
                self._failed(exc)
            else:
                self.abort(exc)
            raise

    def _take_staging(self) -> Need | None:
        for dev in self.generations:
            pool_of(dev).drain()
        taken: list[_StagingSlot] = []
        wanted: dict[Device, list[int]] = {}  # every slot this try fills, per device
        short: set[Device] = set()
        for slot in self.staging:
            if slot.staging is not None:
                continue
            wanted.setdefault(slot.device, []).append(slot.nbytes)
            st = pool_of(slot.device).take(slot.nbytes, slot.host_hold)
            if st is None:
                short.add(slot.device)
            else:
                slot.staging = st
                taken.append(slot)
        if not short:
            self._end_staging_waits()
            return None
        for dev in short:
            pool = pool_of(dev)
            if pool not in self.staging_waits:
                if not self.staging_waits:
                    self.staging_waits = []
                self.staging_waits.append(pool)
                pool.wait_begin()
        for slot in taken:  # give them back: the retry takes everything in one hold
            st = slot.staging
            assert st is not None
            st._give_back()
            slot.staging = None
        # what the pool lacks for all of them at once: the ones given back count only once
        # (asking about the missing sizes alone counts a returned buffer for two slots,
        # and the retry would find the same shortage forever)
        return Need("staging", [(d, pool_of(d).missing(wanted[d])) for d in short])

    def _end_staging_waits(self) -> None:
        """No longer waiting to take pinned buffers (under LOCK): see StagingPool.wait_end."""
        waits = self.staging_waits
        if waits:
            self.staging_waits = ()  # type: ignore[assignment]
            for pool in waits:
                pool.wait_end()

    def _enqueue(self) -> Need | None:
        lanes = self.lanes
        if (
            len(lanes) == 1
            and self.capture is None
            and not (self.staging or self.buffers or self.foreign or self.sources or self.holds)
        ):
            self._enqueue_one(lanes[0])  # the common case, kept lean
            return None
        cap = self.capture
        for dev, gen in self.generations.items():
            if dev.generation != gen:
                raise DeviceReset("the device was reset while this submission was being prepared", device=dev.ordinal)
            if dev._resetting or dev._driver._fault is not None:
                dev.check_usable()
            if cap is None:
                if dev._dead_buffers:
                    dev.flush_frees()  # before streams are destroyed: a free may name one
                if dev._dead_streams or dev._lingering or dev._dead_graphs:
                    dev._housekeeping()
        for dev, gen in self.sources.items():
            if dev.generation != gen:
                raise DeviceReset(
                    "the device this submission copies from was reset while the submission was being prepared",
                    device=dev.ordinal,
                )
        if cap is not None and cap.generation != cap.device.generation:
            raise DeviceReset("the device was reset while the graph capture was open", device=cap.device.ordinal)
        for buf in self.foreign:
            if buf.ptr is None:
                raise ValueError(
                    "a tensor this submission uses belongs to a submission that failed before it ran; it has no memory"
                )
        for lane in self.lanes:
            s = lane.stream
            if s.generation != lane.device.generation:
                lane.device._current_stream(s)
            if s.capture is not None and s.capture is not cap:
                raise GraphCaptureError(
                    "this op's stream is recording a graph capture; use another stream (or finish the capture)",
                    device=lane.device.ordinal,
                )
        for lane in self.lanes:
            s = lane.stream
            lane.start = s.seq
            if s._keep:
                s.retire()
        if self.buffers:
            need = self._allocate()
            if need is not None:
                return need
        if self.staging:
            need = self._take_staging()
            if need is not None:
                self._unallocate()  # nothing used them: given back, made again on the retry
                return need
        self.started = True
        for _, buf, _ in self.buffers:
            buf.owner = None
        if cap is not None:
            if not cap.open:
                cap.begin()
            for lane in self.lanes:
                cap.join(lane.stream)
        _tls.submitting = True
        try:
            self._run_steps()
            if cap is None:
                self.event = ev = self.root.finish()
                if ev is not None:
                    for dev in self.sources:
                        dev._read_by_peer(ev)
            else:
                self.root.join(self.root.forks)
                if cap.auto_end:
                    cap.graph = cap.end(True)
        except BaseException:
            if cap is not None and cap.open:
                if cap.auto_end:
                    cap.end(False)
                else:
                    cap.broken = True
            raise
        finally:
            _tls.submitting = False
        for dev in self.generations:
            dev._stats.submissions += 1
        self.state = ENQUEUED
        _counts["enqueued"] += 1
        if self.shared:
            self._settle_shared(self.root.stream)
        self._release()
        if self._done is not None:
            self._done.set()
        return None

    def _settle_shared(self, stream: Stream) -> None:
        """Shared ops this plan claimed that no step marked (no device work) are done."""
        for op in self.shared:
            if op._state.__class__ is Claimed:
                st = op._state
                op._state = Done(st.value, stream, 0, st.pending)

    def _run_steps(self) -> None:
        """The driver calls of every step, in order (through the open trace, if any)."""
        tracer = _trace.active
        if tracer is None:
            for fn, lane, arg in self.steps:
                fn(lane, arg)
        else:
            tracer.run_steps(self, self.steps)

    def _enqueue_one(self, lane: Lane) -> None:
        """_enqueue for a plan of one lane that allocates and copies nothing from the host."""
        s = lane.stream
        dev = lane.device
        if dev.generation != self.generations[dev]:
            raise DeviceReset("the device was reset while this submission was being prepared", device=dev.ordinal)
        if dev._resetting or dev._driver._fault is not None:
            dev.check_usable()
        if dev._dead_buffers:
            dev.flush_frees()  # before streams are destroyed: a free may name one
        if dev._dead_streams or dev._lingering or dev._dead_graphs:
            dev._housekeeping()
        if s.generation != dev.generation:
            dev._current_stream(s)
        if s.capture is not None:
            raise GraphCaptureError(
                "this op's stream is recording a graph capture; use another stream (or finish the capture)", device=dev.ordinal
            )
        lane.start = s.seq
        if s._keep:
            s.retire()
        self.started = True
        tls = _tls
        tls.submitting = True
        try:
            self._run_steps()
            self.event = lane.finish()
        finally:
            tls.submitting = False
        dev._stats.submissions += 1
        self.state = ENQUEUED
        _counts["enqueued"] += 1
        if self.shared:
            self._settle_shared(s)
        lane.plan = None  # type: ignore[assignment]
        if self._done is not None:
            self._done.set()

    def _allocate(self) -> Need | None:
        """Allocate every buffer of the plan first: running out of memory leaves nothing half-run."""
        made: list[tuple[Lane, Buffer]] = []
        try:
            for lane, buf, what in self.buffers:
                buf.ptr = lane.device._alloc(buf.nbytes, lane.stream, what)
                buf.generation = lane.device.generation
                made.append((lane, buf))
        except DeviceOutOfMemory as err:
            for lane, buf in made:
                assert buf.ptr is not None
                lane.device._free_now(buf.ptr, buf.nbytes, lane.stream)
                buf.ptr = None
            if not self.oom_retried:
                self.oom_retried = True
                events = [ev for dev in self.generations for ev in dev.pending_events()]
                if events:
                    return Need("memory", events)
            raise err from None
        # the stream-ordered allocations, each the buffer's first writer (a failure part-way
        # through the enqueue frees the buffers still in that state: see _failed)
        self.allocated = allocated = []
        for lane, buf in made:
            buf.writer = w = (lane.stream, lane.stream.mark())
            allocated.append(w)
        return None

    def _unallocate(self) -> None:
        """Free the buffers _allocate made (no work used them yet)."""
        for lane, buf, _ in self.buffers:
            if buf.ptr is not None:
                lane.device._free_now(buf.ptr, buf.nbytes, lane.stream)
                buf.ptr = None
                buf.writer = None

    def _release(self) -> None:
        """Break the plan <-> lane cycle: the tensors of a finished submission are freed as
        soon as nothing else references its plan. Let go of what it holds."""
        if self.holds:
            for h in self.holds:
                h.done()
        self._end_staging_waits()
        lanes = self.lanes
        if len(lanes) == 1:
            lanes[0].plan = None  # type: ignore[assignment]
        else:
            for lane in lanes:
                lane.plan = None  # type: ignore[assignment]

    def _failed(self, exc: BaseException) -> None:
        """The enqueue failed (under LOCK): shared ops claimed here fail for every consumer."""
        self.error = exc
        self.state = FAILED
        _counts["failed"] += 1
        for op in self.shared:
            if op._state.__class__ is not Done:
                op._state = Failed(fresh(exc))
        allocated = self.allocated
        for i, (lane, buf, _) in enumerate(self.buffers):
            if buf.ptr is None:
                buf.owner = None
            elif i < len(allocated) and buf.writer is allocated[i] and not buf.readers and not buf.lifetime:
                # Memory of an op that did not run (no enqueued step touched it): freed,
                # and its tensors refuse use instead of showing uninitialized memory. The
                # free is ordered on the stream it was allocated on, after anything a
                # failing step may have left there.
                lane.device._free_now(buf.ptr, buf.nbytes, lane.stream)
                buf.ptr = None
                buf.writer = None
                buf.owner = None
        self._release()
        self._set_done()

    def abort(self, exc: BaseException) -> None:
        """Abandon a submission that did not enqueue (under LOCK).

        Its ops are not consumed (they can run later), unless another submission already
        relies on it: then its shared ops fail with ``exc`` for every consumer.
        """
        if self.finished:
            return
        for w in self.waits:
            w.dependents -= 1
        self.waits = ()  # type: ignore[assignment]
        if self.dependents:
            self._failed(exc)
        else:
            for op in self.claimed:
                op._state = None
            for _, buf, _ in self.buffers:
                buf.owner = None
            for slot in self.staging:
                st = slot.staging
                if st is not None:
                    st._give_back()
                    slot.staging = None
            self.state = ABORTED
            _counts["abandoned"] += 1
            self._release()
            self._set_done()

    # -- errors ------------------------------------------------------------------------------------
    def fault(self, err: DeviceError) -> DeviceError:
        """``err`` naming this submission's ops when it names none."""
        return name_fault(err, self.ops, self.root.device.ordinal)


def check_generations(generations: dict[Device, int], ops: list[str]) -> None:
    """After waiting for a submission that spanned devices: raise DeviceReset (naming its
    ops) if one of them was reset meanwhile (its part of the work, and its outputs, are gone)."""
    for dev, gen in generations.items():
        if dev.generation != gen:
            err = DeviceReset("the device was reset while this work was pending; its results are gone", device=dev.ordinal)
            raise name_fault(err, ops, dev.ordinal)


def name_fault(err: DeviceError, ops: list[str], ordinal: int) -> DeviceError:
    """A DeviceFault or DeviceReset without an op, renamed after the ops of the submission
    it failed (or ended)."""
    if not ops or err.op is not None or not isinstance(err, (DeviceFault, DeviceReset)):
        return err
    names = list(dict.fromkeys(ops))
    described = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    device = err.device if err.device is not None else ordinal
    new = type(err)(f"{err.message} (in the work of this submission)", device=device, op=described)
    new.__cause__ = err
    return new


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
        plan.state = PLANNED
        _counts["planned"] += 1
        need = plan.advance()
    return plan, value, need


def _give_up(plan: Plan, exc: BaseException) -> None:
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
    with trio.CancelScope(shield=True):
        while need is not None:
            await need.wait_async()
            with LOCK:
                need = plan.advance()


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
        ev = self.event
        if ev is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            try:
                await wait_event(ev)
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
    """Wait for what the plan needs (in trio) until it enqueues."""
    while need is not None:
        try:
            await need.wait_async()
        except trio.Cancelled:
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
    """Plan and enqueue ``op`` (waiting in trio where needed); do not wait for its work."""
    await trio.lowlevel.checkpoint_if_cancelled()
    if stream is None:
        stream = current_device()._submission_stream()
    plan, value, need = begin(op, stream)
    if need is not None:
        await _enqueue_async(plan, need)
    return Submitted(plan, value)


def await_op(op: Any, stream: Stream | None = None) -> Generator[Any, Any, Any]:
    """``await op`` (``DeviceOp.__await__``): submit on ``stream`` (default: the current
    device's policy) and wait in trio, through trio's public checkpoints. A generator
    rather than a coroutine: the common await is then one frame of its own."""
    yield from trio.lowlevel.checkpoint_if_cancelled().__await__()
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
        yield from trio.lowlevel.cancel_shielded_checkpoint().__await__()
        return value
    try:
        yield from wait_event(ev).__await__()
    except DeviceError as err:
        raise name_fault(err, names, stream.device.ordinal) from err
    return value


async def _run_planned(op: Any, stream: Stream) -> Any:
    """The general path of ``await op`` (after the cancel check): plan, enqueue (waiting
    in trio where needed), wait for the submission's event."""
    plan, value, need = begin(op, stream)
    if need is not None:
        await _enqueue_async(plan, need)
    ev = plan.event
    if ev is None:
        await trio.lowlevel.cancel_shielded_checkpoint()
    else:
        try:
            await wait_event(ev)
        except DeviceError as err:
            raise plan.fault(err) from err
    if len(plan.generations) > 1:
        check_generations(plan.generations, plan.ops)
    return _finish(value, plan.pending, _completed_staging(plan))


def run_sync(op: Any, stream: Stream | None = None) -> Any:
    """``op.sync()``: submit and block the calling (non-trio) thread until done."""
    check_blocking_allowed("op.sync()")
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
