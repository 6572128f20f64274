"""The devices of the process, and the current device of each task and thread.

The current device is a context variable: per trio task (inherited by the tasks it
starts) and per thread.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import threading
from collections.abc import Iterator

from ._backends import backend
from ._checks import is_int
from ._device import Device
from ._guard import LOCK, check_not_forked, on_fork_child

__all__ = ["as_device", "current_device", "device", "device_count", "devices", "use_device"]

_devices: list[Device] | None = None
_devices_lock = threading.Lock()
_current: contextvars.ContextVar[Device | None] = contextvars.ContextVar("trio_cuda_current_device", default=None)


def devices() -> list[Device]:
    """All devices of the selected backend (the first call opens the backend).

    Raises:
        ForkedProcessError: This process was forked from one that had started trio-cuda.
    """
    global _devices
    check_not_forked()
    if _devices is None:
        # The backend is opened (and the process marked started) before the lock is
        # taken: a fork while another thread holds it then makes a child that refuses.
        b = backend()
        with _devices_lock:
            if _devices is None:
                _devices = [Device._new(i, b.driver(i), b.name, b.new_waker) for i in range(b.device_count())]
    return list(_devices)


def _orphan_devices() -> None:
    """In a forked child: every device refuses work, and the work of the parent that it
    still names is stale, so nothing there waits for a thread or a driver context that the
    child does not have."""
    for d in _devices or ():
        d._orphan()


on_fork_child(_orphan_devices)


@atexit.register
def _at_exit() -> None:
    """Before the interpreter's teardown: each device's driver releases what must not be
    left to it (the CUDA backend's replayed-GEMM graphs), under the runtime lock so no
    submission of a thread still running races it; skipped if the lock stays held."""
    devs = _devices
    if not devs or not LOCK.acquire(timeout=1.0):
        return
    try:
        for d in devs:
            if d._resetting:
                continue
            try:
                d._driver.at_exit()
            except Exception:  # exiting: a device that cannot keeps its objects
                pass
    finally:
        LOCK.release()


def device_count() -> int:
    """The number of devices."""
    return len(devices())


def device(ordinal: int) -> Device:
    """The device with the given ordinal (numpy integers accepted).

    Raises:
        TypeError: ``ordinal`` is not an integer.
        ValueError: No such device.
    """
    all_ = devices()
    if not is_int(ordinal):
        raise TypeError(f"device ordinal must be an int, not {type(ordinal).__name__}")
    if not 0 <= ordinal < len(all_):
        raise ValueError(f"no device {ordinal}: there are {len(all_)} device(s)")
    return all_[int(ordinal)]


def current_device() -> Device:
    """The device that ``await op`` uses in this task or thread (device 0 unless changed).

    Raises:
        ForkedProcessError: This process was forked from one that had started trio-cuda.
    """
    check_not_forked()
    d = _current.get()
    if d is not None:
        return d
    return _devices[0] if _devices is not None else device(0)


def as_device(d: Device | int | None) -> Device:
    """``d`` as a Device: a Device, an ordinal, or None for the current device."""
    if d is None:
        return current_device()
    if isinstance(d, Device):
        return d
    return device(d)


@contextlib.contextmanager
def use_device(d: Device | int) -> Iterator[Device]:
    """Make ``d`` the current device for the block (in this task/thread and the tasks it starts).

    Example (inside a trio task)::

        with trio_cuda.use_device(1):
            t = await api.zeros((4, 4))   # on device 1
    """
    dev = as_device(d)
    token = _current.set(dev)
    try:
        yield dev
    finally:
        _current.reset(token)
