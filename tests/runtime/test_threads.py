"""Thread safety: every public call from any thread against every other, and finalizers
that never take a lock."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda._guard import LOCK
from trio_cuda.kernels import add, sleep

from ..helpers.devices import ON_CUDA, counter, settle


def _run_trio(fn: object, seconds: float) -> object:
    async def main() -> object:
        with trio.fail_after(seconds):
            return await fn()  # type: ignore[operator]

    return trio.run(main)


def test_synchronize_from_other_threads_while_trio_tasks_submit(dev: trio_cuda.Device) -> None:
    # Device.synchronize() and Stream.synchronize() retire streams' keep-alives while trio
    # tasks submit and read back: each task must read exactly what it wrote.
    stop = threading.Event()
    errors: list[BaseException] = []
    syncs = 0

    def synchronizer() -> None:
        nonlocal syncs
        streams = dev.policy.streams
        while not stop.is_set():
            try:
                dev.synchronize()
                for s in streams:
                    s.synchronize()
                syncs += 1
            except BaseException as err:
                errors.append(err)
                return

    async def main() -> int:
        checked = 0

        async def task(i: int) -> None:
            nonlocal checked
            for j in range(40):
                v = float(i * 1000 + j)
                x = await api.full((32,), v)
                out = await add(api.empty((32,)).partition((32,)), x, x).first().to_host()
                np.testing.assert_array_equal(out, np.full(32, 2 * v, np.float32))
                checked += 1

        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(task, i)
        return checked

    threads = [threading.Thread(target=synchronizer) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        checked = _run_trio(main, 60)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert checked == 320 and syncs > 0


def test_many_threads_sync_while_trio_awaits(dev: trio_cuda.Device) -> None:
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(25):
                v = float(i * 100 + j)
                out = api.full((8,), v).then(lambda t: add(api.empty((8,)).partition((8,)), t, t)).first().to_host().sync()
                assert (out == 2 * v).all(), (i, j, out)
        except BaseException as err:
            errors.append(err)

    async def main() -> None:
        async def task(i: int) -> None:
            for j in range(25):
                out = await api.full((8,), float(-i - j)).to_host()
                assert (out == -i - j).all()

        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(task, i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    _run_trio(main, 60)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_finalizers_never_wait_for_the_runtime_lock(dev: trio_cuda.Device) -> None:
    # Garbage of every kind the runtime makes (tensors, streams, events, read-back values,
    # graphs), collected by a thread while another thread holds the runtime lock.
    settle()
    tracked_before = dev.memory_in_use()
    free_before = dev.mem_info()[0]
    x = api.arange(16).sync()
    z = api.zeros((16,)).sync()
    holder_has_lock = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with LOCK:
            holder_has_lock.set()
            release.wait(30)

    garbage: list[object] = []
    for _ in range(5):
        policy = trio_cuda.SingleStream(dev)
        t = api.full((64,), 1.0).schedule(policy).sync()
        pending = api.dup(t).to_host()  # an op never run
        g = add(z.partition((16,)), x, x).graph()
        cyc: list[object] = [policy, t, pending, g, trio_cuda.lowlevel.record(policy.streams[0])]
        cyc.append(cyc)  # a reference cycle: only the cyclic collector frees it
        garbage.append(cyc)
    del policy, t, pending, g, cyc
    th = threading.Thread(target=holder)
    th.start()
    assert holder_has_lock.wait(10)
    garbage.clear()
    start = time.perf_counter()
    gc.collect()
    elapsed = time.perf_counter() - start
    release.set()
    th.join(10)
    assert elapsed < 5, f"gc.collect() took {elapsed:.1f} s while the lock was held: a finalizer waited"
    # What the finalizers queued is handled at the next operation: the streams are
    # destroyed only after the frees that name them, and every byte comes back.
    np.testing.assert_array_equal(api.full((2,), 4.0).to_host().sync(), [4, 4])
    del x, z
    settle()
    assert dev.memory_in_use() == tracked_before
    if not ON_CUDA:
        assert dev.mem_info()[0] == free_before


async def test_cancelled_read_backs_on_new_streams_do_not_deadlock(dev: trio_cuda.Device) -> None:
    # Formerly: a cancelled to_host()'s finalizer took the lock in whatever thread the
    # cyclic collector ran, while the simulated backend started a stream thread under it.
    await sleep(counter(), 1000)
    x = await api.full((256,), 3.0)
    with trio.fail_after(60):
        for i in range(300):
            policy = trio_cuda.SingleStream(dev)
            with trio.move_on_after(0 if i % 3 == 0 else 1e-4):
                await x.to_host().schedule(policy)
            if i % 50 == 0:
                gc.collect()
    np.testing.assert_array_equal(await x.to_host(), np.full(256, 3.0, np.float32))


def test_streams_created_and_dropped_from_many_threads(dev: trio_cuda.Device) -> None:
    before = dev.statistics().streams_destroyed
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(20):
                policy = trio_cuda.StreamPoolRoundRobin(dev, 2)
                out = api.full((4,), float(i)).to_host().schedule(policy).sync()
                assert (out == i).all()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    gc.collect()
    dev.synchronize()  # destroys the streams nothing references any more
    assert dev.statistics().streams_destroyed - before >= 4 * 20 * 2 - 8
