"""Cancellation before and after submission: prompt, safe, nothing lost or freed early."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda.kernels import add, sleep

from ..helpers.devices import counter, settle, started
from ..helpers.faults import child, child_ok

SLOW_NS = 500_000_000


async def warm_up() -> None:
    # The first launch of a kernel signature compiles it (synchronously, once per
    # process and cached on disk); latency tests measure what comes after.
    await sleep(counter(), 1000)


async def test_cancelled_after_submission_returns_promptly_and_the_work_completes(dev: trio_cuda.Device) -> None:
    await warm_up()
    c = await counter()
    start = time.perf_counter()
    with trio.move_on_after(0.05) as scope:
        await sleep(c, SLOW_NS)
    elapsed = time.perf_counter() - start
    assert scope.cancelled_caught
    assert elapsed < 0.25, f"cancellation took {elapsed:.3f} s"
    # The work was submitted and cannot be recalled: a later read is ordered after it
    # (even from another stream) and sees its result.
    np.testing.assert_array_equal(await c.to_host(), [1])


async def test_fail_after_raises_too_slow_promptly() -> None:
    await warm_up()
    c = await counter()
    start = time.perf_counter()
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(0.05):
            await sleep(c, SLOW_NS)
    assert time.perf_counter() - start < 0.25
    np.testing.assert_array_equal(await c.to_host(), [1])


async def test_cancelled_read_back_leaves_the_data_intact() -> None:
    c = await counter()
    with trio.move_on_after(0.05):
        await sleep(c, SLOW_NS).first().to_host()
    # The cancelled read's staging memory is not recycled under the pending copy.
    for _ in range(3):
        np.testing.assert_array_equal(await api.full((1,), 5, np.int32).to_host(), [5])
    np.testing.assert_array_equal(await c.to_host(), [1])


async def test_later_ops_on_the_tensor_wait_for_the_cancelled_work(dev: trio_cuda.Device) -> None:
    c = await counter()
    with trio.move_on_after(0.05):
        await sleep(c, SLOW_NS)
    # A second increment on another stream must come after the first one.
    policy = trio_cuda.StreamPoolRoundRobin(dev, 2)
    await sleep(c, 1000).schedule(policy)
    np.testing.assert_array_equal(await c.to_host(), [2])


@pytest.mark.sim_only
async def test_memory_of_cancelled_work_is_not_freed_under_the_device(dev: trio_cuda.Device) -> None:
    # On the simulated device mem_info() shows what the device really holds.
    await trio.to_thread.run_sync(settle)
    free_before, _ = dev.mem_info()
    with trio.move_on_after(0.05):
        await sleep(counter(), SLOW_NS)
    gc.collect()  # the counter tensor is garbage now
    await api.zeros((1,))  # a submission: deferred frees are enqueued here
    free_during, _ = dev.mem_info()
    assert free_during < free_before, "the counter's memory was released while the kernel still ran"
    await trio.to_thread.run_sync(settle)  # waits for the kernel, then for the free
    assert dev.mem_info()[0] == free_before


async def test_cancel_a_nursery_of_gpu_waits() -> None:
    await warm_up()
    counters = [await counter() for _ in range(6)]
    start = time.perf_counter()
    async with trio.open_nursery() as n:
        for c in counters:
            await n.start(started, sleep(c, SLOW_NS))
        n.cancel_scope.cancel()
    assert time.perf_counter() - start < 0.3
    for c in counters:
        np.testing.assert_array_equal(await c.to_host(), [1])


async def test_cancelled_during_a_long_dag_keeps_every_intermediate_alive() -> None:
    x = await api.arange(8)
    op = sleep(counter(), 200_000_000).then(lambda _: add(api.zeros((8,)).partition((4,)), x, x)).first().unpartition()
    with trio.move_on_after(0.02):
        await op
    del op
    gc.collect()
    # The intermediates are referenced by nothing here; the GPU finishes with them anyway.
    out = await api.dup(x).to_host()
    np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32))


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial2.py)
# ======================================================================================
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
    child_ok(r)
