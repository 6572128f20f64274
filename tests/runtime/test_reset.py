"""The reset contract: every waiter of the old generation gets DeviceReset; nothing hangs,
no stale data, tensors from before refuse use; resets from other threads are safe.

Each test resets the device on purpose, so on CUDA they run in a child process (see
conftest: ``faults_device``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda.kernels import add, sleep

from .conftest import Resetter, counter, run_with_deadline, started

pytestmark = pytest.mark.faults_device

SLOW_NS = 2_000_000_000


async def _warm(dev: trio_cuda.Device) -> None:
    # Kernels loaded, staging pinned: the submissions below enqueue at once.
    await sleep(counter(), 1000)
    await api.ones((4,)).to_host()


async def test_a_task_awaiting_work_gets_device_reset_instead_of_hanging(dev: trio_cuda.Device) -> None:
    await _warm(dev)
    outcome: list[BaseException] = []

    async def waiter(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await started(sleep(counter(), SLOW_NS).first().to_host(), task_status=task_status)
        except trio_cuda.DeviceReset as err:
            outcome.append(err)

    async with trio.open_nursery() as n:
        with trio.fail_after(SLOW_NS / 2e9):  # long before the kernel could end
            async with trio.open_nursery() as waiters:
                await waiters.start(waiter)  # submitted; the reset comes right after
                # The reset itself may take as long as the device's running work (CUDA
                # tears the context down); the waiter must not wait for it.
                n.start_soon(trio.to_thread.run_sync, dev.reset)
    assert len(outcome) == 1 and outcome[0].device == dev.ordinal
    assert "reset" in str(outcome[0])
    # The device works afterwards.
    np.testing.assert_array_equal(await api.full((3,), 2.0).to_host(), [2, 2, 2])


async def test_parked_and_polling_waiters_all_get_device_reset(dev: trio_cuda.Device) -> None:
    await _warm(dev)
    results: list[str] = []

    async def waiter(ns: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await started(sleep(counter(), ns), task_status=task_status)
            results.append("completed")
        except trio_cuda.DeviceReset:
            results.append("reset")

    async with trio.open_nursery() as n:
        with trio.fail_after(SLOW_NS / 2e9):
            async with trio.open_nursery() as waiters:
                for _ in range(6):
                    await waiters.start(waiter, SLOW_NS)
                while trio_cuda.lowlevel.notifier_statistics().parked < 6:
                    await trio.sleep(0.001)  # wait for the waits to park (observing, not ordering)
                n.start_soon(trio.to_thread.run_sync, dev.reset)
    assert results == ["reset"] * 6


def test_sync_read_back_in_another_thread_gets_device_reset_not_stale_data(dev: trio_cuda.Device) -> None:
    sleep(counter(), 1000).sync()
    api.ones((4,)).to_host().sync()
    outcome: list[object] = []
    submitted = threading.Event()

    x = api.full((1024,), 7.0).sync()

    def signal_then_read(_: object) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        # Runs while the submission is planned, under the runtime lock, which the reset
        # needs too: the reset below comes after the submission has enqueued.
        submitted.set()
        return x.to_host()

    def reader() -> None:
        try:
            outcome.append(sleep(counter(), SLOW_NS).then(signal_then_read).sync())
        except trio_cuda.DeviceReset as err:
            outcome.append(err)

    th = threading.Thread(target=reader)
    th.start()
    assert submitted.wait(10)
    dev.reset()
    th.join(SLOW_NS / 2e9)
    assert not th.is_alive(), "the sync() waiter hung after the reset"
    assert len(outcome) == 1 and isinstance(outcome[0], trio_cuda.DeviceReset), outcome


async def test_tensors_graphs_and_events_from_before_refuse_use(dev: trio_cuda.Device) -> None:
    x = await api.arange(8)
    z = await api.zeros((8,))
    g = add(z.partition((4,)), x, x).graph()
    ev = trio_cuda.lowlevel.record(dev.policy.streams[0])
    await trio.to_thread.run_sync(dev.reset)
    with pytest.raises(ValueError, match="reset"):
        await x.to_host()
    with pytest.raises(ValueError, match="reset"):
        await add(z.partition((4,)), x, x)
    with pytest.raises(ValueError, match="reset"):
        g.launch()
    with pytest.raises(trio_cuda.DeviceReset):
        ev.query()
    assert dev.statistics().generation >= 1
    np.testing.assert_array_equal(await api.arange(4).to_host(), np.arange(4, dtype=np.float32))


def test_resets_from_another_thread_while_trio_tasks_submit(dev: trio_cuda.Device) -> None:
    # Submissions race with resets: each task either completes with its own data or
    # gets a DeviceError (reset, unavailable, stale tensor); nothing hangs or crashes.
    resetter = Resetter(dev)

    async def main() -> tuple[int, int]:
        ok = failed = 0

        async def task(i: int) -> None:
            nonlocal ok, failed
            for j in range(30):
                v = float(i * 100 + j)
                while True:
                    try:
                        out = (
                            await api.full((16,), v)
                            .then(lambda t: add(api.empty((16,)).partition((16,)), t, t))
                            .first()
                            .to_host()
                        )
                    except trio_cuda.DeviceUnavailable:
                        await trio.sleep(0.005)  # a reset is under way: poll until it is over
                        continue
                    except (trio_cuda.DeviceError, ValueError):
                        failed += 1
                        out = None
                    break
                if out is None:
                    continue
                np.testing.assert_array_equal(out, np.full(16, 2 * v, np.float32))
                ok += 1
                resetter.progress.set()

        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(task, i)
        return ok, failed

    with resetter:
        ok, failed = run_with_deadline(main)
    assert resetter.resets > 0 and ok + failed == 240
    assert ok > 0, "no submission got through between the resets"
    # Afterwards the device is healthy.
    np.testing.assert_array_equal(api.full((2,), 5.0).to_host().sync(), [5, 5])


def test_reset_while_another_thread_syncs_in_a_loop(dev: trio_cuda.Device) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []
    good = 0

    def worker(i: int) -> None:
        nonlocal good
        while not stop.is_set():
            try:
                out = api.full((8,), float(i)).to_host().sync()
            except (trio_cuda.DeviceError, ValueError):
                continue
            except BaseException as err:
                errors.append(err)
                return
            if not (out == i).all():
                errors.append(AssertionError(f"thread {i} read {out}"))
                return
            good += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            dev.reset()
            time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a sync() hung across resets"
    assert not errors, errors
    assert good > 0
