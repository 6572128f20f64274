"""The runtime lock, the in-submission flag, and the checks for blocking calls.

The lock order of the whole runtime (documented in docs/runtime.md):

1. :data:`LOCK`, the runtime lock (reentrant, process-wide). It guards every piece of
   runtime bookkeeping (streams' points, events, buffers' pending accesses, deferred
   frees, staging pools, captures, op states) and every *fast* driver call (enqueue,
   query, record, stream creation). It is never held while blocking: no waiting for
   the device, no compilation, no pinned-memory allocation or release, no making or
   destroying of NCCL communicators.
2. ``Device._slow_lock`` (one per device): slow driver calls that may wait for the
   device (module loading, pinned host memory) and the driver reset; a collectives
   group's making lock (NCCL's setup). Taken without :data:`LOCK` held, never the other
   way round.
3. Leaf locks (the notifier's waiter list, a kernel's compile lock, the janitor's
   queue): nothing else is taken while one is held.

No lock is taken in a finalizer (``__del__``): finalizers append to lock-free queues
that the owner drains under :data:`LOCK`.

Fork. A child made by ``os.fork`` after the runtime started has none of the parent's
threads (the simulated device's streams, the notifier, the staging janitor), and on CUDA
cannot use the driver the parent initialized. :func:`check_not_forked` makes every use
of the runtime in such a child raise :class:`ForkedProcessError` instead of waiting
forever. :data:`LOCK` is held across the fork, so the child never inherits it held by a
thread that does not exist there (it is never held while blocking: the wait is short).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ._errors import ForkedProcessError, NestedExecutionError
from ._loop import loop_name

__all__ = [
    "LOCK",
    "check_blocking_allowed",
    "check_not_forked",
    "check_not_nested",
    "loop_hint",
    "mark_started",
    "lock_acquire",
    "lock_release",
    "on_fork_child",
    "submitting",
]

LOCK = threading.RLock()
# Bound once: the paths of every await take the lock three times, and looking the method
# up costs as much as taking the lock (the same lock object lives on across a fork).
lock_acquire = LOCK.acquire
lock_release = LOCK.release

_started = False  # this process opened the backend (or initialized the CUDA driver)
_forked_from: int | None = None  # in a forked child of a started process: the parent's pid
_child_hooks: list[Callable[[], None]] = []


def mark_started() -> None:
    """Note that the runtime holds state a forked child cannot inherit (called before the
    backend is opened, and once the CUDA driver is initialized)."""
    global _started
    _started = True


def on_fork_child(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in a forked child of a started process, after the fork flag is set
    (the device registry makes its devices refuse work there). It must not block."""
    _child_hooks.append(hook)


def check_not_forked() -> None:
    """Raise ForkedProcessError in a child forked from a process that had started trio-cuda."""
    parent = _forked_from
    if parent is not None:
        raise ForkedProcessError(
            f"this process was forked (os.fork) from process {parent}, which had started trio-cuda: "
            "the devices, streams and helper threads of that process do not exist here "
            "(and a CUDA context cannot be used after a fork); start child processes with "
            "multiprocessing.get_context('spawn') or multiprocessing.get_context('forkserver'), "
            "or fork before the first use of trio-cuda"
        )


def _before_fork() -> None:
    LOCK.acquire()


def _after_fork_in_parent() -> None:
    LOCK.release()


def _after_fork_in_child() -> None:
    global _forked_from
    # Held by this thread across the fork; its ident is the same in the child.
    LOCK.release()
    if _started:
        _forked_from = os.getppid()
        for hook in _child_hooks:
            hook()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class _ThreadState(threading.local):
    submitting = False  # True while this thread plans or enqueues a submission


_tls = _ThreadState()


def submitting() -> bool:
    """True while the calling thread is inside a submission (a then()/map() callback)."""
    return _tls.submitting


def set_submitting(flag: bool) -> None:
    _tls.submitting = flag


def check_not_nested(what: str) -> None:
    """Raise NestedExecutionError if called from inside a submission of this thread."""
    if _tls.submitting:
        raise NestedExecutionError(
            f"{what} inside another op's submission (a then()/map() callback or an open graph "
            "capture); return the op from the callback instead of executing it"
        )


def loop_hint(loop: str) -> str:
    """How to run a blocking call off the ``loop`` ("trio" or "asyncio") thread."""
    if loop == "trio":
        return "await trio.to_thread.run_sync(...)"
    return "await asyncio.to_thread(...), or await anyio.to_thread.run_sync(...) under anyio"


def check_blocking_allowed(what: str) -> None:
    """Raise if a blocking call would stall a running trio or asyncio loop (or nest in a
    submission), or in a forked child (see :func:`check_not_forked`)."""
    check_not_forked()
    check_not_nested(what)
    loop = loop_name()
    if loop is not None:
        raise RuntimeError(
            f"{what} would block the {loop} event loop; use 'await' inside {loop} "
            f"(or run the blocking call in a worker thread: {loop_hint(loop)})"
        )
