"""Regression tests for the bugs an adversarial review found (one test per reproduction).

Each test keeps its reproduction's scenario and checks the promise it broke: captures
never swallow outside work, resets leave no stale streams, data or hangs behind, a fault
of one device fails only the work that waited for it, plans run all or nothing, kernels
run their own code with the exact scalars given, and bad input gets a clear error.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import math
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, sleep

from numba import cuda

from .conftest import needs_devices, settle, started

T = TypeVar("T")
MB = 1 << 20


# -- helpers ---------------------------------------------------------------------------
@trio_cuda.kernel
def scribble(z):  # type: ignore[no-untyped-def]
    # Far out of bounds: faults the device it runs on.
    i = cuda.grid(1)
    z[i + (1 << 40)] = 1.0


@trio_cuda.kernel
def set_one(z):  # type: ignore[no-untyped-def]
    i, j = cuda.grid(2)
    if i < z.shape[0] and j < z.shape[1]:
        z[i, j] = 1.0


@trio_cuda.kernel(block=(64, 64))  # 4096 threads: more than a block can have
def set_one_too_wide(z):  # type: ignore[no-untyped-def]
    i, j = cuda.grid(2)
    if i < z.shape[0] and j < z.shape[1]:
        z[i, j] = 1.0


@trio_cuda.kernel
def sign_of(z, a):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < z.shape[0]:
        z[i] = math.copysign(1.0, a)


def snapshot(dev: trio_cuda.Device) -> tuple[int, ...]:
    s = dev.statistics()
    return (s.submissions, s.launches, s.allocations, s.copies, s.stream_waits, s.bytes_in_use)


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


def in_thread(fn: Callable[[], T]) -> T:
    """Run plain blocking code in another thread (not nested in this one's capture)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=30)


async def ready_to_fault(device: int) -> tuple[trio_cuda.Tensor, trio_cuda.Tensor]:
    """A counter and a scribble target on ``device``, both kernels loaded: the next
    launches start at once (a fault is not held back by a compilation)."""
    with trio_cuda.use_device(device):
        c = await api.zeros((4,), np.int32)
        z = await api.zeros((32,))
        await sleep(c.partition((4,)), 1000)
        await trio.to_thread.run_sync(scribble.prepare, z.partition((32,)))
    return c, z


def child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, TRIO_CUDA_QUIET="1", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=300)


# -- lazy ops and bad input ------------------------------------------------------------
async def test_arange_is_lazy_and_too_large_fails_at_submission(dev: trio_cuda.Device) -> None:
    # repro_arange_eager_host_alloc: constructing an op allocates nothing. An arange of
    # 2**47 bytes (under the addressable limit) built its whole host array when it was
    # made: the call itself raised numpy's MemoryError, outside any submission.
    before = snapshot(dev)
    op = api.arange(2**45)
    assert snapshot(dev) == before
    with pytest.raises(trio_cuda.DeviceOutOfMemory):
        await api.zeros((2**45,))
    # Run, its device allocation fails first, before its host values or their pinned
    # staging memory are made.
    with pytest.raises(trio_cuda.DeviceOutOfMemory):
        await op
    assert snapshot(dev)[1:4] == before[1:4]  # no launch, allocation or copy
    # The values of small aranges are made when they enqueue, and are right.
    np.testing.assert_array_equal(await api.arange(3, 11, 2).to_host(), [3, 5, 7, 9])
    np.testing.assert_array_equal(await api.arange(0, 1, 0.25).to_host(), [0, 0.25, 0.5, 0.75])
    np.testing.assert_array_equal(await api.arange(5, dtype=np.int64).to_host(), np.arange(5))


@pytest.mark.parametrize("value", ["inf", "1e999"])
def test_an_infinite_poll_budget_is_refused_naming_the_variable(value: str) -> None:
    # repro_env_poll_budget_inf: "inf" passed the >= 0 check, then int(inf * 1000) raised
    # a bare OverflowError that names nothing.
    r = child(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api
        from trio_cuda.kernels import sleep
        async def main():
            c = await api.zeros((1,), np.int32)
            await sleep(c.partition((1,)), 5_000_000)
        trio.run(main)
        """,
        TRIO_CUDA_POLL_BUDGET_US=value,
    )
    last = (r.stderr.strip().splitlines() or [""])[-1]
    assert r.returncode != 0, r.stdout
    assert "ValueError" in last and "TRIO_CUDA_POLL_BUDGET_US" in last, r.stderr[-2000:]


@pytest.mark.parametrize(
    "value,dtype",
    [
        (2**63, np.int64),
        (2**64 - 1, np.int64),
        (-1, np.uint64),
        (-(2**63), np.uint64),
        (300, np.uint8),
        (-1, np.uint32),
        (2**31, np.int32),
    ],
)
def test_full_refuses_integers_out_of_the_dtypes_range(dev: trio_cuda.Device, value: int, dtype: type) -> None:
    # repro_full_int64_wraparound: for 64-bit dtypes the range check round-tripped through
    # the other 64-bit type and wrapped, so the tensor silently held another number.
    before = snapshot(dev)
    with pytest.raises(ValueError, match="out of range"):
        api.full((2,), value, dtype)
    assert snapshot(dev) == before


@pytest.mark.parametrize("value,dtype", [(2**63 - 1, np.int64), (-(2**63), np.int64), (2**64 - 1, np.uint64), (0, np.uint64)])
def test_full_keeps_the_extreme_integers_of_64_bit_dtypes(value: int, dtype: type) -> None:
    # The other half of the range check: the limits themselves are accepted, exactly.
    got = api.full((2,), value, dtype).to_host().sync()
    assert got.dtype == np.dtype(dtype) and [int(v) for v in got] == [value, value]


def test_unzip_accepts_numpy_integers() -> None:
    # repro_numpy_scalar_unzip: numpy scalars are accepted wherever Python ints are;
    # unzip(np.int64(2)) was refused ("needs a positive int").
    for n in (2, np.int64(2), np.int32(2), np.uint8(2)):
        a, b = trio_cuda.value((1, 2)).unzip(n)
        assert (a.sync(), b.sync()) == (1, 2)
    with pytest.raises(ValueError):
        trio_cuda.value((1, 2)).unzip(np.int64(0))


# -- kernels ---------------------------------------------------------------------------
def _make_enum_kernel(c: int) -> trio_cuda.Kernel:
    class Scale(enum.IntEnum):  # a local class: the same qualified name on every call
        VALUE = c

    @trio_cuda.kernel
    def fill(z):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < z.shape[0]:
            z[i] = Scale.VALUE

    return fill


async def test_kernels_reading_a_local_enum_run_their_own_code() -> None:
    # repro_kernel_identity_local_class: the fingerprint hashed classes by module and
    # qualified name only, so every kernel after the first ran the first one's code.
    for c in range(1, 6):
        k = _make_enum_kernel(c)
        out = await k(api.zeros((4,), np.int32).partition((4,))).first().to_host()
        np.testing.assert_array_equal(out, [c] * 4, err_msg=f"the kernel made with {c} ran another kernel's code")
        del k
        gc.collect()


async def test_a_negative_zero_scalar_reaches_the_kernel_as_negative_zero() -> None:
    # repro_kernel_scalar_negative_zero: the prepared-launch cache keyed scalars by
    # (type, value), and -0.0 == 0.0, so a launch with -0.0 reused the parameters of 0.0.
    z = await api.zeros((4,))
    for a, sign in [(0.0, 1.0), (-0.0, -1.0), (0.0, 1.0), (-0.0, -1.0)]:
        out = await sign_of(z.partition((4,)), a).first().to_host()
        np.testing.assert_array_equal(out, [sign] * 4, err_msg=f"the launch with a={a!r} ran with another scalar")
    fresh = await api.zeros((4,))
    np.testing.assert_array_equal(await sign_of(fresh.partition((4,)), -0.0).first().to_host(), [-1.0] * 4)


async def test_a_launch_config_error_late_in_a_dag_means_nothing_of_it_ran(dev: trio_cuda.Device) -> None:
    # repro_launch_error_half_run: a DAG whose kernel has an invalid block (64x64:
    # 4096 threads) must run nothing; the fill of x before the launch had run.
    x = await api.zeros((4,))
    big = await api.zeros((64, 64))
    await trio.to_thread.run_sync(settle)
    before = snapshot(dev)
    dag = trio_cuda.zip(api.memcpy(x, np.full(4, 7.0, np.float32)), set_one_too_wide(big.partition((64, 64))))
    with pytest.raises(trio_cuda.LaunchError, match="threads per block"):
        await dag
    await trio.to_thread.run_sync(settle)
    assert snapshot(dev) == before
    np.testing.assert_array_equal(await x.to_host(), np.zeros(4, np.float32))
    assert not dev.is_faulted


# -- shared ops ------------------------------------------------------------------------
def _sync_in_threads_at_once(op: trio_cuda.SharedOp[np.ndarray], n: int, look: Callable[[np.ndarray], T]) -> list[T | None]:
    """``op.sync()`` in ``n`` threads released together: what each saw of the result at
    the moment it got it (None: no result)."""
    barrier = threading.Barrier(n)
    seen: list[T | None] = [None] * n

    def worker(i: int) -> None:
        barrier.wait(30)
        seen[i] = look(op.sync())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return seen


def test_a_shared_read_back_awaited_by_threads_at_once_gives_each_the_full_data(dev: trio_cuda.Device) -> None:
    # repro_shared_to_host_race: the pending value was marked resolved before the data was
    # copied out of the staging buffer, so a second thread could get a partly copied array.
    n = 8 << 20  # 32 MiB: copying out takes long enough for the threads to overlap
    x = api.full((n,), 7.0).sync()
    for rnd in range(20):
        wrong = _sync_in_threads_at_once(x.to_host().shared(), 3, lambda r: int((r != 7.0).sum()))
        assert wrong == [0, 0, 0], f"round {rnd}: wrong elements seen by each thread (None: no result): {wrong}"


@pytest.mark.sim_only
def test_a_submission_relying_on_a_failed_shared_op_runs_nothing() -> None:
    # repro_shared_failed_half_run (64 MiB device): submission A claims shared op s and
    # waits for memory, then fails with DeviceOutOfMemory. Submission B = zip(memcpy(x),
    # s), planned meanwhile, waits for A: it must fail too, and its memcpy must not run.
    r = child(
        """
        import numpy as np, trio, trio.testing, trio_cuda
        from trio_cuda import api, lowlevel
        from trio_cuda.kernels import sleep
        MB = 1 << 20
        async def main():
            dev = trio_cuda.device(0)
            x = await api.zeros((4,))
            c = await api.zeros((1,), np.int32)
            await sleep(c.partition((1,)), 1000)
            hog = await api.empty((40 * MB,), np.uint8)
            # Pending work: A waits for it before its one retry.
            await lowlevel.submit(sleep(c.partition((1,)), 300_000_000))
            s = api.full((4,), 3.0).shared()
            out = {}

            async def a():
                try:
                    await trio_cuda.zip(s, api.empty((40 * MB,), np.uint8))  # never fits
                    out["a"] = "ok"
                except trio_cuda.DeviceOutOfMemory:
                    out["a"] = "DeviceOutOfMemory"

            async def b():
                before = dev.statistics().copies
                try:
                    await trio_cuda.zip(api.memcpy(x, np.full(4, 7.0, np.float32)), s)
                    out["b"] = "ok"
                except trio_cuda.DeviceOutOfMemory:
                    out["b"] = "DeviceOutOfMemory"
                out["b_copies"] = dev.statistics().copies - before

            with trio.fail_after(10):
                async with trio.open_nursery() as n:
                    n.start_soon(a)
                    await trio.testing.wait_all_tasks_blocked()  # A waits for memory
                    assert "a" not in out, out
                    n.start_soon(b)
            await trio.to_thread.run_sync(dev.synchronize)
            xs = await x.to_host()
            assert out == {"a": "DeviceOutOfMemory", "b": "DeviceOutOfMemory", "b_copies": 0}, out
            assert (xs == 0).all(), f"B failed but its memcpy into x ran: {xs}"
            del hog
            print("ok")
        trio.run(main)
        """,
        TRIO_CUDA_SIM_MEMORY=str(64 * MB),
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-3000:]


# -- graph captures --------------------------------------------------------------------
async def test_another_tasks_read_during_a_capture_waits_for_pre_capture_work(dev: trio_cuda.Device) -> None:
    # repro_capture_swallows_other_task: while a capture scope on stream cs is open,
    # another task reads c, whose pending writer is work enqueued on cs before the
    # capture. The read must wait for that work and complete, not join the capture.
    cs = dev.create_stream()
    x, y = await api.ones((8,)), await api.ones((8,))
    z1, z2 = await api.zeros((8,)), await api.zeros((8,))
    await add(z1.partition((8,)), x, y)  # compiled outside the capture
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)  # c = 1
    await lowlevel.submit(sleep(c.partition((1,)), 300_000_000), cs)  # c = 2, still running
    outcome: dict[str, Any] = {}

    async def reader() -> None:
        with trio.move_on_after(5) as timer:
            outcome["value"] = await c.to_host()  # c is not recorded by the capture
        outcome["timed_out"] = timer.cancelled_caught

    with trio_cuda.capture_graph(cs) as scope:
        scope.record(trio_cuda.zip(add(z1.partition((8,)), x, y), add(z2.partition((8,)), x, y)))
        async with trio.open_nursery() as n:
            n.start_soon(reader)
    assert not outcome["timed_out"], "the read of c was swallowed by the capture: it never completed"
    np.testing.assert_array_equal(outcome["value"], [2])
    assert scope.graph is not None and scope.graph.nodes == 2


async def test_another_tasks_work_during_a_capture_is_not_swallowed_by_a_recycled_event(dev: trio_cuda.Device) -> None:
    # repro_capture_recycled_event_handle: events recorded inside an open capture die
    # during it; their handles went back to the pool still registered as capture events.
    # Another task's submission took one for its completion event: a stream waiting for
    # it joined the capture and its read-back was recorded into the graph, never run.
    x = await api.ones((8,))
    zs = [await api.zeros((8,)) for _ in range(3)]
    await add(zs[0].partition((8,)), x, x)
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)  # c = 1
    outcome: dict[str, Any] = {}

    async def other() -> None:  # ordinary work of another task, nothing to do with the capture
        with trio.move_on_after(5) as timer:
            await lowlevel.submit(sleep(c.partition((1,)), 100_000_000))
            outcome["value"] = await c.to_host()
        outcome["timed_out"] = timer.cancelled_caught

    with trio_cuda.capture_graph() as scope:
        scope.record(trio_cuda.zip(add(zs[0].partition((8,)), x, x), add(zs[1].partition((8,)), x, x)))
        scope.record(trio_cuda.zip(add(zs[2].partition((8,)), x, x), trio_cuda.value(1)))
        gc.collect()  # the capture's fork events die: their handles are recycled now
        async with trio.open_nursery() as n:
            n.start_soon(other)
    assert not outcome["timed_out"], "another task's work was swallowed by the capture"
    np.testing.assert_array_equal(outcome["value"], [2])
    assert scope.graph is not None and scope.graph.nodes == 3


@pytest.mark.sim_only
async def test_a_free_during_a_capture_runs_on_the_device_not_in_the_graph(dev: trio_cuda.Device) -> None:
    # repro_capture_swallows_free: c, last written by pre-capture work on stream cs, is
    # dropped while a capture on cs is open, and another submission flushes its free. The
    # free must run on the device (after c's write), not become a node of the graph (the
    # memory was never released and each replay freed it again).
    await trio.to_thread.run_sync(settle)
    cs = dev.create_stream()
    x, y = await api.ones((8,)), await api.ones((8,))
    z1, z2 = await api.zeros((8,)), await api.zeros((8,))
    await add(z1.partition((8,)), x, y)
    c = await api.zeros((4 * MB // 4,), np.int32)
    await sleep(c.partition((1024,)), 1000)
    await lowlevel.submit(sleep(c.partition((1024,)), 300_000_000), cs)  # pre-capture work on cs
    free_before = dev.mem_info()[0]
    with trio_cuda.capture_graph(cs) as scope:
        scope.record(trio_cuda.zip(add(z1.partition((8,)), x, y), add(z2.partition((8,)), x, y)))
        del c
        gc.collect()
        await api.zeros((1,))  # another submission: flushes the deferred free of c
    g = scope.graph
    assert g is not None and g.nodes == 2, "work that was not recorded was swallowed into the graph"
    await trio.to_thread.run_sync(settle)  # the pre-capture kernel ends, then the free runs
    assert dev.mem_info()[0] - free_before >= 4 * MB, "the free of c never ran on the device"
    with trio.fail_after(10):
        await g.launch()
        await g.launch()
    assert not dev.is_faulted


def test_stream_synchronize_of_a_capturing_stream_does_not_hang(dev: trio_cuda.Device) -> None:
    # repro_capture_stream_synchronize_hangs: Stream.synchronize() from another thread
    # recorded an event inside the open capture (which never completes) and blocked.
    cs = dev.create_stream()
    x, y, z = api.ones((8,)).sync(), api.ones((8,)).sync(), api.zeros((8,)).sync()
    add(z.partition((8,)), x, y).sync()
    outcome: list[object] = []

    def other() -> None:
        try:
            cs.synchronize()
            outcome.append("returned")
        except trio_cuda.GraphCaptureError as err:  # refusing is fine too
            outcome.append(err)

    with trio_cuda.capture_graph(cs) as scope:
        scope.record(add(z.partition((8,)), x, y))
        th = threading.Thread(target=other, daemon=True)
        th.start()
        th.join(5)
        hung = th.is_alive()
    th.join(5)
    assert not hung, "Stream.synchronize() of the capturing stream blocked"
    assert len(outcome) == 1, outcome
    assert scope.graph is not None and scope.graph.nodes == 1


async def test_device_synchronize_during_a_capture_waits_for_pre_capture_work(dev: trio_cuda.Device) -> None:
    # repro_synchronize_skips_capturing_stream: Device.synchronize() skipped streams in
    # capture mode, so it returned while work enqueued on the capturing stream before the
    # capture still ran.
    cs = dev.create_stream()
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)  # c = 1
    x, z = await api.ones((8,)), await api.zeros((8,))
    await add(z.partition((8,)), x, x)
    pre = await lowlevel.submit(sleep(c.partition((1,)), 500_000_000), cs)  # c = 2 when done
    assert pre.event is not None
    with trio_cuda.capture_graph(cs) as scope:
        scope.record(add(z.partition((8,)), x, x))
        with trio.fail_after(10):
            await trio.to_thread.run_sync(dev.synchronize)
        assert pre.event.query(), "Device.synchronize() returned before pre-capture work on the capturing stream completed"
    assert scope.graph is not None
    np.testing.assert_array_equal(await c.to_host(), [2])


@pytest.mark.faults_device
def test_record_after_a_reset_during_an_open_capture_is_refused_and_runs_nothing(dev: trio_cuda.Device) -> None:
    # repro_reset_during_capture_scope: after a reset (from another thread) the capturing
    # stream was rebound to a fresh driver stream not in capture mode, so record() ran the
    # kernel for real; the scope's exit then rolled the output's writer back, and the next
    # read of it was not ordered after the kernel (torn data).
    n = 4096
    x = api.ones((n,)).sync()
    z = api.zeros((n,)).sync()
    add(z.partition((256,)), x, x).sync()  # compiled before the capture
    refused: list[BaseException] = []
    try:
        with trio_cuda.capture_graph() as scope:
            scope.record(add(z.partition((256,)), x, x))
            in_thread(dev.reset)
            x2, z2 = in_thread(lambda: (api.ones((n,)).sync(), api.zeros((n,)).sync()))
            launches = dev.statistics().launches
            try:
                scope.record(add(z2.partition((256,)), x2, x2))
            except (trio_cuda.DeviceReset, trio_cuda.GraphCaptureError) as err:
                refused.append(err)
    except trio_cuda.DeviceError:
        pass  # closing a capture that the reset ended may say so
    assert len(refused) == 1, "record() after the reset was accepted"
    assert dev.statistics().launches == launches
    np.testing.assert_array_equal(z2.to_host().sync(), np.zeros(n, np.float32))  # not torn
    settle()  # anything that was enqueued has run now
    np.testing.assert_array_equal(z2.to_host().sync(), np.zeros(n, np.float32))  # nothing ran
    np.testing.assert_array_equal(api.full((2,), 3.0).to_host().sync(), [3, 3])


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
