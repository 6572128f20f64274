"""Lifetimes: memory, streams and staging buffers live exactly as long as work needs them."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import ON_CUDA, counter, settle, started
from ..helpers.faults import child, child_ok

SLOW_NS = 500_000_000


@pytest.mark.sim_only
async def test_untracked_views_keep_memory_alive_for_work_in_flight(dev: trio_cuda.Device) -> None:
    # mem_info() on the simulated device shows what the device really holds.
    await trio.to_thread.run_sync(settle)
    free_before, _ = dev.mem_info()
    c = await counter()
    view = c.tensor.untracked()
    with trio.move_on_after(0.05) as scope:
        await sleep(view.partition((1,)), SLOW_NS)  # the kernel writes through the untracked view
    assert scope.cancelled_caught
    del c, view
    gc.collect()
    await api.zeros((1,))  # a submission: deferred frees are enqueued here
    free_during, _ = dev.mem_info()
    assert free_during < free_before, "the memory was released while the kernel still ran"
    await trio.to_thread.run_sync(settle)  # waits for the kernel, then for the free
    assert dev.mem_info()[0] == free_before


async def test_a_dropped_stream_is_destroyed_after_its_work_and_new_streams_do_not_wait_for_it(
    dev: trio_cuda.Device,
) -> None:
    # Measured on an H200: destroying a driver stream while a long kernel is queued on it
    # made the next stream created wait for that kernel. The driver stream is now kept
    # until its work is done (the Stream object is gone at once).
    x = await api.zeros((8,))
    await ops.add(x, 1.0, out=x)  # loaded now: on CUDA, loading a module waits for running kernels
    c = await counter()
    s1 = dev.create_stream()
    pending = await lowlevel.submit(sleep(c, 1_000_000_000), s1)  # about 1 s of device time
    ev = pending.event
    assert ev is not None
    ref = weakref.ref(s1)
    del pending, s1, c  # the counter's buffer names its last writer, s1
    gc.collect()
    before = dev.statistics().streams_destroyed
    await ops.add(x, 0.0, out=x)  # a submission does the housekeeping
    assert ref() is None
    assert dev.statistics().streams_destroyed == before, "destroyed while its work still runs"
    s2 = dev.create_stream()
    with trio.fail_after(0.5):  # well before the sleep ends
        await (await lowlevel.submit(ops.add(x, 1.0, out=x), s2)).wait()
    assert not ev.query(), "test setup: the sleep should still run"
    await trio.to_thread.run_sync(dev.synchronize)  # waits for the sleep, then destroys
    assert dev.statistics().streams_destroyed >= before + 1
    np.testing.assert_array_equal(await x.to_host(), np.full(8, 2.0, np.float32))


async def test_streams_of_dropped_policies_are_destroyed(dev: trio_cuda.Device) -> None:
    await trio.to_thread.run_sync(settle)
    threads_before = threading.active_count()
    destroyed_before = dev.statistics().streams_destroyed
    for i in range(100):
        policy = trio_cuda.StreamPoolRoundRobin(dev, 4)
        await api.full((4,), float(i)).schedule(policy)
    del policy
    gc.collect()
    await trio.to_thread.run_sync(settle)
    assert dev.statistics().streams_destroyed - destroyed_before >= 400
    if not ON_CUDA:
        # A simulated stream is a thread: destroyed streams' threads have exited.
        for _ in range(100):
            if threading.active_count() <= threads_before:
                break
            await trio.sleep(0.01)
        assert threading.active_count() <= threads_before


async def test_pinned_staging_stays_bounded_after_large_read_backs(dev: trio_cuda.Device) -> None:
    mb = 1 << 20
    x = await api.full((30 * mb // 4,), 1.0)
    before = dev.statistics()

    async def read_back() -> None:
        out = await x.to_host()
        assert out[0] == 1.0 and out[-1] == 1.0

    async with trio.open_nursery() as n:  # 240 MiB read back at once: 8 buffers lent
        for _ in range(8):
            n.start_soon(read_back)
    await trio.to_thread.run_sync(settle)
    await api.ones((1,)).to_host()  # returned buffers are taken back at the next copy
    stats = dev.statistics()
    # 8 buffers of 32 MiB were lent at once (pinned now, or found idle in the pool); back
    # in the pool, all but what fits under the cap were unpinned.
    assert stats.staging_unpins - before.staging_unpins >= 4
    assert stats.staging_bytes <= 64 * mb  # the documented cap (TRIO_CUDA_STAGING_CAP_MB)


async def test_a_dropped_stream_keeps_the_staging_of_its_pending_copies(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read-back cancelled on a stream that is then dropped: its copy still runs later,
    # so its pinned buffer must not be lent to another copy meanwhile.
    from trio_cuda import _staging

    lent: dict[int, weakref.ref[_staging.Staging]] = {}
    real_take = _staging.StagingPool.take

    def checked_take(self: _staging.StagingPool, nbytes: int, host_hold: bool) -> _staging.Staging | None:
        st = real_take(self, nbytes, host_hold)
        if st is not None:
            key = st.buf.ctypes.data
            prev = lent.get(key)
            p = prev() if prev is not None else None
            assert p is None or not p._once, "a pinned buffer was lent to two copies at once"
            lent[key] = weakref.ref(st)
        return st

    monkeypatch.setattr(_staging.StagingPool, "take", checked_take)
    await sleep(counter(), 1000)
    x = await api.full((1000,), 3.0)
    for _ in range(3):
        policy = trio_cuda.SingleStream(dev)
        with trio.move_on_after(0.02):
            await sleep(counter(), 200_000_000).then(lambda _: x.to_host()).schedule(policy)
        del policy
        gc.collect()
        for _ in range(20):
            np.testing.assert_array_equal(await x.to_host(), np.full(1000, 3.0, np.float32))
    await trio.to_thread.run_sync(settle)


async def test_memory_returns_to_baseline_after_cancelled_work(dev: trio_cuda.Device) -> None:
    await trio.to_thread.run_sync(settle)
    baseline = dev.memory_in_use()
    async with trio.open_nursery() as n:
        for _ in range(4):
            await n.start(started, sleep(counter(), SLOW_NS).then(lambda _: api.zeros((1 << 16,)).to_host()))
        n.cancel_scope.cancel()
    gc.collect()
    await trio.to_thread.run_sync(settle)
    assert dev.memory_in_use() == baseline


def test_idle_staging_beyond_the_cap_is_released_when_the_copies_complete() -> None:
    # Read-backs (and an upload) of growing sizes under a 1 MiB cap: once each await
    # returns, the pool holds at most the cap, with no further submission to take the
    # buffers back. A child process: the cap is read when the device's pool is made.
    r = child(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api
        dev = trio_cuda.device(0)
        cap = 1 << 20

        def held():
            return dev.statistics().staging_bytes

        async def main():
            for kib in (256, 512, 1024, 2048):
                x = await api.full((kib << 8,), 2.0)
                out = await x.to_host()
                assert out[0] == 2.0 and out[-1] == 2.0
                assert held() <= cap, (kib, held())
            t = await api.from_host(np.ones(1 << 20, np.float32))  # 4 MiB up
            assert held() <= cap, held()
            # The driver calls that unpin run in the janitor thread (they may wait for
            # the device, so never on the trio thread nor under the runtime lock): that
            # part is asynchronous, and the statistic says when it is over.
            with trio.fail_after(30):
                while dev.statistics().staging_unpinning:
                    await trio.sleep(0.01)
            assert (await t.to_host() == 1).all()

        trio.run(main)
        big = api.full((1 << 20,), 3.0).sync()
        assert (big.to_host().sync() == 3).all()  # 4 MiB back, through sync()
        assert held() <= cap, held()
        print("OK")
        """,
        TRIO_CUDA_STAGING_CAP_MB="1",
    )
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-4000:]


def test_buffers_pinned_for_a_read_back_cancelled_while_they_were_made_are_trimmed_to_the_cap() -> None:
    # A read-back is cancelled while its pinned buffer is being made (the pinning held at
    # a gate in its worker thread): the buffer arrives after the submission gave up, and
    # nothing will take it; the pool still ends within its cap, with no later submission.
    r = child(
        """
        import threading
        import trio, trio_cuda
        from trio_cuda import api
        from trio_cuda._backends import backend
        dev = trio_cuda.device(0)
        cap = 1 << 20
        driver_type = type(backend().driver(0))
        real_alloc = driver_type.host_alloc
        pinning, gate = threading.Event(), threading.Event()

        def gated(self, size):
            pinning.set()
            gate.wait(30)
            return real_alloc(self, size)

        driver_type.host_alloc = gated

        async def main():
            x = await api.full((1 << 20,), 2.0)  # 4 MiB: four times the cap
            pins = dev.statistics().staging_pins

            async def read_back():
                await x.to_host()

            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_back)
                    await trio.to_thread.run_sync(pinning.wait, 30)
                    scope.cancel()
            assert scope.cancelled_caught
            gate.set()  # the abandoned worker thread finishes pinning now
            with trio.fail_after(30):  # its pins land asynchronously, then the janitor's unpins
                while dev.statistics().staging_pins == pins or dev.statistics().staging_unpinning:
                    await trio.sleep(0.01)
            assert dev.statistics().staging_bytes <= cap, dev.statistics().staging_bytes
            assert (await x.to_host() == 2).all()
            assert dev.statistics().staging_bytes <= cap, dev.statistics().staging_bytes

        trio.run(main)
        print("OK")
        """,
        TRIO_CUDA_STAGING_CAP_MB="1",
    )
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-4000:]


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial.py, test_adversarial2.py)
# ======================================================================================
# -- lifetimes -------------------------------------------------------------------------
async def test_streams_of_dropped_policies_waited_on_by_other_streams_are_destroyed(dev: trio_cuda.Device) -> None:
    # repro_dropped_policy_stream_leak: a default-policy stream that waited for a policy's
    # stream kept it alive (as a key of its waits), so it was never destroyed.
    await api.zeros((1,))  # the default policy is set up
    await trio.to_thread.run_sync(settle)
    destroyed_before = dev.statistics().streams_destroyed
    rounds = 5
    refs = []
    for _ in range(rounds):
        policy = trio_cuda.SingleStream(dev)
        c = await api.zeros((1,), np.int32).schedule(policy)
        await lowlevel.submit(sleep(c.partition((1,)), 50_000_000), policy.streams[0])  # not awaited
        # Read on the default policy: its stream waits for the policy's stream.
        np.testing.assert_array_equal(await c.to_host(), [1])
        refs.append(weakref.ref(policy.streams[0]))
        del policy, c
    gc.collect()
    await trio.to_thread.run_sync(settle)
    await api.zeros((1,))  # any submission does the housekeeping
    await trio.to_thread.run_sync(settle)
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {rounds} streams of dropped policies are still referenced"
    assert dev.statistics().streams_destroyed - destroyed_before >= rounds


SEC = 1_000_000_000


# -- streams ----------------------------------------------------------------------------
def test_dropped_stream_is_not_brought_back_by_weak_references(dev: trio_cuda.Device) -> None:
    # repro_event_stream_resurrected_destroyed: Stream.__del__ keeps the object until the
    # device destroys its driver stream, and weak references still reached it: the next
    # submission destroyed it and then enqueued on a None handle (an AttributeError on the
    # simulated device, the legacy default stream on CUDA).
    s = dev.create_stream()
    ev = lowlevel.record(s)
    ref = weakref.ref(s)
    del s
    assert ev.stream is None
    again = ref()
    if again is not None:  # CPython clears weak references only after the finalizer
        for use in (
            lambda: api.full((8,), 2.0).sync_on(again),
            lambda: lowlevel.record(again),
            again.synchronize,
        ):
            with pytest.raises(ValueError, match="dropped"):
                use()
        del again
    # The device is fine: the driver stream went away, other streams work.
    np.testing.assert_array_equal(api.full((4,), 3.0).to_host().sync(), [3.0] * 4)


def test_synchronize_waits_for_work_of_destroyed_streams(dev: trio_cuda.Device) -> None:
    # repro_oom_ignores_dropped_stream_free: once housekeeping destroyed a dropped
    # stream, its pending work was waited for by nobody: Device.synchronize() returned
    # at once (and an out-of-memory retry did not wait for the free behind it).
    c = api.zeros((1,), np.int32).sync()
    sleep.prepare(c.partition((1,)), 1)

    async def submit_on_dropped_stream() -> lowlevel.Submitted:
        p = trio_cuda.SingleStream(dev)
        return await lowlevel.submit(sleep(c.partition((1,)), SEC // 2), p.streams[0])

    sub = trio.run(submit_on_dropped_stream)
    gc.collect()
    api.zeros((1,)).sync()  # housekeeping destroys the dropped stream (its work pending)
    assert sub.event is not None
    dev.synchronize()
    assert sub.event.query()  # done: synchronize() waited for it


@pytest.mark.sim_only
def test_out_of_memory_retry_waits_for_free_on_destroyed_stream() -> None:
    r = child(
        """
        import gc, numpy as np, trio, trio_cuda
        from trio_cuda import api, lowlevel
        from trio_cuda.kernels import sleep
        dev = trio_cuda.device(0)
        async def main():
            c = await api.zeros((1,), np.int32)
            p = lowlevel.SingleStream(dev)
            h = await api.zeros((13 << 18,), np.int32).schedule(p)     # 13 of 16 MiB
            await lowlevel.submit(sleep(c.partition((1,)), 500_000_000), p.streams[0])
            await lowlevel.submit(api.memcpy(h, h), p.streams[0])     # h in use behind it
            del h, p
            gc.collect()
            y = await api.zeros((1 << 20,), np.int32)                 # 4 MiB: fits after the free
            assert y.shape == (1 << 20,)
            print("OK")
        trio.run(main)
        """,
        TRIO_CUDA_SIM_MEMORY=str(16 << 20),
    )
    child_ok(r)


# -- lifetimes and nesting -----------------------------------------------------------------
async def test_failed_shared_read_back_keeps_no_consumer_frames(dev: trio_cuda.Device) -> None:
    # repro_failed_pending_keeps_frames: the stored failure was the exception that
    # reached the first consumer, with its traceback: that task's locals stayed alive.
    def boom(a: object) -> object:
        raise ValueError("bad value in the read-back")

    x = await api.full((4,), 1.0)
    sh = x.to_host().map(boom).shared()
    refs: list[weakref.ref[object]] = []

    async def consumer() -> None:
        big = await api.zeros((1 << 20,))
        refs.append(weakref.ref(big._buffer))
        with pytest.raises(ValueError, match="bad value"):
            await sh

    await consumer()
    for _ in range(2):
        with pytest.raises(ValueError, match="bad value"):
            await sh
    gc.collect()
    assert refs[0]() is None


def test_map_over_a_read_back_refuses_nested_execution() -> None:
    # repro_map_over_readback_nested_execution: the callback of a map over to_host() ran
    # after the wait, where executing ops was not refused.
    x = api.full((4,), 1.0).sync()

    def callback(_: object) -> object:
        return api.full((4,), 9.0).sync()

    for op in (trio_cuda.value(x).map(callback), x.to_host().map(callback)):
        with pytest.raises(trio_cuda.NestedExecutionError):
            op.sync()
    # A callback that executes nothing still works.
    np.testing.assert_array_equal(x.to_host().map(lambda a: a * 2).sync(), [2.0] * 4)
