"""Device errors: launch errors, out of memory, asynchronous faults, reset."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, sleep

from numba import cuda

from ..helpers.devices import ON_CUDA, counter, needs_devices, settle, started
from ..helpers.faults import child, child_ok, ready_to_fault, scribble


def bad_op() -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
    return scribble(api.zeros((32,)).partition((32,)))


@pytest.mark.faults_device
async def test_fault_names_the_op_and_device_and_sticks_until_reset(dev: trio_cuda.Device) -> None:
    before = await api.arange(4)
    with pytest.raises(trio_cuda.DeviceFault) as info:
        await bad_op()
    err = info.value
    assert err.device == dev.ordinal
    assert err.op is not None and "scribble" in err.op
    assert "scribble" in str(err) and "device 0" in str(err)
    assert dev.is_faulted and dev.statistics().faulted
    submissions = dev.statistics().submissions
    with pytest.raises(trio_cuda.DeviceFault, match="reset"):
        await api.ones((2,))
    with pytest.raises(trio_cuda.DeviceFault, match="reset"):
        await trio.to_thread.run_sync(api.ones((2,)).sync)
    assert dev.statistics().submissions == submissions  # refused before any work
    if ON_CUDA:
        # Measured: the CUDA driver keeps an illegal-address error for the whole process.
        with pytest.raises(trio_cuda.DeviceFault, match="restart the process"):
            await trio.to_thread.run_sync(dev.reset)
        assert dev.is_faulted
        with pytest.raises(trio_cuda.DeviceFault, match="reset"):
            await api.ones((2,))
        return
    with pytest.raises(RuntimeError, match="would block the trio event loop"):
        dev.reset()
    await trio.to_thread.run_sync(dev.reset)
    assert not dev.is_faulted
    np.testing.assert_array_equal(await api.full((3,), 2.0).to_host(), [2, 2, 2])
    with pytest.raises(ValueError, match="before device 0 was reset"):
        await before.to_host()
    # Streams and policies keep working after the reset.
    await sleep(counter(), 1000).schedule(trio_cuda.SingleStream(dev))


@pytest.mark.faults_device
async def test_reset_of_a_healthy_device(dev: trio_cuda.Device) -> None:
    old = await api.arange(4)
    await trio.to_thread.run_sync(dev.reset)
    assert not dev.is_faulted
    with pytest.raises(ValueError, match="reset"):
        await old.to_host()
    np.testing.assert_array_equal(await api.arange(4).to_host(), np.arange(4, dtype=np.float32))


@pytest.mark.faults_device
async def test_fault_reaches_every_task_waiting_on_the_device(dev: trio_cuda.Device) -> None:
    outcomes: list[str] = []
    # Load both kernels and make the streams first: on CUDA, loading a kernel or making
    # a stream can wait for running work, which would hold the faulting launch back until
    # the sleeps were over.
    target = await api.zeros((32,))
    await trio.to_thread.run_sync(scribble.prepare, target.partition((32,)))
    await sleep(counter(), 1000)
    # Each waiter on a stream of its own, so that the faulting launch is not queued behind it.
    own = [trio_cuda.SingleStream(dev) for _ in range(3)]
    faulting = trio_cuda.SingleStream(dev)

    async def waiter(policy: trio_cuda.SingleStream, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await started(sleep(counter(), 3_000_000_000), policy, task_status=task_status)
            outcomes.append("completed")
        except trio_cuda.DeviceFault:
            outcomes.append("fault")

    start = time.perf_counter()
    async with trio.open_nursery() as n:
        for policy in own:
            await n.start(waiter, policy)
        with pytest.raises(trio_cuda.DeviceFault):
            await scribble(target.partition((32,))).schedule(faulting)
    assert outcomes == ["fault"] * 3
    assert time.perf_counter() - start < 2.0, "the waiters were not woken by the fault"


@pytest.mark.faults_device
async def test_nursery_propagates_a_fault_and_cancels_siblings(dev: trio_cuda.Device) -> None:
    sibling = "running"

    async def sibling_task(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal sibling
        task_status.started()
        try:
            await trio.sleep(30)
        except trio.Cancelled:
            sibling = "cancelled"
            raise

    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as n:
            await n.start(sibling_task)
            n.start_soon(_await, bad_op())
    assert info.value.subgroup(trio_cuda.DeviceFault) is not None
    assert sibling == "cancelled"


@pytest.mark.faults_device
@needs_devices(2)
async def test_other_devices_keep_working(dev: trio_cuda.Device) -> None:
    other = trio_cuda.device(1)
    with trio_cuda.use_device(other):
        await api.ones((2,))  # device 1 is set up before the fault
    with pytest.raises(trio_cuda.DeviceFault):
        await bad_op()
    assert dev.is_faulted
    with trio_cuda.use_device(other):
        if ON_CUDA:
            # Measured on two H200s (driver 580): an illegal address poisons every CUDA
            # context of the process, so the other device fails too, with a clear error.
            with pytest.raises(trio_cuda.DeviceFault) as info:
                await api.full((2,), 7.0).to_host()
            assert info.value.device == 1
            return
        assert not other.is_faulted
        np.testing.assert_array_equal(await api.full((2,), 7.0).to_host(), [7, 7])


async def test_out_of_memory_is_an_exception(dev: trio_cuda.Device) -> None:
    with pytest.raises(trio_cuda.DeviceOutOfMemory) as info:
        await api.empty((1 << 46,), np.uint8)  # 64 TiB
    assert info.value.device == dev.ordinal and "allocating" in str(info.value)
    assert not dev.is_faulted
    np.testing.assert_array_equal(await api.ones((2,)).to_host(), [1, 1])


async def test_launch_error_is_raised_at_submission(dev: trio_cuda.Device) -> None:
    from trio_cuda.kernels import add

    @trio_cuda.kernel(block=(2048,))
    def too_wide(z):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < z.shape[0]:
            z[i] = 1.0

    with pytest.raises(trio_cuda.LaunchError) as info:
        await too_wide(api.zeros((2048,)).partition((2048,)))
    assert info.value.device == dev.ordinal and "too_wide" in str(info.value)
    assert not dev.is_faulted
    # A tile of more than 1024 threads without block=: the launcher splits it into blocks.
    out = await add(api.zeros((3000,)).partition((2048,)), api.ones((3000,)), api.ones((3000,)))
    np.testing.assert_array_equal(await out[0].to_host(), np.full(3000, 2.0, np.float32))


async def test_writing_an_input_tensor_is_refused_before_it_runs(dev: trio_cuda.Device) -> None:
    @trio_cuda.kernel
    def writes_input(out, x):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        w = x  # through an alias too
        w[i] += 1.0
        out[i] = 2.0

    x = await api.zeros((4,))
    launches = dev.statistics().launches
    with pytest.raises(ValueError, match="read-only inputs"):
        await writes_input(api.zeros((4,)).partition((4,)), x)
    assert dev.statistics().launches == launches and not dev.is_faulted
    # The same kernel with a partition there is fine.
    out, xp = await writes_input(api.zeros((4,)).partition((4,)), x.partition((4,)))
    np.testing.assert_array_equal(await xp.to_host(), np.ones(4, np.float32))
    np.testing.assert_array_equal(await out.to_host(), np.full(4, 2.0, np.float32))


@pytest.mark.faults_device
@pytest.mark.sim_only
async def test_writing_an_input_tensor_in_a_device_function_is_caught_on_the_simulated_device() -> None:
    # A write behind a call is not seen before the launch: the read-only view faults.
    @cuda.jit(device=True)
    def put(a, i):  # type: ignore[no-untyped-def]
        a[i] = 1.0

    @trio_cuda.kernel
    def writes_input(out, x):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        put(x, i)
        out[i] = 2.0

    with pytest.raises(trio_cuda.DeviceFault, match="read-only input"):
        await writes_input(api.zeros((4,)).partition((4,)), api.zeros((4,)))


def test_device_errors_share_one_base() -> None:
    for cls in (trio_cuda.LaunchError, trio_cuda.DeviceOutOfMemory, trio_cuda.DeviceFault, trio_cuda.GraphCaptureError):
        assert issubclass(cls, trio_cuda.DeviceError)


async def _await(op: object) -> None:
    await op  # type: ignore[misc]


@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_a_fault_stays_on_its_device_and_fails_only_the_ops_waiting_for_it() -> None:
    d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
    t1 = await api.zeros((32,), device=1)
    with trio_cuda.use_device(1):
        await sleep(counter(), 1000)  # loaded
        bad = sleep(counter(), 100_000_000).then(lambda _: scribble(t1.partition((32,))))
        pending = await trio_cuda.lowlevel.submit(bad)
    # A copy to device 0 waits (on device 0's stream) for t1's pending writer on device 1.
    with pytest.raises(trio_cuda.DeviceFault, match="device 1") as info:
        await api.dup(t1, device=0).to_host()
    assert info.value.device == 0
    with pytest.raises(trio_cuda.DeviceFault):
        await pending.wait()
    assert d1.is_faulted and not d0.is_faulted
    # Device 0 keeps working, on every stream, including the one whose wait failed.
    for _ in range(len(d0.policy.streams)):
        np.testing.assert_array_equal(await api.full((3,), 2.0).to_host(), [2, 2, 2])
    await trio.to_thread.run_sync(d1.reset)
    with trio_cuda.use_device(1):
        np.testing.assert_array_equal(await api.full((3,), 5.0).to_host(), [5, 5, 5])


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial.py, test_adversarial2.py)
# ======================================================================================
MB = 1 << 20


# -- faults of another device ------------------------------------------------------------
@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_memory_of_an_op_failed_by_another_devices_fault_is_freed(dev: trio_cuda.Device) -> None:
    # repro_failed_wait_leaks_tensors: an op on device 0 that waited for faulted device-1
    # work fails with DeviceFault; afterwards device 0's memory in use must return to its
    # baseline. The simulated driver raised the same exception object on every query,
    # whose growing traceback kept the failed submission's tensors alive.
    d1 = trio_cuda.device(1)
    n = MB  # 4 MiB of int32
    c1s, z = await ready_to_fault(1)
    c1 = await api.zeros((n,), np.int32, device=1)
    await trio.to_thread.run_sync(settle)
    await api.zeros((1,))
    baseline = dev.memory_in_use()
    sa, sb = d1.create_stream(), d1.create_stream()
    write_c1 = sleep(c1s.partition((4,)), 300_000_000).then(lambda _: api.memcpy(c1, np.zeros(n, np.int32)))
    await lowlevel.submit(write_c1, sa)
    failures: list[type[BaseException]] = []
    try:
        async with trio.open_nursery() as nursery:
            # Allocates 4 MiB on device 0, then waits for c1's writer on device 1.
            await nursery.start(started, api.dup(c1, device=0))
            await lowlevel.submit(scribble(z.partition((32,))), sb)  # device 1 faults
    except BaseExceptionGroup as eg:
        failures = [type(e) for e in eg.exceptions]  # keep no exception (nor its frames)
    assert failures == [trio_cuda.DeviceFault]
    assert d1.is_faulted and not dev.is_faulted
    gc.collect()
    await api.zeros((1,))  # flushes deferred frees
    gc.collect()
    await api.zeros((1,))
    assert dev.memory_in_use() == baseline, "the memory of the failed submission was never freed"


@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_a_foreign_fault_does_not_stick_to_the_healthy_device(dev: trio_cuda.Device) -> None:
    # repro_foreign_fault_sticks_to_healthy_device: after an op on device 0 failed because
    # it waited for faulted device-1 work, device0.synchronize() raised that DeviceFault
    # again and again, and an allocation too large for device 0 raised it instead of
    # DeviceOutOfMemory (its retry waited for the failed event).
    d1 = trio_cuda.device(1)
    t_stream, s_stream = dev.create_stream(), dev.create_stream()
    on_t = trio_cuda.SingleStream(stream=t_stream)
    c1, z = await ready_to_fault(1)
    b = await api.ones((4,), np.int32).schedule(on_t)  # device 0, written on T
    out = await api.zeros((4,), np.int32)
    await add(out.partition((4,)), b, b)  # compiled
    sa, sb = d1.create_stream(), d1.create_stream()
    await lowlevel.submit(sleep(c1.partition((4,)), 300_000_000), sa)  # long work on device 1
    # On device 0's stream S: copy c1 over (waits for device 1), then read b.
    sub = await lowlevel.submit(api.dup(c1, device=0).then(lambda d: add(out.partition((4,)), d, b)), s_stream)
    await lowlevel.submit(scribble(z.partition((32,))), sb)  # device 1 faults
    with trio.fail_after(5), pytest.raises(trio_cuda.DeviceFault, match="device 1"):
        await sub.wait()
    assert d1.is_faulted and not dev.is_faulted
    problems = []
    for i in range(3):
        try:
            await trio.to_thread.run_sync(dev.synchronize)
        except trio_cuda.DeviceFault as err:
            problems.append(f"device0.synchronize() #{i} raised {err!r}")
    try:
        await api.empty((dev.total_memory // 4 + 1,))
        problems.append("allocating more than the device has succeeded")
    except trio_cuda.DeviceOutOfMemory:
        pass
    except trio_cuda.DeviceFault as err:
        problems.append(f"a too large allocation raised {err!r}, not DeviceOutOfMemory")
    assert not problems, problems
    np.testing.assert_array_equal(await api.full((3,), 5.0).to_host(), [5, 5, 5])


@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_a_free_after_an_op_failed_by_another_devices_fault_does_not_poison_its_stream(dev: trio_cuda.Device) -> None:
    # repro_foreign_fault_free_poisons_stream: b (written on stream T) is read by an op on
    # stream S that fails because it waited for faulted device-1 work. b's free on T then
    # waits for that failed access: the wait marked T failed, so the next, unrelated op on
    # T failed with "waited for work of device 1, which faulted".
    d1 = trio_cuda.device(1)
    t_stream, s_stream = dev.create_stream(), dev.create_stream()
    on_t = trio_cuda.SingleStream(stream=t_stream)
    c1, z = await ready_to_fault(1)
    b = await api.ones((4,), np.int32).schedule(on_t)  # written on T
    out = await api.zeros((4,), np.int32)
    await add(out.partition((4,)), b, b).schedule(on_t)  # compiled
    sa, sb = d1.create_stream(), d1.create_stream()
    await lowlevel.submit(sleep(c1.partition((4,)), 300_000_000), sa)
    # On S: copy c1 from device 1 (waits for it), then read b. Nobody awaits this one.
    held = [b]  # what the callback reads b from: dropping b below drops the tensor
    await lowlevel.submit(api.dup(c1, device=0).then(lambda d: add(out.partition((4,)), d, held[0])), s_stream)
    _, readers = lowlevel.accesses(b)
    assert s_stream in readers  # b's free will wait for this access
    await lowlevel.submit(scribble(z.partition((32,))), sb)  # device 1 faults
    with trio.fail_after(5):
        while not d1.is_faulted:
            await trio.sleep(0.005)  # observing the fault, not ordering
    assert not dev.is_faulted
    frees = dev.statistics().frees
    del b
    held.clear()
    gc.collect()
    # The next submission enqueues b's free on T; then an unrelated op runs on T.
    with trio.fail_after(5):
        out_t = await api.full((3,), 5.0).to_host().schedule(on_t)
    np.testing.assert_array_equal(out_t, [5, 5, 5])
    assert dev.statistics().frees > frees  # b's free was enqueued (the scenario happened)
    assert not dev.is_faulted


SEC = 1_000_000_000


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
    child_ok(r)


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
