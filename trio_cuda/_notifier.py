"""Completion wake-ups: from device events to trio tasks.

The wait of an await adapts to how long its work takes (measured on an H200, see
docs/notifier.md):

* **Polling** (short work, or work of a kind not seen yet): the awaiting task polls
  its event between trio checkpoints, for up to ``TRIO_CUDA_POLL_BUDGET_US`` (by
  default 5000 us on CUDA and 100 us on the simulated device, whose "GPU" threads need
  the GIL that polling would hold), and for about four times its expected duration
  when that is known. Completion is seen within one scheduler pass.
* **Sleeping through** (work expected to take 150 us or more, see trio_cuda._forecast):
  the task sleeps until shortly before the work's predicted end, then polls. On Linux
  it sleeps on a timerfd in trio's own I/O wait (trio_cuda._timer), which the notifier
  fires early if the work completes first; elsewhere it parks on the notifier with a
  deadline. A completion wakes a sleeping CPU 100-400 us late whatever the mechanism,
  so the timer, learned from what earlier waits of the same kind took, is what keeps
  the GPU fed.
* **The notifier** (:class:`Notifier`): one helper thread per process watches all
  parked waits. The device *arms* each event so that its completion posts a waker the
  helper blocks on without the GIL (on CUDA a host function that is ``sem_post``
  itself, queued on a side stream so the work stream is never stalled). The helper then
  polls every parked event, fires due timers, and wakes tasks in one ``run_sync_soon``
  batch per trio run. With nothing parked it blocks indefinitely: no CPU use while
  idle. While waits are parked it also re-polls every 20 ms, which catches device
  faults (a faulted context runs no host functions). A device reset posts the waker, so
  waiters of the old generation are woken with DeviceReset.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import outcome
import trio

from . import _loop
from ._backends import backend
from ._config import env_float
from ._errors import DeviceError
from ._forecast import SLEEP_MIN_NS, WaitStatistics, forecast
from ._loop import cancel_shielded_checkpoint, checkpoint
from ._timer import Timer
from ._timer import available as _timers
from ._timer import release as _release_timer
from ._timer import timer as _new_timer

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Event

__all__ = ["Notifier", "NotifierStatistics", "notifier", "poll_budget_ns", "spin_poll", "wait_event", "wait_steps"]

_FAULT_POLL_S = 0.02
_POLL_AFTER_WAKE_NS = 50_000  # a timer-woken task polls at least this long before sleeping again
_MIN_SLEEP_NS = 30_000  # a timed sleep shorter than this is polled instead
_FOREVER_NS = 10**12  # a budget this large (1000 s) never sleeps: the pure polling wait
_budget_ns: int | None = None
_spin_ns: int | None = None
# How awaits of events ended, process-wide: [completed at a poll, parked or slept until
# the notifier or a timer woke them, completed while spinning (of the first)]. Counted
# by the trio and asyncio threads that wait (a lost increment under a race between two
# loops would only skew a statistic).
_waits = [0, 0, 0]


@dataclass(frozen=True)
class NotifierStatistics:
    """How awaits of device work completed (see :func:`trio_cuda.lowlevel.notifier_statistics`).

    Attributes:
        fast_path: Waits that completed while polling between checkpoints.
        spins: Of those, the waits that completed while the task polled on without
            yielding, right after a pass of the scheduler that came back at once (few
            tasks running; the backend's spin time, 20 us on CUDA, none simulated).
        slow_path: Waits that parked on the helper thread or slept on a timer.
        parked: Waits parked right now.
        wakeups: Times the helper thread woke up.
        batches: ``run_sync_soon`` batches that woke tasks.
        sleeping: How the adaptive wait slept through long work.
    """

    fast_path: int
    spins: int
    slow_path: int
    parked: int
    wakeups: int
    batches: int
    sleeping: WaitStatistics


def spin_poll(event: Event, started: int, deadline: int) -> bool:
    """After a poll that found ``event`` pending, right after a pass of the scheduler
    that began at ``started`` (perf_counter_ns): if that pass came back within the
    backend's spin time (few tasks are running), poll again without yielding, for up to
    the spin time and not past ``deadline`` (the end of the polling budget); True if the
    event completed meanwhile (the caller counts it)."""
    spin = _spin_ns
    if spin is None:
        spin = _spin_ns_of_backend()
    clock = time.perf_counter_ns
    now = clock()
    if not spin or now - started >= spin or now >= deadline:
        return False
    end = min(now + spin, deadline)
    dev = event.device
    done = False
    while not done and clock() < end:
        done = dev.poll(event)
    if done:
        _waits[2] += 1
    return done


def _spin_ns_of_backend() -> int:
    global _spin_ns
    _spin_ns = int(backend().spin_us * 1000)
    return _spin_ns


def poll_budget_ns() -> int:
    """How long an awaiting task polls before parking (nanoseconds)."""
    global _budget_ns
    if _budget_ns is None:
        us = env_float("TRIO_CUDA_POLL_BUDGET_US", backend().poll_budget_us, minimum=0.0)
        _budget_ns = int(us * 1000)
    return _budget_ns


class _Waiter:
    __slots__ = ("active", "deadline", "device", "event", "task", "timer", "token")

    def __init__(self, event: Event, token: Any, task: Any, deadline: int, timer: Timer | None = None) -> None:
        self.event = event
        self.device = event.device
        self.token = token
        self.task = task
        self.deadline = deadline  # perf_counter_ns of a timed wake-up, or 0
        self.timer = timer  # fired on completion instead of rescheduling the task
        self.active = True


# (waiter, error or None, True if the work completed / False if the timer fired)
_Wake = tuple[_Waiter, BaseException | None, bool]


def _wake(batch: list[_Wake]) -> None:
    # Runs in the trio thread, so it cannot race with the abort function.
    for w, exc, done in batch:
        if w.active:
            w.active = False
            trio.lowlevel.reschedule(w.task, outcome.Value(done) if exc is None else outcome.Error(exc))


def _wake_futures(batch: list[_Wake]) -> None:
    # Runs in the asyncio loop's thread, as the waiters' cancellation does.
    for w, exc, done in batch:
        if w.active:
            w.active = False
            fut = w.task
            if not fut.done():
                if exc is None:
                    fut.set_result(done)
                else:
                    fut.set_exception(exc)


def _precise_timers() -> None:
    """Let this thread's timed waits end when asked (Linux rounds them up by 50 us by
    default, "timer slack"): the helper's timers wake sleeping tasks before their work ends."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere the timers are as precise as the platform makes them
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns
    except Exception:  # (a tuning only: the helper must run regardless)
        pass


class Notifier:
    """The slow path: one helper thread that wakes parked tasks in batches, through
    each task's own loop (trio's token, asyncio's ``call_soon_threadsafe``)."""

    def __init__(self) -> None:
        self._waker = backend().new_waker()
        self._lock = threading.Lock()  # a leaf lock: guards _waiters, _thread, _subscribed
        self._waiters: list[_Waiter] = []
        self._in_pass = 0  # waiters the helper's pass has taken out of _waiters (still parked)
        self._thread: threading.Thread | None = None
        self._subscribed: set[int] = set()
        self.wakeups = 0  # helper-thread wake-ups, for tests and docs
        self.batches = 0  # run_sync_soon calls that woke tasks
        self._wake_at: int | None = None  # when the helper wakes by itself (None: never)

    def parked(self) -> int:
        """How many waits are parked on the helper thread now."""
        with self._lock:  # (the pass moves waiters between the two in two steps)
            return len(self._waiters) + self._in_pass

    def statistics(self) -> NotifierStatistics:
        """A frozen snapshot of the wake-up counters."""
        return NotifierStatistics(
            _waits[0], _waits[2], _waits[1], self.parked(), self.wakeups, self.batches, _forecast.statistics()
        )

    async def wait(self, event: Event, deadline: int = 0, arm: bool = True) -> bool:
        """Park the current task until ``event`` completes (or fails, or its device
        resets), or until ``deadline`` (perf_counter_ns; 0: none). True if the event
        completed, False if the deadline came first. ``arm=False``: the event was armed
        by an earlier wait of this await."""
        if _loop.loop_name() != "trio":
            return await self._wait_asyncio(event, deadline, arm)
        w = _Waiter(event, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task(), deadline)
        self._park(w, arm)

        def abort(_: Any) -> trio.lowlevel.Abort:
            w.active = False
            return trio.lowlevel.Abort.SUCCEEDED

        done: bool = await trio.lowlevel.wait_task_rescheduled(abort)
        return done

    async def _wait_asyncio(self, event: Event, deadline: int, arm: bool) -> bool:
        loop = _loop.running_asyncio_loop()
        fut: Any = loop.create_future()
        w = _Waiter(event, loop, fut, deadline)
        self._park(w, arm)
        try:
            done: bool = await fut
        except BaseException:
            w.active = False  # (cancelled: the helper drops it at its next pass)
            raise
        return done

    def watch(self, event: Event, timer: Timer, arm: bool = True) -> _Waiter:
        """Fire ``timer`` when ``event`` completes (or fails, or its device resets); the
        caller sleeps on the timer, then calls :meth:`unwatch`."""
        w = _Waiter(event, None, None, 0, timer)
        self._park(w, arm)
        return w

    def unwatch(self, w: _Waiter) -> None:
        """The sleeper of ``w`` is awake: ``w`` leaves the list (it is not parked now)."""
        with self._lock:
            w.active = False
            try:
                self._waiters.remove(w)
            except ValueError:
                pass  # (the helper's pass has it, or fired it)

    def _park(self, w: _Waiter, arm: bool) -> None:
        """Add ``w``, then arm its event (``arm``): a completion post always finds it in
        the list. Where nothing was armed now (already done, stale, or armed by an
        earlier wait whose post a pass may have taken), the helper is posted."""
        with self._lock:
            subscribe = w.device.ordinal not in self._subscribed
            self._subscribed.add(w.device.ordinal)
        if subscribe:
            w.device.on_reset(self._on_reset)
        with self._lock:
            self._waiters.append(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trio-cuda-notifier", daemon=True)
                self._thread.start()
            # Let the helper see the new waiter where it would not by itself: it sleeps
            # with nothing to re-poll, or past this waiter's deadline. (Otherwise the
            # event's completion posts the waker: no extra pass over every waiter.)
            wake_at = self._wake_at
            post = wake_at is None or (w.deadline and w.deadline < wake_at)
        if not (arm and w.device.arm(w.event, self._waker)) or post:
            self._waker.post()

    def _on_reset(self, device: Device) -> None:
        self._waker.post()

    def _run(self) -> None:
        _precise_timers()
        waker = self._waker
        clock = time.perf_counter_ns
        while True:
            timeout: float | None = None
            with self._lock:
                self._wake_at = None
                if self._waiters:
                    timeout = _FAULT_POLL_S
                    due = [w.deadline for w in self._waiters if w.deadline]
                    if due:
                        timeout = min(timeout, max(0.0, (min(due) - clock()) / 1e9))
                    self._wake_at = clock() + int(timeout * 1e9)
            if timeout != 0.0:
                waker.wait(timeout)
            self.wakeups += 1
            # One pass in a function of its own: nothing of it stays referenced while the
            # helper sleeps (an error raised in a task gathers that task's frames).
            self._pass()

    def _pass(self) -> None:
        with self._lock:
            waiters = self._waiters
            self._waiters = []
            self._in_pass = len(waiters)
        keep: list[_Waiter] = []
        batches: dict[Any, list[_Wake]] = {}  # per trio token or asyncio loop
        now = time.perf_counter_ns()
        for w in waiters:
            if not w.active:
                continue
            exc: BaseException | None = None
            done = True
            try:
                if not w.device.poll(w.event):
                    if not w.deadline or w.deadline > now:
                        keep.append(w)
                        continue
                    done = False  # the timer: the task polls from here
            except DeviceError as err:  # a fault, a failed op, or a reset
                exc = err
            if w.timer is not None:
                # Under the lock, if still watched: once unwatch() has returned, the
                # timer may be another sleeper's (timers are pooled), which this must
                # not wake.
                with self._lock:
                    if w.active:
                        w.active = False
                        w.timer.fire()  # the task polls (and meets the error, if any)
                continue
            batches.setdefault(w.token, []).append((w, exc, done))
        with self._lock:
            self._waiters.extend(keep)
            self._in_pass = 0
        for token, batch in batches.items():
            self.batches += 1
            try:
                if isinstance(token, trio.lowlevel.TrioToken):
                    token.run_sync_soon(_wake, batch)
                else:
                    token.call_soon_threadsafe(_wake_futures, batch)
            except (trio.RunFinishedError, RuntimeError):  # (that run or loop has ended)
                pass


_notifier: Notifier | None = None
_notifier_lock = threading.Lock()


def notifier() -> Notifier:
    """The process-wide notifier (created on first use)."""
    global _notifier
    if _notifier is None:
        with _notifier_lock:
            if _notifier is None:
                _notifier = Notifier()
    return _notifier


async def wait_event(event: Event, kind: Any = None) -> None:
    """Wait in trio or asyncio for ``event``: a checkpoint even if it has completed already.
    ``kind``: what the work is, for the adaptive wait to learn its duration by (any
    hashable; None: nothing is learned).

    Raises:
        DeviceFault: The event's work failed or its device faulted.
        DeviceReset: The device was reset while the work was pending.
        trio.Cancelled, asyncio.CancelledError: The wait was cancelled; the device work
            goes on regardless.
    """
    return await _Steps(event, kind)


class _Steps:
    """``await``-able :func:`wait_steps` (what wait_event awaits)."""

    __slots__ = ("event", "kind")

    def __init__(self, event: Event, kind: Any) -> None:
        self.event = event
        self.kind = kind

    def __await__(self) -> Generator[Any, Any, None]:
        return wait_steps(self.event, self.kind)


def wait_steps(event: Event, kind: Any = None) -> Generator[Any, Any, None]:
    """:func:`wait_event` as a generator, for ``yield from`` in a generator that trio
    runs as a coroutine (the await of an op: one frame less than awaiting a coroutine)."""
    budget = _budget_ns if _budget_ns is not None else poll_budget_ns()  # read (and checked) at the first wait
    spin = _spin_ns if _spin_ns is not None else _spin_ns_of_backend()
    dev = event.device
    started = time.perf_counter_ns()
    if event.done:
        # Known complete: the first poll, right away (it raises the work's error, if any).
        if dev.poll(event):
            _waits[0] += 1
            yield from cancel_shielded_checkpoint().__await__()
            return
    else:
        # Just submitted, device work is almost never done yet (a driver query right
        # away costs ~2 us and finds it pending): the first poll comes after one pass of
        # the scheduler, which covers a tiny op's latency (~5 us on an H200).
        yield from checkpoint().__await__()
        # (if the scheduler came back at once, few tasks are running: spin for a moment,
        # unless the work is known to be long)
        if dev.poll(event) or (
            spin and (kind is None or _forecast.estimate(kind) < SLEEP_MIN_NS) and spin_poll(event, started, started + budget)
        ):
            _waits[0] += 1
            return
    yield from wait_pending(event, started, kind).__await__()


_forecast = forecast()


async def wait_pending(event: Event, started: int, kind: Any = None) -> None:
    """The rest of :func:`wait_event` after a first poll found ``event`` pending: poll
    between checkpoints while the work is expected to end soon (until the budget counted
    from ``started``, perf_counter_ns), then sleep through the rest."""
    dev = event.device
    clock = time.perf_counter_ns
    budget = _budget_ns if _budget_ns is not None else poll_budget_ns()
    spin = _spin_ns if _spin_ns is not None else _spin_ns_of_backend()  # (a test may have reset them)
    fc = _forecast
    est = fc.estimate(kind) if kind is not None else 0
    if budget >= _FOREVER_NS or (budget and est < SLEEP_MIN_NS):
        # Unknown or short work: poll, until the budget or four times the expected duration.
        window = budget if not est or budget >= _FOREVER_NS else min(budget, max(4 * est, SLEEP_MIN_NS))
        deadline = started + window  # a budget of 0 parks what the first poll found pending
        while clock() < deadline:
            before = clock()
            await checkpoint()
            # (if the scheduler came back at once, few tasks are running: spin for a moment
            # instead of another pass of the loop)
            if dev.poll(event) or (spin and spin_poll(event, before, deadline)):
                _waits[0] += 1
                fc.observed(kind, clock() - started)
                return
    if not budget:
        _waits[1] += 1
        await notifier().wait(event)
        return
    await _sleep_through(event, started, kind, est)


async def _sleep_on_timer(n: Notifier, event: Event, target: int, arm: bool) -> bool:
    """Sleep in trio's own I/O wait until ``target`` (perf_counter_ns) or until the
    notifier sees ``event`` complete, whichever is first; True if it completed first."""
    try:
        t = _new_timer()
    except OSError:  # (out of file descriptors, say): the notifier's own timers
        return await n.wait(event, target, arm)
    w = None
    try:
        # Set before the watch: a completion the notifier sees at once fires it, and a
        # later set would discard that firing.
        t.set(max(1, target - time.perf_counter_ns()))
        w = n.watch(event, t, arm)
        await t.wait()
    finally:
        if w is not None:
            n.unwatch(w)
        _release_timer(t)
    return time.perf_counter_ns() < target and event.device.poll(event)


async def _sleep_through(event: Event, started: int, kind: Any, est: int) -> None:
    """Sleep until shortly before the work's predicted end, then poll; learn from what
    is found. The work is predicted to run for ``est`` from ``started`` (perf_counter_ns),
    or from the predicted end of the work before it on its stream. Work of unknown
    duration parks until it completes."""
    fc = _forecast
    stream = id(event._stream())
    base = fc.begin(stream, started, est) if est else started
    try:
        await _sleep_steps(event, kind, est, stream, base)
    except BaseException:
        fc.forget(stream)  # (cancelled: nothing says when its work ends)
        raise


async def _sleep_steps(event: Event, kind: Any, est: int, stream: int, base: int) -> None:
    """The steps of :func:`_sleep_through`: the work predicted to end at ``base + est``."""
    dev = event.device
    clock = time.perf_counter_ns
    spin = _spin_ns if _spin_ns is not None else _spin_ns_of_backend()
    fc = _forecast
    n = notifier()
    counts = fc.counts
    armed = False
    predicted = base + est
    target = predicted - fc.lead_ns() if est else 0
    backoff = 0
    while True:
        now = clock()
        if not target:
            _waits[1] += 1
            await n.wait(event, 0, not armed)
            fc.observed(kind, clock() - base - fc.lateness_ns)  # (less about a wake-up's latency)
            return
        slept = target - now >= _MIN_SLEEP_NS
        if slept:
            counts[0] += 1
            if _timers():
                done = await _sleep_on_timer(n, event, target, not armed)
            else:
                done = await n.wait(event, target, not armed)
            armed = True
            woke = clock()
            if done:
                _waits[1] += 1
                if woke < base:  # queued behind work predicted to end later than it did
                    fc.forget(stream)
                    return
                if not backoff:  # woken before the predicted end: the estimate was too long
                    counts[2] += 1
                    fc.too_long(kind, woke - base)
                fc.ended(stream, predicted, woke - fc.lateness_ns)
                return
            counts[1] += 1
            fc.woke(woke - target)
        # Poll from here, for a while.
        end = clock() + max(2 * fc.lead_ns(), _POLL_AFTER_WAKE_NS)
        first = True
        while True:
            before = clock()
            await checkpoint()
            if dev.poll(event) or (spin and spin_poll(event, before, end)):
                _waits[0] += 1
                seen = clock()
                if first and slept:
                    counts[3] += 1
                    fc.too_long(kind, seen - base)
                else:
                    fc.observed(kind, seen - base)
                fc.ended(stream, predicted, seen)
                return
            first = False
            if clock() >= end:
                break
        # Still running: it takes at least this long. Sleep again, twice as long each
        # time it is still running (from an eighth of the time so far).
        elapsed = clock() - base
        fc.at_least(kind, elapsed)
        backoff = max(elapsed // 8, SLEEP_MIN_NS) if not backoff else 2 * backoff
        target = clock() + backoff
