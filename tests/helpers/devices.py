"""The backend in use, and helpers for tests that run work on the devices."""

from __future__ import annotations

import gc
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda

ON_CUDA = trio_cuda.backend_name() == "cuda"


def needs_devices(n: int):  # type: ignore[no-untyped-def]
    return pytest.mark.skipif(trio_cuda.device_count() < n, reason=f"needs {n} devices")


def counter() -> trio_cuda.DeviceOp[trio_cuda.Partition]:
    """A fresh 1-element int32 counter partition, for the sleep kernel."""
    return trio_cuda.api.zeros((1,), np.int32).partition((1,))


def settle() -> None:
    """Drop garbage and flush deferred frees on every device (plain code)."""
    gc.collect()
    for d in trio_cuda.devices():
        d.synchronize()


async def started(
    op: object, policy: trio_cuda.SchedulingPolicy | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> object:
    """For ``await nursery.start(started, op[, policy])`` (or an anyio task group's
    ``start``): reports started once ``op`` is enqueued (its work is then ordered before
    anything submitted later), then waits for it."""
    stream = policy.next_stream() if policy is not None else None
    sub = await trio_cuda.lowlevel.submit(op, stream)  # type: ignore[arg-type]
    task_status.started()
    return await sub.wait()


class Resetter:
    """A thread that resets ``dev`` in a loop, paced: after each reset it waits until
    ``progress`` is set (or 2 s pass), so that some submissions get through between
    resets (a CUDA reset also unloads the kernels and unpins the staging memory, which
    the next submissions bring back). Use as a context manager around the work."""

    def __init__(self, dev: trio_cuda.Device) -> None:
        self.dev = dev
        self.resets = 0
        self.progress = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.dev.reset()
            self.resets += 1
            self.progress.clear()
            self.progress.wait(2.0)

    def __enter__(self) -> Resetter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def run_with_deadline(fn: Callable[[], Awaitable[Any]], seconds: float = 60.0) -> Any:
    """``trio.run(fn)``, failing (TooSlowError) if it takes longer than ``seconds``."""

    async def main() -> Any:
        with trio.fail_after(seconds):
            return await fn()

    return trio.run(main)


def snapshot(dev: trio_cuda.Device) -> tuple[int, ...]:
    s = dev.statistics()
    return (s.submissions, s.launches, s.allocations, s.copies, s.stream_waits, s.bytes_in_use)
