"""asyncio's own ways to cancel and group tasks (``task.cancel()``, ``asyncio.timeout``,
``wait_for``, ``TaskGroup``), on asyncio's loop and on uvloop; and a trio loop and an
asyncio loop in two threads awaiting work on one device at once."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import counter, settle
from ..helpers.faults import scribble
from ..helpers.loads import fresh_kernel, hold_loads

SLOW_NS = 400_000_000


def _new_loops() -> list[Any]:
    out = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        return out
    return [*out, pytest.param(uvloop.new_event_loop, id="uvloop")]


def _runners() -> list[Any]:
    out = [pytest.param(asyncio.run, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        return out
    return [*out, pytest.param(uvloop.run, id="uvloop")]


@pytest.fixture(params=_runners())
def arun(request: pytest.FixtureRequest) -> Callable[[Awaitable[Any]], Any]:
    runner = request.param

    def run(coro: Awaitable[Any]) -> Any:
        async def main() -> Any:
            async with asyncio.timeout(90):
                return await coro

        return runner(main())

    return run


async def _submitted(op: Any, ready: asyncio.Event) -> Any:
    sub = await lowlevel.submit(op)
    ready.set()
    return await sub.wait()


def test_task_cancel_after_submission_returns_promptly_and_the_work_completes(arun: Any) -> None:
    async def body() -> None:
        await sleep(counter(), 1000)
        c = await counter()
        ready = asyncio.Event()
        task = asyncio.create_task(_submitted(sleep(c, SLOW_NS), ready))
        await ready.wait()
        start = time.perf_counter()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.perf_counter() - start < SLOW_NS / 2e9
        np.testing.assert_array_equal(await c.tensor.to_host(), [1])  # ordered after it

    arun(body())


def test_task_cancel_before_submission_runs_nothing(arun: Any) -> None:
    async def body() -> None:
        dev = trio_cuda.current_device()
        c = await counter()
        op = sleep(c, 1000)
        before = dev.statistics().submissions

        async def awaits() -> None:
            asyncio.current_task().cancel()  # type: ignore[union-attr]  # pending at the await
            await op

        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(awaits())
        assert dev.statistics().submissions == before
        await op
        np.testing.assert_array_equal(await c.tensor.to_host(), [1])

    arun(body())


def test_timeout_and_wait_for_end_a_long_await(arun: Any) -> None:
    async def body() -> None:
        await sleep(counter(), 1000)
        c = await counter()
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await sleep(c, SLOW_NS)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sleep(c, SLOW_NS).first().to_host(), 0.05)  # type: ignore[arg-type]
        assert time.perf_counter() - start < SLOW_NS / 1e9
        np.testing.assert_array_equal(await c.tensor.to_host(), [2])
        # The task is not left cancelled: it goes on awaiting work.
        np.testing.assert_array_equal(await ops.add(api.full((2,), 1.0), 1.0).to_host(), [2, 2])

    arun(body())


def test_a_deadline_passed_already(arun: Any) -> None:
    # wait_for(op, 0) and anyio's move_on_after(0) submit nothing (as trio's
    # move_on_after(0)); asyncio.timeout(0) asks for its cancel at the loop's next pass,
    # after the await has submitted: the work runs (docs/asyncio.md).
    async def body() -> None:
        dev = trio_cuda.current_device()
        c = await counter()
        await sleep(c, 1000)
        op = sleep(c, 1000)
        before = dev.statistics().submissions
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(op, 0)  # type: ignore[arg-type]
        with anyio.move_on_after(0) as scope:
            await op
        assert scope.cancelled_caught
        assert dev.statistics().submissions == before
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0):
                await op
        assert dev.statistics().submissions == before + 1
        np.testing.assert_array_equal(await c.tensor.to_host(), [2])

    arun(body())


@pytest.mark.faults_device
def test_a_fault_in_a_task_group_cancels_its_siblings(arun: Any) -> None:
    async def body() -> list[str]:
        target = await api.zeros((32,))
        await asyncio.to_thread(scribble.prepare, target.partition((32,)))
        seen: list[str] = []

        async def sibling(ready: asyncio.Event) -> None:
            ready.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        ready = asyncio.Event()
        with pytest.raises(ExceptionGroup) as info:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(sibling(ready))
                await ready.wait()
                tg.create_task(_await(scribble(target.partition((32,)))))
        assert info.value.subgroup(trio_cuda.DeviceFault) is not None
        return seen

    start = time.perf_counter()
    assert arun(body()) == ["cancelled"]
    assert time.perf_counter() - start < 2.5


async def _await(op: Any) -> Any:
    return await op


async def _cancel_a_while_b_relies(shared: Any, b: threading.Thread) -> None:
    """Task A awaits ``shared`` (its kernel's load held back); thread ``b`` starts and
    relies on A's submission; then A is cancelled, and goes on in a task of its own."""
    before = lowlevel.submission_statistics()
    a = asyncio.create_task(_await(shared))
    while lowlevel.submission_statistics().waited_for_kernels == before.waited_for_kernels:
        await asyncio.sleep(0)
    b.start()
    while lowlevel.submission_statistics().waited_for_submission == before.waited_for_submission:
        await asyncio.sleep(0.001)
    ours = asyncio.all_tasks()
    a.cancel()
    while asyncio.all_tasks() <= ours:
        await asyncio.sleep(0)


def test_the_end_of_the_run_does_not_drop_a_submission_another_relies_on(
    arun: Any, dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A, cancelled while its kernel loads, goes on (shielded, in a task of its own) for B,
    # a consumer of the same shared op in another thread. Then the run ends, cancelling
    # every task, that one too: A's submission must still complete (B waited forever).
    k = fresh_kernel()
    release = hold_loads(dev, monkeypatch)
    x = api.full((8,), 2.0).sync()
    shared = k(api.empty((8,)).partition((8,)), x).first().unpartition().shared()
    got: dict[str, Any] = {}
    b = threading.Thread(target=lambda: got.update(b=shared.to_host().sync()), daemon=True)

    async def release_when_cancelled() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            release()  # (the run's end cancels every task at once: A's helper has been cancelled)

    async def body() -> None:
        await _cancel_a_while_b_relies(shared, b)
        got["releaser"] = asyncio.create_task(release_when_cancelled())
        await asyncio.sleep(0)  # (it has started)

    arun(body())
    b.join(10)
    assert not b.is_alive(), "the consumer relying on the cancelled submission hung"
    np.testing.assert_array_equal(got["b"], np.full(8, 4.0, np.float32))
    np.testing.assert_array_equal(shared.to_host().sync(), np.full(8, 4.0, np.float32))


def test_trio_and_asyncio_threads_await_on_one_device_at_once() -> None:
    # Both loops park waits on the one notifier at the same time (a budget of 0: every
    # wait parks), each woken through its own loop.
    from trio_cuda import _notifier

    saved = _notifier._budget_ns
    _notifier._budget_ns = 0
    both = threading.Barrier(2, timeout=30)
    results: dict[str, Any] = {}

    async def work(name: str, value: float, to_thread: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        x = await api.full((64,), value)
        await to_thread(both.wait)  # both loops are running
        c = await counter()
        parked = 0
        for _ in range(20):
            x = await ops.add(x, 1.0)
            await sleep(c, 2_000_000)
            parked = max(parked, lowlevel.notifier_statistics().parked)
        results[name] = (await x.to_host(), await c.tensor.to_host(), parked)

    def in_trio() -> None:
        trio.run(work, "trio", 1.0, trio.to_thread.run_sync)

    def in_asyncio() -> None:
        asyncio.run(work("asyncio", 100.0, asyncio.to_thread))

    try:
        threads = [threading.Thread(target=f) for f in (in_trio, in_asyncio)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a loop hung"
    finally:
        _notifier._budget_ns = saved
        settle()
    assert sorted(results) == ["asyncio", "trio"]
    for name, start in (("trio", 1.0), ("asyncio", 100.0)):
        x, c, _ = results[name]
        np.testing.assert_array_equal(x, np.full(64, start + 20, np.float32))
        np.testing.assert_array_equal(c, [20])
    assert max(r[2] for r in results.values()) >= 1  # waits were parked on the notifier


@pytest.mark.parametrize("new_loop", _new_loops())
def test_a_loop_closed_with_a_submission_another_relies_on_fails_it_instead_of_hanging(
    new_loop: Callable[[], asyncio.AbstractEventLoop], dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, but the loop is closed with the tasks pending: A's submission cannot go on.
    # B, relying on it from another thread, gets an error saying so (it waited forever).
    k = fresh_kernel()
    release = hold_loads(dev, monkeypatch)
    x = api.full((8,), 2.0).sync()
    shared = k(api.empty((8,)).partition((8,)), x).first().unpartition().shared()
    got: dict[str, Any] = {}

    def relying() -> None:
        try:
            shared.to_host().sync()
        except trio_cuda.DeviceError as err:
            got["b"] = err

    b = threading.Thread(target=relying, daemon=True)

    async def body() -> None:
        await _cancel_a_while_b_relies(shared, b)

    loop = new_loop()
    loop.run_until_complete(body())
    loop.close()
    release()
    deadline = time.monotonic() + 10
    while b.is_alive() and time.monotonic() < deadline:
        gc.collect()  # (the closed loop's tasks are let go once the load's thread is done)
        b.join(0.01)
    assert not b.is_alive(), "the consumer relying on the abandoned submission hung"
    assert "abandoned before it enqueued" in str(got["b"])
    with pytest.raises(trio_cuda.DeviceError, match="abandoned"):
        shared.sync()  # (the shared op failed for every consumer)
    monkeypatch.undo()
    out = api.zeros((8,)).sync()
    k(out.partition((8,)), x).sync()
    np.testing.assert_array_equal(out.to_host().sync(), np.full(8, 4.0, np.float32))
