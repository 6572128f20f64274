"""Completion wake-ups: fast path, slow path (one helper thread), batching, idleness."""

from __future__ import annotations

import threading
import time

import numpy as np
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda._notifier import notifier
from trio_cuda.kernels import sleep

from .conftest import counter


async def test_long_waits_park_on_the_helper_thread() -> None:
    n = notifier()
    parked = []

    async def watch() -> None:
        for _ in range(200):
            parked.append(n.parked())
            await trio.sleep(0.005)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await sleep(counter(), 200_000_000)
        nursery.cancel_scope.cancel()
    assert max(parked) >= 1
    assert n.parked() == 0


async def test_no_thread_per_wait() -> None:
    for _ in range(len(trio_cuda.current_device().policy.streams)):
        await sleep(counter(), 1000)  # start the notifier and every pool stream
    threads_before = threading.active_count()
    peak = threads_before

    async def waiter() -> None:
        await sleep(counter(), 100_000_000)

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, threading.active_count())
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        async with trio.open_nursery() as waiters:
            for _ in range(40):
                waiters.start_soon(waiter)
        nursery.cancel_scope.cancel()
    # 40 concurrent waits: no new thread per wait (streams have their own workers
    # on the simulated device; the pool is 4 streams, which exist already).
    assert peak - threads_before <= 1


async def test_wakeups_are_batched(dev: trio_cuda.Device) -> None:
    # Eight waits that complete together, right after one long op on the same stream,
    # are woken in fewer trio callbacks than waits: each callback serves a batch.
    n = notifier()
    policy = trio_cuda.SingleStream(dev)
    c = [await counter()]
    batches_before = n.batches
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_await, sleep(c[0], 200_000_000).schedule(policy))
        await trio.sleep(0.02)
        for i in range(1, 9):
            nursery.start_soon(_await, api.full((1,), i).schedule(policy))
    assert n.batches - batches_before < 9


async def _await(op: object) -> None:
    await op  # type: ignore[misc]


async def test_idle_runtime_uses_no_cpu() -> None:
    n = notifier()
    await sleep(counter(), 50_000_000)
    await trio.sleep(0.1)
    before = n.wakeups
    cpu_before = time.thread_time()
    await trio.sleep(0.5)
    assert n.wakeups == before, "the helper thread woke up while nothing was in flight"
    assert time.thread_time() - cpu_before < 0.05


async def test_cancelled_parked_wait_leaves_no_waiter() -> None:
    n = notifier()
    c = await counter()
    with trio.move_on_after(0.05):
        await sleep(c, 300_000_000)
    assert n.parked() <= 1
    await trio.sleep(0.5)
    assert n.parked() == 0
    np.testing.assert_array_equal(await c.to_host(), [1])


async def test_fast_path_short_work() -> None:
    # Tiny work completes on the fast path or the slow path; either way it completes.
    for _ in range(20):
        np.testing.assert_array_equal(await api.full((2,), 1.0).to_host(), [1.0, 1.0])


def test_armed_event_posts_the_waker_on_completion(dev: trio_cuda.Device) -> None:
    # The backend contract the slow path relies on: arm() posts the waker once the
    # event completes (on CUDA: a host function that is sem_post), not before.
    from trio_cuda._backends import backend
    from trio_cuda._execution import submit

    waker = backend().new_waker()
    s = dev.create_stream()
    c = counter().sync_on(s)
    _, ev, _ = submit(sleep(c, 200_000_000), s)
    assert ev is not None
    dev._driver.arm(ev.handle, s.handle, waker)
    assert not waker.wait(0.05), "posted before the work completed"
    assert waker.wait(10.0), "never posted"
    assert ev.query()
    np.testing.assert_array_equal(api.memcpy(np.zeros(1, np.int32), c).sync(), [1])
