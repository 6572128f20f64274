"""The reset contract: every waiter of the old generation gets DeviceReset; nothing hangs,
no stale data, tensors from before refuse use; resets from other threads are safe.

Each test resets the device on purpose, so on CUDA they run in a child process (see
conftest: ``faults_device``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, sleep

from ..helpers.devices import Resetter, counter, needs_devices, run_with_deadline, started

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


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial.py, test_adversarial4.py)
# ======================================================================================
@contextlib.contextmanager
def single_stream(*devs: trio_cuda.Device) -> Iterator[None]:
    """Each device's default policy is one stream for the block (restored afterwards)."""
    old = [d.policy for d in devs]
    for d in devs:
        d.policy = trio_cuda.SingleStream(d)
    try:
        yield
    finally:
        for d, p in zip(devs, old, strict=True):
            d.policy = p


# -- resets ----------------------------------------------------------------------------
@pytest.mark.faults_device
async def test_a_shared_op_submitted_before_a_reset_does_not_hang_after_it(dev: trio_cuda.Device) -> None:
    # repro_reset_shared_op_hang: a shared op enqueued (not awaited) before a reset and
    # awaited after it made the new submission's stream wait for an old-generation event
    # that never completes: the await hung, and so did later work on that stream.
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)
    s = sleep(c.partition((1,)), 2_000_000_000).map(lambda _: "done").shared()
    await lowlevel.submit(s)  # enqueued on a policy stream, not awaited
    await trio.to_thread.run_sync(dev.reset)
    outcome: object = None
    with trio.move_on_after(5) as timer:
        try:
            outcome = await s
        except trio_cuda.DeviceError as err:
            outcome = err
    assert not timer.cancelled_caught, "awaiting the shared op after the reset hung"
    assert outcome == "done" or isinstance(outcome, trio_cuda.DeviceReset), outcome
    # Later, unrelated ops on every stream of the default policy complete.
    for i in range(2 * len(dev.policy.streams)):
        with trio.fail_after(2):
            np.testing.assert_array_equal(await api.full((2,), float(i)).to_host(), [i, i])


@pytest.mark.faults_device
async def test_a_shared_read_back_interrupted_by_a_reset_never_returns_uncopied_memory(dev: trio_cuda.Device) -> None:
    # repro_reset_shared_readback_garbage: the device is reset after a shared read-back's
    # copy into staging memory completed, before the data was copied out. The first
    # consumer got DeviceReset; the next got the output array without any copy
    # (uninitialized memory, returned as if it were the data).
    with single_stream(dev):
        t = await api.full((4096,), 5.0)
        s = t.to_host().shared()
        sub = await lowlevel.submit(s)
        assert sub.event is not None
        with trio.fail_after(5):
            while not sub.event.query():
                await trio.sleep(0.005)  # observing: the copy into staging memory is done
        await trio.to_thread.run_sync(dev.reset)
        with pytest.raises(trio_cuda.DeviceReset, match="copied out"):
            await sub.wait()
        # Every other consumer of the shared op sees the same outcome, never stale data.
        with pytest.raises(trio_cuda.DeviceReset):
            got = await s
            pytest.fail(f"a consumer got data that was never copied out: {got[:4]}")


@pytest.mark.faults_device
@needs_devices(2)
async def test_a_write_after_another_devices_reset_does_not_wait_for_its_lost_reader(dev: trio_cuda.Device) -> None:
    # repro_reset_other_device_hangs_writer: a device-0 tensor t is read by a copy to
    # device 1 still queued when device 1 is reset. A later write of t on device 0 waited
    # for that reader's old-generation event, which never completes: it hung.
    d1 = trio_cuda.device(1)
    with single_stream(d1):
        with trio_cuda.use_device(1):
            c1 = await api.zeros((1,), np.int32)
            await sleep(c1.partition((1,)), 1000)
            await lowlevel.submit(sleep(c1.partition((1,)), 2_000_000_000))  # device 1's stream is busy
        t = await api.full((4,), 1.0)  # device 0
        copy = await lowlevel.submit(api.dup(t, device=1))  # queued behind the sleep
        _, readers = lowlevel.accesses(t)
        assert any(r.device is d1 for r in readers)  # the pending reader on device 1
        await trio.to_thread.run_sync(d1.reset)
        with trio.move_on_after(5) as timer:
            await api.memcpy(t, np.full(4, 2.0, np.float32))  # a write of t on device 0
            out = await t.to_host()
        assert not timer.cancelled_caught, "a device-0 write hung after device 1 was reset"
        np.testing.assert_array_equal(out, [2, 2, 2, 2])
        with trio.fail_after(5), pytest.raises(trio_cuda.DeviceError, match="reset"):
            await copy.wait()  # the copy's work is gone with the reset


@pytest.mark.faults_device
@needs_devices(2)
async def test_a_read_back_after_another_devices_reset_returns_its_data(dev: trio_cuda.Device) -> None:
    # repro_reset_stale_waited_wrong_data: device-0 streams remember how far they waited
    # for each device-1 stream; a reset of device 1 restarts that stream's points at 0,
    # so a later wait for it was skipped as done and the read-back returned staging
    # memory device 1 had not written yet.
    d1 = trio_cuda.device(1)
    with single_stream(dev, d1):
        with trio_cuda.use_device(1):
            c1 = await api.zeros((1,), np.int32)
            await sleep(c1.partition((1,)), 1000)
        a = await api.full((1024,), 5.0)  # device 0
        for _ in range(20):  # device 0's stream waits for device 1's stream, up to a high point
            b = await api.dup(a, device=1)
            np.testing.assert_array_equal(await b.to_host(), np.full(1024, 5.0, np.float32))
        await trio.to_thread.run_sync(d1.reset)
        with trio_cuda.use_device(1):
            c1 = await api.zeros((1,), np.int32)
            await lowlevel.submit(sleep(c1.partition((1,)), 500_000_000))  # device 1 busy for 0.5 s
        b = await api.dup(a, device=1)  # queued behind the sleep on device 1
        with trio.fail_after(10):
            out = await b.to_host()
    np.testing.assert_array_equal(out, np.full(1024, 5.0, np.float32), err_msg="read data device 1 had not written yet")


@pytest.mark.faults_device
async def test_streams_dropped_with_pending_work_during_a_reset_in_another_thread(dev: trio_cuda.Device) -> None:
    # Some dropped and housekept (lingering) before the reset, some dropped while it runs:
    # afterwards nothing of the old work reads done and the device works.
    for _ in range(3):
        gc.collect()
        await api.zeros((1,))
    c = await counter()
    await sleep(c, 1000)
    early = [dev.create_stream() for _ in range(6)]
    late = [dev.create_stream() for _ in range(6)]
    evs = []
    for s in early + late:
        evs.append((await lowlevel.submit(sleep(c, SLOW_NS), s)).event)
    before = dev.statistics()
    del early, s
    gc.collect()
    await api.zeros((1,))  # the early ones linger now: gone, their driver streams not yet
    now = dev.statistics()
    assert now.streams == before.streams - 6 and now.streams_destroyed == before.streams_destroyed
    started = threading.Event()

    def drop_late() -> None:
        started.wait()
        late.clear()
        gc.collect()

    t = threading.Thread(target=drop_late)
    t.start()

    def reset() -> None:
        started.set()
        dev.reset()

    await trio.to_thread.run_sync(reset)
    t.join()
    for ev in evs:
        with pytest.raises(trio_cuda.DeviceReset):
            dev.poll(ev)
    del c, evs, ev
    for _ in range(3):
        gc.collect()
        await api.zeros((1,))
    assert not dev._resetting
    # (the reset dropped the lingering streams with their work: nothing of them is left to destroy)
    assert dev.statistics().streams_destroyed == now.streams_destroyed
    x = await api.ones((4,))
    np.testing.assert_array_equal(await x.to_host(), np.ones(4, np.float32))
