"""The semaphore the CUDA backend's host functions post: a completion is a host function
that is libc's ``sem_post`` itself (no Python callback, no GIL), and the notifier's
helper thread sleeps on the semaphore without the GIL."""

from __future__ import annotations

import ctypes
import ctypes.util
import time

from ._boundary import Waker

__all__ = ["SEM_POST_ADDR", "SemWaker", "wakers"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_SEM_SIZE = 64  # sizeof(sem_t) is 32 on x86-64 Linux; leave room


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_post.argtypes = [ctypes.c_void_p]
_libc.sem_wait.argtypes = [ctypes.c_void_p]
_libc.sem_trywait.argtypes = [ctypes.c_void_p]
_libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
SEM_POST_ADDR = ctypes.cast(_libc.sem_post, ctypes.c_void_p).value


wakers: list[SemWaker] = []  # never freed: a pending host function may still post one


class SemWaker(Waker):
    """A POSIX semaphore: posted by CUDA host functions (libc's sem_post), waited without the GIL."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(_SEM_SIZE)
        self.addr = ctypes.addressof(self._buf)
        if _libc.sem_init(self.addr, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def wait(self, timeout: float | None) -> bool:
        # ctypes releases the GIL around foreign calls.
        if timeout is None:
            while _libc.sem_wait(self.addr) != 0:
                pass  # EINTR
        else:
            deadline = time.time() + timeout
            ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
            if _libc.sem_timedwait(self.addr, ctypes.byref(ts)) != 0:
                return False
        while _libc.sem_trywait(self.addr) == 0:
            pass  # (the posts that piled up: this one wake-up serves them)
        return True

    def post(self) -> None:
        _libc.sem_post(self.addr)
