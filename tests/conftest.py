"""Test configuration: the simulated device gets 3 devices; every trio test has a deadline.

The same tests run on the CUDA backend (``TRIO_CUDA_BACKEND=cuda``, or automatically on
a machine with a GPU). Tests marked ``gpu`` need CUDA and are skipped on the simulator;
tests that need several devices skip when there are fewer.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRIO_CUDA_SIM_DEVICES", "3")

import gc
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda

DEADLINE = float(os.environ.get("TRIO_CUDA_TEST_DEADLINE", "90"))
ON_CUDA = trio_cuda.backend_name() == "cuda"
# Completion words: the simulated device has them unless TRIO_CUDA_COMPLETION_WORDS=0
# (CI runs the suite both ways); CUDA only with TRIO_CUDA_COMPLETION_WORDS=1.
_WORDS_ENV = os.environ.get("TRIO_CUDA_COMPLETION_WORDS", "").strip()
WORDS = _WORDS_ENV == "1" if ON_CUDA else _WORDS_ENV != "0"
# Tests marked faults_device poison the device on purpose. On CUDA each runs in a child
# process, so the rest of the session keeps a healthy device (TRIO_CUDA_ISOLATE_FAULTS=1
# does the same on the simulated device, to test this machinery).
ISOLATED = os.environ.get("TRIO_CUDA_ISOLATED") == "1"
ISOLATE_FAULTS = (ON_CUDA or os.environ.get("TRIO_CUDA_ISOLATE_FAULTS") == "1") and not ISOLATED


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sim_only: relies on the simulated device's behaviour")
    config.addinivalue_line("markers", "faults_device: faults a device on purpose (isolated in a child process on CUDA)")


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    if ISOLATE_FAULTS and item.get_closest_marker("faults_device"):
        nodeid = item.nodeid

        def run_isolated(*args: object, **kwargs: object) -> None:
            env = dict(os.environ, TRIO_CUDA_ISOLATED="1")
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(item.config.rootpath))
            if r.returncode != 0:
                pytest.fail(f"isolated run of {nodeid} failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}", pytrace=False)

        item.obj = run_isolated  # type: ignore[attr-defined]
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") and not ON_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("sim_only") and ON_CUDA:
            item.add_marker(pytest.mark.skip(reason="simulated-device behaviour"))
        fn = getattr(item, "function", None)
        if fn is not None and _is_async(fn):
            item.add_marker(pytest.mark.usefixtures("_deadline"))


def _is_async(fn: object) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


@pytest.fixture
async def _deadline(nursery: trio.Nursery):  # type: ignore[no-untyped-def]
    """Fail a trio test that runs longer than DEADLINE seconds instead of hanging."""

    async def watchdog() -> None:
        await trio.sleep(DEADLINE)
        raise trio.TooSlowError(f"test exceeded its {DEADLINE:.0f} s deadline (a hang?)")

    nursery.start_soon(watchdog)
    yield


def _reset_faulted() -> None:
    for d in trio_cuda.devices():
        if d.is_faulted:
            try:
                d.reset()
            except trio_cuda.DeviceFault:
                # CUDA cannot bring a device back inside the process after a sticky fault;
                # such tests run isolated in a child process, which ends anyway.
                if not (ON_CUDA and ISOLATED):
                    raise


@pytest.fixture(autouse=True)
def _healthy_devices():  # type: ignore[no-untyped-def]
    """Each test starts with usable devices; a test that faults one resets it."""
    _reset_faulted()
    yield
    _reset_faulted()


@pytest.fixture
def dev() -> trio_cuda.Device:
    return trio_cuda.device(0)


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
    """For ``await nursery.start(started, op[, policy])``: reports started once ``op`` is
    enqueued (its work is then ordered before anything submitted later), then waits for it."""
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
