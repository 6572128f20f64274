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
"""

from __future__ import annotations

import threading

import trio

from ._errors import NestedExecutionError

__all__ = ["LOCK", "check_blocking_allowed", "check_not_nested", "in_trio", "submitting"]

LOCK = threading.RLock()


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


def in_trio() -> bool:
    """True if the calling thread runs a trio task right now."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def check_blocking_allowed(what: str) -> None:
    """Raise if a blocking call would stall a running trio loop (or nest in a submission)."""
    check_not_nested(what)
    if in_trio():
        raise RuntimeError(
            f"{what} would block the trio event loop; use 'await' inside trio "
            "(or run the blocking call in a worker thread: await trio.to_thread.run_sync(...))"
        )
