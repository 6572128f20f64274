"""The plan of one submission: its lanes (streams, with the accesses ordered on them),
what it holds and waits for, and its enqueue; and the counts that submissions keep."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import _trace
from ._capture import Capture
from ._errors import DeviceError, DeviceFault, DeviceOutOfMemory, DeviceReset, GraphCaptureError, OpAlreadyExecuted, fresh
from ._guard import LOCK, _tls
from ._loop import Flag
from ._memory import Buffer
from ._needs import KernelNeed, Need
from ._pending import EXECUTING, Claimed, Continue, Done, Failed
from ._staging import Staging, StagingPool, pool_of
from ._stream import dropped_stream

if TYPE_CHECKING:
    from ._backends._boundary import KernelSource
    from ._device import Device
    from ._stream import Event, Stream

__all__ = ["Hold", "Lane", "Need", "Plan", "check_generations", "counts", "name_fault"]

# -- statistics ----------------------------------------------------------------------
# Counted under the runtime lock.
counts = {
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


class Plan:
    """One submission: its lanes, its steps, what it allocates, and its state."""

    # Rarely used fields default to the class's values (empty tuples become lists on
    # first use): a submission of one launch sets only what it needs.
    capture: Capture | None = None
    buffers: list[tuple[Lane, Buffer, str]] = ()  # type: ignore[assignment]
    allocated: list[tuple[Stream, int]] = ()  # type: ignore[assignment]  # the buffers' allocation points
    shared: list[Any] = ()  # type: ignore[assignment]
    kernels: list[KernelNeed] = ()  # type: ignore[assignment]
    staging: list[_StagingSlot] = ()  # type: ignore[assignment]
    waits: list[Plan] = ()  # type: ignore[assignment]
    foreign: list[Buffer] = ()  # type: ignore[assignment]
    holds: list[Hold] = ()  # type: ignore[assignment]
    staging_waits: list[StagingPool] = ()  # type: ignore[assignment]  # pools it waits to take from
    sources: dict[Device, int] = {}  # noqa: RUF012  # devices read without a lane (never mutated here)
    reused: list[Any] = ()  # type: ignore[assignment]  # shared ops other plans produce
    checks: list[Callable[[], None]] = ()  # type: ignore[assignment]  # see check_when_done
    dependents = 0
    error: BaseException | None = None
    _done: Flag | None = None  # made when another submission waits for it
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
    def done(self) -> Flag:
        """Set once the plan has enqueued, been abandoned, or failed."""
        with LOCK:
            ev = self._done
            if ev is None:
                ev = self._done = Flag()
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
            buf.check(self, what)
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

    def need_kernel(self, source: KernelSource, device: Device, signature: tuple[Any, ...], args: list[Any]) -> KernelNeed:
        n = KernelNeed(source, device, signature, args)
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

    def check_when_done(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once this submission's work is done, before its output is returned:
        what an op checks on the device (an error flag it read back) raises from there,
        as the error of the await (or ``sync()``)."""
        if not self.checks:
            self.checks = []
        self.checks.append(fn)

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

    @staticmethod
    def _need(kind: str, data: Any) -> Need:
        counts[kind] += 1
        return Need(kind, data)

    def advance(self) -> Need | None:
        """Enqueue if nothing is missing; else say what to wait for (under LOCK)."""
        while self.waits:
            w = self.waits[-1]
            if not w.finished:
                return self._need("plan", w)
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
                return self._need("kernels", missing)
        if self.holds:
            lacking = [h for h in self.holds if not h.ready()]
            if lacking:
                return self._need("communicators", lacking)
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
        return self._need("staging", [(d, pool_of(d).missing(wanted[d])) for d in short])

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
        counts["enqueued"] += 1
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
        counts["enqueued"] += 1
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
                    return self._need("memory", events)
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
        counts["failed"] += 1
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
            counts["abandoned"] += 1
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
