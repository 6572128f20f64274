"""Plan, then enqueue: a submission validates its whole DAG before any driver call, and the
waits between planning and enqueueing never block the trio loop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from trio_cuda import api
from trio_cuda._guard import LOCK
from trio_cuda.kernels import add, saxpy

from ..helpers.loads import fresh_kernel


def snapshot(dev: trio_cuda.Device) -> tuple[int, ...]:
    s = dev.statistics()
    return (s.submissions, s.launches, s.allocations, s.copies, s.stream_waits, s.bytes_in_use)


async def test_a_bad_argument_late_in_the_dag_means_nothing_of_it_ran(dev: trio_cuda.Device) -> None:
    x = await api.full((8,), 1.0)
    y = await api.zeros((8,))
    before = snapshot(dev)
    # The first ops are fine (a write of y, an allocation, a launch); the last is not.
    op = trio_cuda.zip(api.memcpy(y, np.full(8, 5.0, np.float32)), saxpy(2.0, x, y.partition((4,)))).then(
        lambda _: add(api.zeros((8,)).partition((4,)), x, api.zeros((9,)))
    )
    with pytest.raises(ValueError, match="shape"):
        await op
    assert snapshot(dev) == before
    np.testing.assert_array_equal(await y.to_host(), np.zeros(8, np.float32))


async def test_a_failing_callback_means_nothing_ran_and_the_op_is_not_consumed(dev: trio_cuda.Device) -> None:
    calls = 0

    def flaky(t: trio_cuda.Tensor) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("first time")
        return add(api.empty((4,)).partition((4,)), t, t)

    op = api.full((4,), 3.0).then(flaky).first().to_host()
    before = snapshot(dev)
    with pytest.raises(KeyError):
        await op
    assert snapshot(dev) == before
    # Nothing was consumed: the same op runs now (its callback runs again).
    np.testing.assert_array_equal(await op, np.full(4, 6.0, np.float32))


async def test_a_bad_argument_in_another_device_branch_means_nothing_ran() -> None:
    devs = trio_cuda.devices()
    if len(devs) < 2:
        pytest.skip("needs 2 devices")
    d0, d1 = devs[0], devs[1]
    before = (snapshot(d0), snapshot(d1))
    op = trio_cuda.zip(api.ones((4,), device=1), api.zeros((4,), device=0)).then(
        lambda ab: add(ab[1].partition((4,)), ab[0], ab[1])  # ab[0] lives on device 1
    )
    with pytest.raises(ValueError, match="device 1"):
        await op
    assert (snapshot(d0), snapshot(d1)) == before


def _slow_first_loads(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make every kernel load of ``dev`` take ``seconds`` longer (a slow first compile)."""
    drv = dev._driver
    real = drv.load_kernel

    def slow_load(source: object, signature: object, args: object) -> object:
        time.sleep(seconds)
        return real(source, signature, args)

    monkeypatch.setattr(drv, "load_kernel", slow_load)


async def test_first_launch_compiles_in_a_worker_thread_without_the_lock(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = fresh_kernel()
    x = await api.full((8,), 4.0)
    drv = dev._driver
    real = drv.load_kernel
    seen: list[tuple[int, bool]] = []

    def slow_load(source: object, signature: object, args: object) -> object:
        free = LOCK.acquire(blocking=False)  # nobody holds the runtime lock meanwhile
        if free:
            LOCK.release()
        seen.append((threading.get_ident(), free))
        time.sleep(0.3)  # as numba's compiler and the driver's module loading can take
        return real(source, signature, args)

    monkeypatch.setattr(drv, "load_kernel", slow_load)
    ticks = 0

    async def ticker(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal ticks
        task_status.started()
        while True:
            await trio.sleep(0.01)
            ticks += 1

    trio_thread = threading.get_ident()
    async with trio.open_nursery() as n:
        await n.start(ticker)
        out = await k(api.empty((8,)).partition((8,)), x).first().to_host()
        n.cancel_scope.cancel()
    np.testing.assert_array_equal(out, np.full(8, 8.0, np.float32))
    assert len(seen) == 1
    thread, lock_was_free = seen[0]
    assert thread != trio_thread and lock_was_free
    assert ticks >= 10, f"the trio loop ran only {ticks} ticks during a 0.3 s compilation"


async def test_cancelled_during_compilation_means_nothing_ran(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    k = fresh_kernel()
    x = await api.full((8,), 4.0)
    _slow_first_loads(dev, monkeypatch, 0.3)
    op = k(api.empty((8,)).partition((8,)), x).first().to_host()
    before = snapshot(dev)
    start = time.perf_counter()
    with trio.move_on_after(0.05) as scope:
        await op
    assert scope.cancelled_caught and time.perf_counter() - start < 0.25
    assert snapshot(dev) == before
    # The op was not consumed; the compilation finished in the background meanwhile.
    np.testing.assert_array_equal(await op, np.full(8, 8.0, np.float32))


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, TRIO_CUDA_QUIET="1", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.sim_only
def test_out_of_memory_waits_for_pending_work_cancellably() -> None:
    # 64 MiB device: a 40 MiB tensor in use by a 2 s kernel is dropped (its free is queued
    # after the kernel); a new 40 MiB tensor does not fit until the kernel ends. The
    # allocation waits for it in trio: a 50 ms deadline fires on time, nothing half-ran.
    r = _child(
        """
        import time, numpy as np, trio, trio_cuda
        from trio_cuda import api
        MB = 1 << 20
        def hold_on_host(counter, x, ns):
            time.sleep(ns / 1e9)  # a kernel that reads x for ns nanoseconds
        @trio_cuda.kernel(sim=hold_on_host)
        def hold(counter, x, ns):
            pass
        async def main():
            dev = trio_cuda.device(0)
            c = await api.zeros((1,), np.int32)
            big = await api.empty((40 * MB,), np.uint8)
            await trio_cuda.lowlevel.submit(hold(c.partition((1,)), big, 2_000_000_000))
            del big
            before = dev.statistics()
            t0 = time.perf_counter()
            with trio.move_on_after(0.05) as scope:
                await api.zeros((40 * MB,), np.uint8)
            waited = time.perf_counter() - t0
            assert scope.cancelled_caught, "the allocation did not wait"
            assert waited < 0.5, f"the deadline fired after {waited:.2f} s"
            after = dev.statistics()
            assert (after.allocations, after.copies) == (before.allocations, before.copies)
            # Without a deadline it waits for the kernel, then succeeds.
            t = await api.zeros((40 * MB,), np.uint8)
            assert t.nbytes == 40 * MB
            # A request that can never fit fails at once.
            try:
                await api.empty((100 * MB,), np.uint8)
            except trio_cuda.DeviceOutOfMemory:
                print("ok")
        trio.run(main)
        """,
        TRIO_CUDA_SIM_MEMORY=str(64 << 20),
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


async def test_shared_op_used_by_concurrent_submissions_runs_once(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first submission waits (a slow first compile) after planning the shared op; the
    # second, planned meanwhile, uses its output and waits for it to enqueue.
    k = fresh_kernel()
    _slow_first_loads(dev, monkeypatch, 0.2)
    x = await api.full((8,), 1.5)
    shared = k(api.empty((8,)).partition((8,)), x).first().unpartition().shared()
    launches = dev.statistics().launches
    results: list[np.ndarray] = []

    async def consumer() -> None:
        t = await shared
        results.append(await t.to_host())

    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(consumer)
    assert dev.statistics().launches == launches + 1
    for r in results:
        np.testing.assert_array_equal(r, np.full(8, 3.0, np.float32))


async def test_shared_op_first_submission_cancelled_while_others_rely_on_it(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Task A plans a shared op and waits for its kernel to compile; task B, planned
    # meanwhile, relies on A's plan. A is cancelled during the compilation: A must still
    # enqueue (shielded, bounded by the compilation) so B gets its result; A sees Cancelled.
    k = fresh_kernel()
    _slow_first_loads(dev, monkeypatch, 0.2)
    x = await api.full((8,), 2.0)
    shared = k(api.empty((8,)).partition((8,)), x).first().unpartition().shared()
    out: list[np.ndarray] = []
    a_scope = trio.CancelScope()

    async def first(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with a_scope:
            task_status.started()
            await shared

    async def second(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        out.append(await shared.to_host())

    async with trio.open_nursery() as n:
        await n.start(first)
        await trio.testing.wait_all_tasks_blocked()  # A waits for its compilation
        await n.start(second)
        await trio.testing.wait_all_tasks_blocked()  # B waits for A's submission
        a_scope.cancel()
    assert a_scope.cancelled_caught
    np.testing.assert_array_equal(out[0], np.full(8, 4.0, np.float32))


async def test_sizes_are_python_integers_and_bounded(dev: trio_cuda.Device) -> None:
    before = dev.memory_in_use()
    with pytest.raises(ValueError, match="can address"):
        api.zeros((3, 2**62), np.int8)
    with pytest.raises(ValueError, match="can address"):
        api.empty((2**40, 2**40))
    with pytest.raises(ValueError, match="can address"):
        api.arange(0, 2**60)
    assert dev.memory_in_use() == before >= 0
