"""A precise timer a task can sleep on: a Linux ``timerfd`` in its loop's own I/O wait.

trio's own sleeps end on its I/O wait's timeout, which Python rounds up to whole
milliseconds; an await that sleeps through long GPU work must wake within tens of
microseconds of a chosen moment. A timerfd does: the kernel wakes the trio thread when
it fires, and another thread (the notifier, on completion) can make it fire at once.
Elsewhere :func:`available` is False and the wait uses the notifier's timers instead.
"""

from __future__ import annotations

import ctypes
import os
import sys

from . import _loop

__all__ = ["Timer", "available", "timer"]

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = 0o2000000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    except (OSError, AttributeError):
        _libc = None


def available() -> bool:
    """True where timers of this module exist (Linux)."""
    return _libc is not None


class Timer:
    """One timerfd: :meth:`set` from the trio thread, :meth:`fire` from any thread."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        assert _libc is not None
        fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.fd = fd

    def set(self, ns: int) -> None:
        """Fire ``ns`` nanoseconds from now (at least 1 ns; 0 disarms)."""
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))
        _libc.timerfd_settime(self.fd, 0, ctypes.byref(spec), None)  # type: ignore[union-attr]

    def fire(self) -> None:
        """Fire now (any thread)."""
        self.set(1)

    async def wait(self) -> None:
        """Sleep in the task's loop until the timer fires (cancellable), then clear it."""
        await _loop.wait_readable(self.fd)
        self.clear()

    def clear(self) -> None:
        """Disarm, and drop a firing not yet read."""
        self.set(0)
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass


_idle: list[Timer] = []


def timer() -> Timer:
    """A timer from the pool (give it back with :func:`release`)."""
    return _idle.pop() if _idle else Timer()


def release(t: Timer) -> None:
    """Back to the pool, disarmed."""
    t.clear()
    _idle.append(t)
