"""Completion wake-ups: from device events to trio tasks.

Two paths, chosen by measurements on an H200 (see docs/notifier.md):

* **Fast path** (:func:`wait_event`): the awaiting task polls its event between trio
  checkpoints for a budget (``TRIO_CUDA_POLL_BUDGET_US``; by default 5000 us on CUDA
  and 100 us on the simulated device, whose "GPU" threads need the GIL that polling
  would hold). The loop stays hot, other tasks keep running, completion is seen within
  one scheduler pass. The CUDA budget covers a decode step's graph replay (0.7 ms on
  an H200) and a few 1 ms kernels queued on one stream; a wait that outlasts it costs
  at most that much CPU, then parks.
* **Slow path** (:class:`Notifier`): past the budget the task parks, and one helper
  thread per process watches all parked waits. The backend *arms* each event so
  that its completion posts a waker the helper blocks on without the GIL (on CUDA a
  host function posting a semaphore, queued on a side stream so the work stream is
  never stalled). The helper then queries every parked event and wakes finished
  tasks in one ``run_sync_soon`` batch per trio run. With nothing parked it blocks
  indefinitely: no CPU use while idle. While waits are parked it also re-polls every
  20 ms, which catches device faults (a faulted context runs no host functions).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

import outcome
import trio

from ._backends import backend
from ._errors import DeviceFault

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Event

__all__ = ["Notifier", "notifier", "wait_event"]

_budget_ns: int | None = None


def poll_budget_ns() -> int:
    """How long an awaiting task polls before parking (nanoseconds)."""
    global _budget_ns
    if _budget_ns is None:
        env = os.environ.get("TRIO_CUDA_POLL_BUDGET_US")
        us = float(env) if env else backend().poll_budget_us
        _budget_ns = int(us * 1000)
    return _budget_ns
_FAULT_POLL_S = 0.02


class _Waiter:
    __slots__ = ("event", "device", "generation", "token", "task", "active")

    def __init__(self, event: "Event", token: trio.lowlevel.TrioToken, task: trio.lowlevel.Task) -> None:
        self.event = event
        self.device = event.stream.device
        self.generation = self.device._generation
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
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []
        self._thread: threading.Thread | None = None
        self.wakeups = 0  # helper-thread wake-ups, for tests and docs
        self.batches = 0  # run_sync_soon calls that woke tasks

    def parked(self) -> int:
        """How many waits are parked on the helper thread now."""
        return len(self._waiters)

    async def wait(self, event: "Event") -> None:
        """Park the current task until ``event`` completes (or its device faults)."""
        w = _Waiter(event, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task())
        dev = w.device
        dev._driver.arm(event.handle, event.stream.handle, self._waker)
        with self._lock:
            self._waiters.append(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trio-cuda-notifier", daemon=True)
                self._thread.start()
        self._waker.post()  # let the helper see the new waiter (and start polling for faults)

        def abort(_: Any) -> trio.lowlevel.Abort:
            w.active = False
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def device_reset(self, device: "Device") -> None:
        """Fail the parked waits of a device that was just reset."""
        self._waker.post()

    def _run(self) -> None:
        waker = self._waker
        while True:
            with self._lock:
                busy = bool(self._waiters)
            waker.wait(_FAULT_POLL_S if busy else None)
            self.wakeups += 1
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
                    if w.generation != w.device._generation:
                        exc = DeviceFault("the device was reset while this task waited for its work", device=w.device.ordinal)
                    elif not w.event.query():
                        keep.append(w)
                        continue
                except DeviceFault as fault:
                    exc = fault
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


async def wait_event(event: "Event") -> None:
    """Wait in trio for ``event``: a checkpoint even if it has completed already.

    Raises:
        DeviceFault: The event's device faulted.
        trio.Cancelled: The wait was cancelled; the device work goes on regardless.
    """
    if event.query():
        await trio.lowlevel.cancel_shielded_checkpoint()
        return
    deadline = time.perf_counter_ns() + (_budget_ns if _budget_ns is not None else poll_budget_ns())
    while True:
        await trio.lowlevel.checkpoint()
        if event.query():
            return
        if time.perf_counter_ns() > deadline:
            break
    await notifier().wait(event)
