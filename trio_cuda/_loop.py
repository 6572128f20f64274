"""The event loop an await runs under: trio, or asyncio (directly, or under anyio).

trio is the first-class runtime; asyncio gets the same contract through the same code.
Every place the runtime yields to its loop goes through the primitives here, which ask,
per call, which loop is running the calling task:

* trio names itself in sniffio's thread-local (``sniffio.thread_local.name``) while it
  runs a task: one attribute read, so the trio path stays what it was;
* otherwise the task must be an asyncio task (``asyncio.current_task()``); anyio's asyncio
  backend runs plain asyncio tasks, its trio backend trio tasks.

What differs under asyncio, and why (docs/asyncio.md):

* A schedule point is a bare ``yield`` (asyncio's own ``sleep(0)``); a pending
  ``task.cancel()`` is delivered there. asyncio has no shielded schedule point, so the
  schedule point after completed work is an ordinary one: a cancel that arrives then
  raises CancelledError (the work is complete; nothing is left running).
* "Cancelled already?" is asked of ``Task.cancelling()`` (a task with a cancel request
  yields once, and asyncio delivers the CancelledError before anything is submitted),
  and, where anyio is imported, of anyio (its cancel scopes cancel their own task only
  at its next yield).
* A shielded wait (finishing a submission another one relies on) runs as a task of its
  own, awaited through ``asyncio.shield`` until it is done; then the cancel is honoured.
  That task is started again if something cancels it (``asyncio.run``'s end cancels
  every task), and a caller cancelled again and again (an anyio scope does so at every
  pass of the loop) waits inside an anyio shield instead of spinning.
* A wait for something another thread or task sets (:class:`Flag`) sleeps on an asyncio
  future (trio: ``wait_task_rescheduled``), never in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import sys
import threading
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

import sniffio
import trio

_T = TypeVar("_T")

__all__ = [
    "CANCELLED",
    "Flag",
    "cancel_shielded_checkpoint",
    "checkpoint",
    "checkpoint_if_cancelled",
    "current_task",
    "loop_name",
    "run_in_thread",
    "running_asyncio_loop",
    "shielded",
    "wait_readable",
]

#: What a cancelled wait raises, under either loop.
CANCELLED = (trio.Cancelled, asyncio.CancelledError)

_sniffed = sniffio.thread_local  # (trio sets .name = "trio" while it runs a task)
# (bound once: each await calls three of them)
_trio_current_task = trio.lowlevel.current_task
_trio_checkpoint = trio.lowlevel.checkpoint
_trio_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
_trio_cancel_shielded_checkpoint = trio.lowlevel.cancel_shielded_checkpoint


def loop_name() -> str | None:
    """``"trio"`` or ``"asyncio"``: which loop runs the calling task (None: none does)."""
    if _sniffed.name == "trio":
        return "trio"
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    return "asyncio"


def running_asyncio_loop() -> asyncio.AbstractEventLoop:
    """The calling thread's running asyncio loop, or a RuntimeError that says what to do."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "trio_cuda work is awaited inside a trio or asyncio task (trio.run, asyncio.run, "
            "anyio.run); from plain code, op.sync() runs it and waits"
        ) from None


def current_task() -> Any:
    """The calling trio or asyncio task (None outside both)."""
    if _sniffed.name == "trio":
        return _trio_current_task()
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


class _Yield:
    """asyncio's schedule point: one bare yield (what ``asyncio.sleep(0)`` does)."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield


_YIELD = _Yield()

# The three schedule points below return an awaitable rather than being coroutines
# themselves: under trio the caller awaits trio's own checkpoint directly, with no frame
# of ours in between (every await of an op passes through two of them). In a generator,
# ``yield from checkpoint().__await__()``.


def checkpoint() -> Awaitable[None]:
    """A schedule point and a cancellation point (an awaitable)."""
    if _sniffed.name == "trio":
        return _trio_checkpoint()
    running_asyncio_loop()
    return _YIELD


def checkpoint_if_cancelled() -> Awaitable[None]:
    """Raise the cancellation if the calling task is cancelled (under trio, and under
    asyncio when a cancel is pending); otherwise return at once (an awaitable)."""
    if _sniffed.name == "trio":
        return _trio_checkpoint_if_cancelled()
    running_asyncio_loop()
    return _asyncio_checkpoint_if_cancelled()


async def _asyncio_checkpoint_if_cancelled() -> None:
    task = asyncio.current_task()
    if task is None:
        return
    if task.cancelling():
        await _YIELD  # (a pending cancel is thrown in here; one already handled is not)
        return
    anyio = sys.modules.get("anyio")
    if anyio is not None:
        # An anyio cancel scope cancelled by its own task cancels it only at its next
        # yield: anyio itself knows (a no-op for a task outside anyio's scopes).
        await anyio.lowlevel.checkpoint_if_cancelled()


def cancel_shielded_checkpoint() -> Awaitable[None]:
    """A schedule point that trio does not cancel (after work that has completed).
    Under asyncio, which has no such point, an ordinary one (an awaitable)."""
    if _sniffed.name == "trio":
        return _trio_cancel_shielded_checkpoint()
    running_asyncio_loop()
    return _YIELD


async def wait_readable(fd: int) -> None:
    """Sleep in the loop's own I/O wait until ``fd`` is readable (cancellable)."""
    if _sniffed.name == "trio":
        await trio.lowlevel.wait_readable(fd)
        return
    loop = running_asyncio_loop()
    ready = loop.create_future()
    loop.add_reader(fd, _set_once, ready)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_flags_lock = threading.Lock()  # a leaf lock: guards every Flag's wakers


class Flag:
    """A flag set once, from any thread: :meth:`wait` blocks the calling thread until it
    is set, :meth:`wait_async` sleeps in the task's loop (no worker thread: a task that
    waits for another one's progress must not hold a thread that the other one needs)."""

    __slots__ = ("_event", "_wakers")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._wakers: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def set(self) -> None:
        """Set it and wake every waiter (their loops' thread-safe entries: no blocking)."""
        with _flags_lock:
            self._event.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def _add(self, wake: Callable[[], None]) -> bool:
        with _flags_lock:
            if self._event.is_set():
                return False
            self._wakers.append(wake)
            return True

    def _discard(self, wake: Callable[[], None]) -> None:
        with _flags_lock:
            if wake in self._wakers:
                self._wakers.remove(wake)

    async def wait_async(self) -> None:
        """Sleep until it is set (a checkpoint, also if it is set already; cancellable)."""
        if _sniffed.name == "trio":
            await self._wait_trio()
            return
        loop = running_asyncio_loop()
        fut = loop.create_future()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(_set_once, fut)
            except RuntimeError:  # (that loop is closed)
                pass

        if not self._add(wake):
            await _YIELD
            return
        try:
            await fut
        finally:
            self._discard(wake)

    async def _wait_trio(self) -> None:
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        woken = False  # (read and written in trio's thread only)

        def resume() -> None:
            nonlocal woken
            if not woken:
                woken = True
                trio.lowlevel.reschedule(task)

        def wake() -> None:
            try:
                token.run_sync_soon(resume)
            except trio.RunFinishedError:
                pass

        def abort(_: Any) -> trio.lowlevel.Abort:
            nonlocal woken
            woken = True
            self._discard(wake)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._add(wake):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        await trio.lowlevel.wait_task_rescheduled(abort)


async def run_in_thread(fn: Callable[..., _T], *args: Any, abandon_on_cancel: bool = True) -> _T:
    """``fn(*args)`` in a worker thread of the loop (trio's ``to_thread``, asyncio's default
    executor). ``abandon_on_cancel``: a cancel returns at once and the thread's result is
    dropped; otherwise the cancel waits for the thread, then is raised."""
    if _sniffed.name == "trio":
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel)
    loop = running_asyncio_loop()
    ctx = contextvars.copy_context()  # (as asyncio.to_thread: the thread sees the task's context)
    fut = loop.run_in_executor(None, functools.partial(ctx.run, fn, *args))
    if abandon_on_cancel:
        return await fut
    result: _T = await _shield_until_done(fut)
    return result


async def shielded(fn: Callable[[], Awaitable[None]]) -> None:
    """Run ``await fn()`` to its end whatever cancels the caller meanwhile (the caller
    raises its own cancellation afterwards).

    Under asyncio ``fn()`` runs as a task of its own, which whoever cancels every task
    (``asyncio.run`` does at its end) cancels too: then ``fn()`` is called again, so it
    must take up its work where the cancel left it."""
    if _sniffed.name == "trio":
        with trio.CancelScope(shield=True):
            await fn()
        return
    running_asyncio_loop()
    await _shield_until_done(asyncio.ensure_future(fn()), fn)


async def _shield_until_done(fut: asyncio.Future[Any], again: Callable[[], Awaitable[Any]] | None = None) -> Any:
    """Await ``fut`` until it is done, through cancels of the caller (raised afterwards);
    a cancel of ``fut`` itself starts ``again()`` in its place (without ``again``, it is
    raised)."""
    cancelled: asyncio.CancelledError | None = None
    cancels = 0
    while True:
        try:
            anyio = sys.modules.get("anyio") if cancels > 1 else None
            if anyio is None:
                result = await asyncio.shield(fut)
            else:
                # Cancelled again: an anyio scope, which cancels its tasks at every pass of
                # the loop. Shielded from it, the caller sleeps until ``fut`` is done (the
                # scope's cancel is raised at its next checkpoint, as trio does after a
                # shielded wait). Not at the first cancel: a plain asyncio task that anyio
                # never saw then stays out of anyio's books.
                with anyio.CancelScope(shield=True):
                    result = await asyncio.shield(fut)
        except asyncio.CancelledError as exc:
            if not fut.cancelled():
                cancelled = exc  # the caller's
                cancels += 1
            elif again is None:
                raise
            else:
                fut = asyncio.ensure_future(again())
            continue
        break
    if cancelled is not None:
        raise cancelled  # (as trio: an error of the shielded work itself wins, above)
    return result
