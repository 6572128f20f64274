"""Regression tests for the second adversarial review (one test per reproduction).

The promises they check: a cancelled submission another one relies on still completes;
a dropped stream never comes back half-destroyed; failed work marks what it would have
written; stored failures keep no frames; every callback refuses nested execution; work
on destroyed streams is still waited for; a reset of a copy's source is a DeviceReset;
reset errors name their op; captured shared ops are not "done"; the staging cap holds;
a submission's own memory never makes it fail; captures never query their own events.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, sleep

from .conftest import needs_devices
from .test_adversarial import child, ready_to_fault, scribble

SEC = 1_000_000_000


def _ok(r: object) -> None:
    out = getattr(r, "stdout", "") + getattr(r, "stderr", "")
    assert getattr(r, "returncode", 1) == 0, out[-4000:]
    assert "OK" in getattr(r, "stdout", ""), out[-4000:]


# -- cancellation ---------------------------------------------------------------------
@pytest.mark.sim_only
def test_cancelled_submission_completes_for_one_that_relies_on_it() -> None:
    # repro_cancel_dependents_race: the cancel path read plan.dependents without the lock;
    # a submission starting to rely on the cancelled one meanwhile (planning in another
    # thread) failed with a placeholder DeviceError("cancelled"), as did every later
    # consumer of the shared op. Whatever the interleaving, both must get the tensor.
    r = child(
        """
        import threading, time, numpy as np, trio, trio_cuda
        from trio_cuda import api, lowlevel
        from trio_cuda.kernels import sleep
        async def main():
            s = trio_cuda.device(0).create_stream()                   # not the shared op's stream
            c = await api.zeros((1,), np.int32)
            h = await api.zeros((13 << 18,), np.int32)               # 13 of 16 MiB
            await lowlevel.submit(sleep(c.partition((1,)), 1_000_000_000), s)
            await lowlevel.submit(api.memcpy(h, h), s)                # h in use behind the sleep
            del h
            sh = api.full((1 << 20,), 5, np.int32).shared()          # waits for memory
            planning = threading.Event()
            out = {}
            def relying():
                def callback(_):
                    planning.set()
                    time.sleep(0.3)                                   # plans, holding the lock
                    return 0
                t = trio_cuda.zip(trio_cuda.value(0).then(callback), sh).sync()[1]
                out["relying"] = t.to_host().sync()[:2].tolist()
            th = threading.Thread(target=relying)
            async with trio.open_nursery() as n:
                async def cancelled(task_status=trio.TASK_STATUS_IGNORED):
                    with trio.CancelScope() as cs:
                        task_status.started(cs)
                        await sh
                cs = await n.start(cancelled)
                th.start()
                await trio.to_thread.run_sync(planning.wait)
                cs.cancel()
            await trio.to_thread.run_sync(th.join)
            assert out["relying"] == [5, 5], out
            assert (await (await sh).to_host())[:2].tolist() == [5, 5]
            print("OK")
        trio.run(main)
        """,
        TRIO_CUDA_SIM_MEMORY=str(16 << 20),
    )
    _ok(r)


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
    _ok(r)


# -- faults and resets ----------------------------------------------------------------------
@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_failed_peer_copy_marks_its_destination() -> None:
    # repro_failed_peer_copy_dst_not_poisoned: a device-1 -> device-0 copy that failed
    # because device 1 faulted before it ran left its destination unmarked: reads
    # returned the old contents without an error.
    d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
    c1s, z = await ready_to_fault(1)
    y = await api.full((8,), 1.0)
    x1 = await api.full((8,), 2.0, device=1)
    c = await api.zeros((1,), np.int32)
    s = d0.create_stream()
    await lowlevel.submit(sleep(c.partition((1,)), 300_000_000), s)
    copy = await lowlevel.submit(api.memcpy(y, x1), s)  # runs after the sleep
    await lowlevel.submit(scribble(z.partition((32,))), d1.create_stream())  # device 1 faults
    with pytest.raises(trio_cuda.DeviceFault):
        await copy.wait()
    assert d1.is_faulted and not d0.is_faulted
    for _ in range(2):
        with pytest.raises(trio_cuda.DeviceFault, match="did not write"):
            await y.to_host()
    await api.memcpy(y, np.full(8, 4.0, np.float32))  # rewritten: readable again
    np.testing.assert_array_equal(await y.to_host(), [4.0] * 8)
    del c1s


@needs_devices(2)
async def test_reset_waits_for_copies_on_other_devices_that_read_its_memory() -> None:
    # Code review: a reset released the device's memory while a copy queued on another
    # device still had to read it (on CUDA an illegal address on that other device,
    # sticky for the process). The reset now waits for such copies first.
    d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
    y = await api.full((8,), 1.0)
    x1 = await api.full((8,), 2.0, device=1)
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)
    s = d0.create_stream()
    await lowlevel.submit(sleep(c.partition((1,)), SEC // 4), s)
    copy = await lowlevel.submit(api.memcpy(y, x1), s)  # reads device 1 after the sleep
    await trio.to_thread.run_sync(d1.reset)
    assert copy.event is not None and copy.event.query()  # the reset waited for it
    await copy.wait()
    np.testing.assert_array_equal(await y.to_host(), [2.0] * 8)
    assert not d0.is_faulted and not d1.is_faulted


@pytest.mark.sim_only
def test_reset_of_a_copy_source_before_it_enqueues_is_a_device_reset() -> None:
    # repro_peer_copy_source_reset: the plan did not record the generation of a peer
    # copy's source device (it has no lane there): enqueued after that device's reset,
    # the copy read released memory and faulted device 0.
    r = child(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api, lowlevel
        from trio_cuda.kernels import sleep
        d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
        async def main():
            s = d0.create_stream()                                     # not the dup's stream
            x1 = await api.full((1 << 20,), 7, np.int32, device=1)
            c = await api.zeros((1,), np.int32)
            h = await api.zeros((13 << 18,), np.int32)                # 13 of 16 MiB of device 0
            await lowlevel.submit(sleep(c.partition((1,)), 300_000_000), s)
            await lowlevel.submit(api.memcpy(h, h), s)
            del h
            async with trio.open_nursery() as n:
                async def reset_when_waiting():
                    while lowlevel.submission_statistics().waited_for_memory == 0:
                        await trio.sleep(0.001)
                    await trio.to_thread.run_sync(d1.reset)
                n.start_soon(reset_when_waiting)
                try:
                    await api.dup(x1, device=0)                        # waits for memory
                    raise AssertionError("the copy of released memory completed")
                except trio_cuda.DeviceReset as err:
                    assert err.device == 1, err
            assert not d0.is_faulted
            np.testing.assert_array_equal(await api.full((2,), 1.0).to_host(), [1.0, 1.0])
            print("OK")
        trio.run(main)
        """,
        TRIO_CUDA_SIM_MEMORY=str(16 << 20),
    )
    _ok(r)


async def test_device_reset_raised_to_a_waiter_names_the_op(dev: trio_cuda.Device) -> None:
    # repro_reset_error_names_no_op: name_fault renamed DeviceFault only.
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)
    for form in ("alone", "zip"):
        op = sleep(c.partition((1,)), SEC // 2)
        sub = await lowlevel.submit(op if form == "alone" else trio_cuda.zip(op, api.zeros((1,))))
        await trio.to_thread.run_sync(dev.reset)
        with pytest.raises(trio_cuda.DeviceReset) as info:
            await sub.wait()
        assert info.value.op is not None and "sleep" in info.value.op, info.value
        c = await api.zeros((1,), np.int32)


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


# -- graphs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["graph()", "scope"])
def test_shared_op_captured_into_a_graph_is_not_done(form: str) -> None:
    # repro_shared_op_captured_is_done: the capture left the shared op Done at a point
    # inside the capture: a later consumer read data the kernel never wrote.
    x = api.full((8,), 1.0).sync()
    y = api.full((8,), 2.0).sync()
    z = api.zeros((8,)).sync()
    add.prepare(z.partition((8,)), x, y)
    sh = add(z.partition((8,)), x, y).shared()
    if form == "graph()":
        graph = sh.graph()
    else:
        with trio_cuda.capture_graph() as scope:
            scope.record(sh)
        assert scope.graph is not None
        graph = scope.graph
    with pytest.raises(trio_cuda.GraphCaptureError, match="captured into a graph"):
        sh.first().unpartition().to_host().sync()
    np.testing.assert_array_equal(z.to_host().sync(), [0.0] * 8)  # nothing ran
    graph.launch().sync()
    np.testing.assert_array_equal(z.to_host().sync(), [3.0] * 8)


async def test_capture_does_not_query_its_own_events(dev: trio_cuda.Device) -> None:
    # repro_cuda_capture_retire_corrupts_copy (CUDA): retiring a capturing stream queried
    # an event recorded inside the capture; the driver refused (and invalidated the
    # capture), the refusal was taken for "done", and the pinned buffer of a pending
    # copy went to another copy before its DMA ran.
    s = dev.create_stream()
    c = await api.zeros((1,), np.int64)
    n = 1 << 20
    t = await api.zeros((n,), np.float32)
    x = await api.full((16,), 1.0)
    z1, z2 = await api.zeros((16,)), await api.zeros((16,))
    await sleep(c.partition((1,)), 1000)
    await add(z1.partition((16,)), x, x)
    await api.from_host(np.zeros(n, np.float32))  # staging pinned
    await lowlevel.submit(sleep(c.partition((1,)), SEC // 2), s)
    await lowlevel.submit(api.memcpy(t, np.full(n, 1.0, np.float32)), s)  # pending behind it
    with trio_cuda.capture_graph(s) as scope:
        scope.record(trio_cuda.zip(add(z1.partition((16,)), x, x), add(z2.partition((16,)), x, x)))
        scope.record(add(z1.partition((16,)), x, x))
    assert scope.graph is not None
    other = dev.create_stream()
    await (await lowlevel.submit(api.from_host(np.full(n, 2.0, np.float32)), other)).wait()  # wants a pinned buffer
    await trio.to_thread.run_sync(dev.synchronize)
    r = await t.to_host()
    assert (r == 1.0).all(), r[:4]


# -- memory ----------------------------------------------------------------------------------------
@pytest.mark.sim_only
def test_staging_cap_zero_keeps_no_idle_pinned_memory() -> None:
    # repro_staging_cap_zero_keeps_prefill: the prefill and freshly pinned buffers went
    # into the pool without the cap.
    r = child(
        """
        import numpy as np, trio_cuda
        from trio_cuda import api
        from trio_cuda._staging import pool_of
        dev = trio_cuda.device(0)
        for n in (1000, 1 << 20, 8 << 20):
            x = api.from_host(np.ones(n, np.float32)).sync()
            assert (x.to_host().sync() == 1).all()
        for _ in range(2):
            dev.synchronize()
            api.from_host(np.ones(10, np.float32)).sync()      # takes returned buffers back
        assert pool_of(dev).idle_bytes == 0, pool_of(dev).idle_bytes
        print("OK")
        """,
        TRIO_CUDA_STAGING_CAP_MB="0",
    )
    _ok(r)


@pytest.mark.sim_only
def test_memory_freed_earlier_on_a_stream_serves_its_later_allocations() -> None:
    # repro_unallocate_then_spurious_oom: a copy that waited for memory and then for
    # pinned memory gave its allocation back behind newer work on its stream; the
    # simulated device kept that block reserved until the stream reached the free
    # (CUDA's stream-ordered allocator lets later work of the stream reuse it), and the
    # retry failed with DeviceOutOfMemory. Now the simulated device does what CUDA does.
    r = child(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api, lowlevel
        from trio_cuda.kernels import sleep
        dev = trio_cuda.device(0)
        async def main():
            dev.policy = lowlevel.SingleStream(dev)
            c = await api.zeros((1,), np.int32)
            h = await api.zeros((5 << 20,), np.int32)                   # 20 of 32 MiB
            await lowlevel.submit(sleep(c.partition((1,)), 400_000_000))
            await lowlevel.submit(api.memcpy(h, h))
            del h                                                       # freed behind the sleep
            y = await api.from_host(np.ones(4 << 20, np.float32))        # 16 MiB, same stream
            assert lowlevel.submission_statistics().waited_for_memory == 0
            assert (await y.to_host() == 1).all()
            h = await api.zeros((1 << 20,), np.int32)
            await lowlevel.submit(sleep(c.partition((1,)), 300_000_000))
            await lowlevel.submit(api.memcpy(h, h))
            del y, h
            z = await api.zeros((5 << 20,), np.int32).schedule(lowlevel.SingleStream(dev))
            assert lowlevel.submission_statistics().waited_for_memory == 1
            assert z.shape == (5 << 20,)
            print("OK")
        trio.run(main)
        """,
        TRIO_CUDA_SIM_MEMORY=str(32 << 20),
        TRIO_CUDA_STAGING_CAP_MB="0",
    )
    _ok(r)


async def test_two_read_backs_of_one_staging_size_in_one_submission_do_not_hang() -> None:
    """One idle staging buffer of a size, two slots of it in one submission: the plan
    gives the taken one back and asks for both; asking only about the missing one made
    it count the returned buffer twice and retry forever."""
    c = await api.ones((3000,))  # 12000 bytes: a 16 KiB staging bucket, not prefilled
    await c.to_host()  # one such buffer pinned, now idle
    with trio.fail_after(20):
        a, b = await trio_cuda.zip(c.to_host(), c.to_host())
    assert a.sum() == 3000 and b.sum() == 3000
