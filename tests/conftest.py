"""Test configuration: the simulated device gets 3 devices; every trio test has a deadline.

The same tests run on the CUDA backend (``TRIO_CUDA_BACKEND=cuda``, or automatically on
a machine with a GPU). Tests marked ``gpu`` need CUDA and are skipped on the simulator;
tests that need several devices skip when there are fewer. The helpers the test modules
share are in ``tests/helpers``; this module has only pytest hooks and fixtures.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRIO_CUDA_SIM_DEVICES", "3")

import subprocess
import sys

import pytest
import trio

import trio_cuda

from .helpers.devices import ON_CUDA

DEADLINE = float(os.environ.get("TRIO_CUDA_TEST_DEADLINE", "90"))
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
                # A crash ends stderr with a long list of extension modules: keep the
                # fatal error and the threads' stacks before it.
                err = r.stderr.split("\nExtension modules:", 1)[0]
                pytest.fail(
                    f"isolated run of {nodeid} failed (exit {r.returncode}):\n{r.stdout[-6000:]}\n{err[-8000:]}", pytrace=False
                )

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


@pytest.fixture(autouse=True)
def _fresh_forecast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's waits start with nothing learned, as in a new process: what an
    earlier test's kernels took does not decide whether this test's waits poll, park
    or sleep on a timer."""
    from trio_cuda import _notifier
    from trio_cuda._forecast import Forecast

    monkeypatch.setattr(_notifier, "_forecast", Forecast())


@pytest.fixture
def dev() -> trio_cuda.Device:
    return trio_cuda.device(0)
