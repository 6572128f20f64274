"""Completion wake-ups: from device events to trio tasks.

Two paths, chosen by measurements on an H200 (see docs/notifier.md):

* **Fast path** (:func:`wait_event`): the awaiting task polls its event between trio
  checkpoints for a budget (``TRIO_CUDA_POLL_BUDGET_US``; by default 5000 us on CUDA
  and 100 us on the simulated device, whose "GPU" threads need the GIL that polling
  would hold). The loop stays hot, other tasks keep running, completion is seen within
  one scheduler pass.
* **Slow path** (:class:`Notifier`): past the budget the task parks, and one helper
  thread per process watches all parked waits. The device *arms* each event so that
  its completion posts a waker the helper blocks on without the GIL (on CUDA a host
  function that is ``sem_post`` itself, queued on a side stream so the work stream is
  never stalled). The helper then polls every parked event and wakes finished tasks in
  one ``run_sync_soon`` batch per trio run. With nothing parked it blocks indefinitely:
  no CPU use while idle. While waits are parked it also re-polls every 20 ms, which
  catches device faults (a faulted context runs no host functions). A device reset
  posts the waker, so waiters of the old generation are woken with DeviceReset.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import outcome
import trio

from ._backends import backend
from ._config import env_float
from ._errors import DeviceError
from ._stream import event_waits

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Event

__all__ = ["Notifier", "NotifierStatistics", "notifier", "poll_budget_ns", "spin_poll", "wait_event", "wait_steps"]

_FAULT_POLL_S = 0.02
_budget_ns: int | None = None
_spin_ns: int | None = None


@dataclass(frozen=True)
class NotifierStatistics:
    """How awaits of device work completed (see :func:`trio_cuda.lowlevel.notifier_statistics`).

    Attributes:
        fast_path: Waits that completed while polling between checkpoints.
        slow_path: Waits that parked on the helper thread.
        parked: Waits parked right now.
        wakeups: Times the helper thread woke up.
        batches: ``run_sync_soon`` batches that woke tasks.
    """

    fast_path: int
    slow_path: int
    parked: int
    wakeups: int
    batches: int


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
    __slots__ = ("active", "device", "event", "task", "token")

    def __init__(self, event: Event, token: trio.lowlevel.TrioToken, task: trio.lowlevel.Task) -> None:
        self.event = event
        self.device = event.device
        self.token = token
        self.task = task
        self.active = True


def _wake(batch: list[tuple[_Waiter, BaseException | None]]) -> None:
    # Runs in the trio thread, so it cannot race with the abort function.
    for w, exc in batch:
        if w.active:
            w.active = False
            trio.lowlevel.reschedule(w.task, outcome.Value(None) if exc is None else outcome.Error(exc))


class Notifier:
    """The slow path: one helper thread that wakes parked trio tasks in batches."""

    def __init__(self) -> None:
        self._waker = backend().new_waker()
        self._lock = threading.Lock()  # a leaf lock: guards _waiters, _thread, _subscribed
        self._waiters: list[_Waiter] = []
        self._thread: threading.Thread | None = None
        self._subscribed: set[int] = set()
        self.wakeups = 0  # helper-thread wake-ups, for tests and docs
        self.batches = 0  # run_sync_soon calls that woke tasks

    def parked(self) -> int:
        """How many waits are parked on the helper thread now."""
        return len(self._waiters)

    def statistics(self) -> NotifierStatistics:
        """A frozen snapshot of the wake-up counters."""
        return NotifierStatistics(event_waits[0], event_waits[1], len(self._waiters), self.wakeups, self.batches)

    async def wait(self, event: Event) -> None:
        """Park the current task until ``event`` completes (or fails, or its device resets)."""
        w = _Waiter(event, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task())
        dev = w.device
        with self._lock:
            subscribe = dev.ordinal not in self._subscribed
            self._subscribed.add(dev.ordinal)
        if subscribe:
            dev.on_reset(self._on_reset)
        dev.arm(event, self._waker)  # a completed or stale event is caught by the first poll
        with self._lock:
            self._waiters.append(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trio-cuda-notifier", daemon=True)
                self._thread.start()
        self._waker.post()  # let the helper see the new waiter (and start re-polling)

        def abort(_: Any) -> trio.lowlevel.Abort:
            w.active = False
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _on_reset(self, device: Device) -> None:
        self._waker.post()

    def _run(self) -> None:
        waker = self._waker
        while True:
            with self._lock:
                busy = bool(self._waiters)
            waker.wait(_FAULT_POLL_S if busy else None)
            self.wakeups += 1
            # One pass in a function of its own: nothing of it stays referenced while the
            # helper sleeps (an error raised in a task gathers that task's frames).
            self._pass()

    def _pass(self) -> None:
        with self._lock:
            waiters = self._waiters
            self._waiters = []
        keep: list[_Waiter] = []
        batches: dict[trio.lowlevel.TrioToken, list[tuple[_Waiter, BaseException | None]]] = {}
        for w in waiters:
            if not w.active:
                continue
            exc: BaseException | None = None
            try:
                if not w.device.poll(w.event):
                    keep.append(w)
                    continue
            except DeviceError as err:  # a fault, a failed op, or a reset
                exc = err
            batches.setdefault(w.token, []).append((w, exc))
        if keep:
            with self._lock:
                self._waiters.extend(keep)
        for token, batch in batches.items():
            self.batches += 1
            try:
                token.run_sync_soon(_wake, batch)
            except trio.RunFinishedError:
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


async def wait_event(event: Event) -> None:
    """Wait in trio for ``event``: a checkpoint even if it has completed already.

    Raises:
        DeviceFault: The event's work failed or its device faulted.
        DeviceReset: The device was reset while the work was pending.
        trio.Cancelled: The wait was cancelled; the device work goes on regardless.
    """
    return await _Steps(event)


class _Steps:
    """``await``-able :func:`wait_steps` (what wait_event awaits)."""

    __slots__ = ("event",)

    def __init__(self, event: Event) -> None:
        self.event = event

    def __await__(self) -> Generator[Any, Any, None]:
        return wait_steps(self.event)


def wait_steps(event: Event) -> Generator[Any, Any, None]:
    """:func:`wait_event` as a generator, for ``yield from`` in a generator that trio
    runs as a coroutine (the await of an op: one frame less than awaiting a coroutine)."""
    budget = _budget_ns if _budget_ns is not None else poll_budget_ns()  # read (and checked) at the first wait
    spin = _spin_ns if _spin_ns is not None else _spin_ns_of_backend()
    dev = event.device
    started = time.perf_counter_ns()
    if event.done:
        # Known complete: the first poll, right away (it raises the work's error, if any).
        if dev.poll(event):
            event_waits[0] += 1
            yield from trio.lowlevel.cancel_shielded_checkpoint().__await__()
            return
    else:
        # Just submitted, device work is almost never done yet (a driver query right
        # away costs ~2 us and finds it pending): the first poll comes after one pass of
        # the scheduler, which covers a tiny op's latency (~5 us on an H200).
        yield from trio.lowlevel.checkpoint().__await__()
        # (if the scheduler came back at once, few tasks are running: spin for a moment)
        if dev.poll(event) or (spin and spin_poll(event, started, started + budget)):
            event_waits[0] += 1
            return
    yield from wait_pending(event, started).__await__()


async def wait_pending(event: Event, started: int) -> None:
    """The rest of :func:`wait_event` after a first poll found ``event`` pending: poll
    between checkpoints until the budget counted from ``started`` (perf_counter_ns) is
    spent, then park on the notifier."""
    dev = event.device
    clock = time.perf_counter_ns
    budget = _budget_ns if _budget_ns is not None else poll_budget_ns()
    spin = _spin_ns if _spin_ns is not None else _spin_ns_of_backend()  # (a test may have reset them)
    deadline = started + budget  # a budget of 0 parks what the first poll found pending
    while clock() < deadline:
        before = clock()
        await trio.lowlevel.checkpoint()
        # (if the scheduler came back at once, few tasks are running: spin for a moment
        # instead of another pass of the loop)
        if dev.poll(event) or (spin and spin_poll(event, before, deadline)):
            event_waits[0] += 1
            return
    event_waits[1] += 1
    await notifier().wait(event)
