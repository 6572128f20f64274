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

from .conftest import counter, settle, started

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
