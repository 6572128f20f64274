"""Device errors: launch errors, out of memory, asynchronous faults, reset."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api
from trio_cuda.kernels import sleep

from numba import cuda

from .conftest import ON_CUDA, counter, needs_devices, started


@trio_cuda.kernel
def scribble(z):  # type: ignore[no-untyped-def]
    # Far out of bounds: an IndexError on the simulated device, an illegal address on a GPU.
    i = cuda.grid(1)
    z[i + (1 << 40)] = 1.0


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
    # Load both kernels first: on CUDA, loading a kernel waits for running work, which
    # would hold the faulting launch back until the sleeps were over.
    target = await api.zeros((32,))
    await trio.to_thread.run_sync(scribble.prepare, target.partition((32,)))
    await sleep(counter(), 1000)

    async def waiter(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            # Each on a stream of its own, so that the faulting launch is not queued behind it.
            await started(sleep(counter(), 3_000_000_000), trio_cuda.SingleStream(dev), task_status=task_status)
            outcomes.append("completed")
        except trio_cuda.DeviceFault:
            outcomes.append("fault")

    start = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(3):
            await n.start(waiter)
        with pytest.raises(trio_cuda.DeviceFault):
            await scribble(target.partition((32,))).schedule(trio_cuda.SingleStream(dev))
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
