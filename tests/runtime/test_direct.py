"""Direct submissions (issue 12): a lone kernel launch, or a replayed ``ops`` call of one
launch or one GEMM, on memory already allocated, is planned and enqueued in one step
without a plan (``_direct.direct_ready`` / ``direct_enqueue``). It must keep every
promise of the general path: cross-stream ordering, faults named after the op, op reuse
refused, the device tidied, threads and resets. Each test checks that the direct path
was taken (``submission_statistics().direct``), so none passes on the general path alone.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import OpAlreadyExecuted, _submission, api, lowlevel, ops
from trio_cuda.kernels import add, sleep

from ..helpers.devices import Resetter, counter, run_with_deadline, settle

RNG = np.random.default_rng(12)
SLOW_NS = 30_000_000


def direct() -> int:
    return lowlevel.submission_statistics().direct


async def tidy(dev: trio_cuda.Device) -> None:
    """helpers.settle (in a worker thread) until a settle finds nothing to free and no
    stream to destroy: nothing is left for the next submission to tidy first, and the
    frees a test counts after this are its own. (A collection in between may drop
    garbage of earlier tests: settled again.)"""

    def done() -> tuple[int, int]:
        s = dev.statistics()
        return s.frees, s.streams_destroyed

    for _ in range(4):
        before = done()
        await trio.to_thread.run_sync(settle)
        if done() == before:
            return
    raise AssertionError("every settle of the device found more memory to free or streams to destroy")


def freed(dev: trio_cuda.Device, before: trio_cuda.DeviceStatistics) -> tuple[int, int]:
    """The frees ``dev`` enqueued since ``before``, and the bytes no longer in use (a
    dropped tensor's memory whose free is not enqueued yet still counts as in use)."""
    now = dev.statistics()
    return now.frees - before.frees, before.bytes_in_use - now.bytes_in_use


def counted(before: lowlevel.SubmissionStatistics) -> dict[str, int]:
    """How the submission counters moved since ``before``."""
    now = lowlevel.submission_statistics()
    return {f: getattr(now, f) - getattr(before, f) for f in ("planned", "enqueued", "failed", "abandoned", "direct")}


def f32(*shape: int) -> np.ndarray:
    return RNG.uniform(-1, 1, shape).astype(np.float32)


async def test_repeated_calls_go_direct_and_compute_what_the_general_path_does() -> None:
    hx, hw = f32(16, 16), f32(16, 16)
    x, w = await api.from_host(hx), await api.from_host(hw)
    y, n = await api.zeros((16, 16)), await api.zeros((16, 16))
    g = await api.ones((16,))
    acc = await api.ones((16,))
    before = direct()
    for _ in range(4):
        await ops.matmul(w, x, out=y)  # GEMM: direct from the second call
        await ops.rms_norm(y, g, 1e-6, out=n)  # one launch: direct once its launch is prepared
        await ops.add(x, n, out=x)  # reads and writes x: x grows each time
        await add(acc.partition((16,)), acc, acc)  # a hand-written kernel: acc = 2 * acc
    got_direct = direct() - before
    assert got_direct >= 4 * 4 - 6, got_direct  # at most the first two calls of each take the general path
    ref = hx.astype(np.float64)
    for _ in range(4):
        yy = hw.astype(np.float64) @ ref
        ref = ref + yy / np.sqrt(np.mean(yy * yy, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(await x.to_host(), ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(await acc.to_host(), np.full(16, 16.0, np.float32))


async def test_a_direct_gemm_waits_for_a_slow_writer_of_its_input_on_another_stream() -> None:
    dev = trio_cuda.current_device()
    s1 = dev.create_stream()
    hx, hw = f32(32, 8), f32(32, 32)
    x, w = await api.from_host(hx), await api.from_host(hw)
    y = await api.zeros((32, 8))
    for _ in range(6):  # recipe recorded, and every stream of the pool warmed
        await ops.matmul(w, x, out=y)
    for k in range(3):
        await tidy(dev)
        slow = await lowlevel.submit(sleep(counter(), SLOW_NS).then(lambda _: ops.multiply(x, 2.0, out=x)), s1)
        before = direct()
        await ops.matmul(w, x, out=y)  # must run after s1's write of x
        assert direct() == before + 1
        expected = hw.astype(np.float64) @ (hx.astype(np.float64) * 2.0 ** (k + 1))
        np.testing.assert_allclose(await y.to_host(), expected, rtol=1e-4, atol=1e-4)
        await slow.wait()


async def test_a_direct_gemm_waits_for_a_slow_reader_of_its_output_on_another_stream() -> None:
    # write-after-read: the slow reader on s1 must see y before the GEMM overwrites it
    dev = trio_cuda.current_device()
    s1 = dev.create_stream()
    hx, hw = f32(16, 4), f32(16, 16)
    x, w = await api.from_host(hx), await api.from_host(hw)
    y = await api.from_host(np.full((16, 4), 7.0, np.float32))
    z = await api.zeros((16, 4))
    for _ in range(3):
        await ops.matmul(w, x, out=z)
        await ops.matmul(w, x, out=y)
    seven = await api.from_host(np.full((16, 4), 7.0, np.float32))
    await ops.copy(seven, out=y)
    c = counter()
    await tidy(dev)
    reader = await lowlevel.submit(sleep(c, SLOW_NS).then(lambda _: ops.add(y, 0.0, out=z)), s1)
    before = direct()
    await ops.matmul(w, x, out=y)
    assert direct() == before + 1
    await reader.wait()
    np.testing.assert_array_equal(await z.to_host(), np.full((16, 4), 7.0, np.float32))
    np.testing.assert_allclose(await y.to_host(), hw @ hx, rtol=1e-4, atol=1e-4)


async def test_an_op_awaited_twice_is_refused_after_a_direct_submission() -> None:
    x = await api.ones((8,))
    for _ in range(3):
        await ops.add(x, 1.0, out=x)
    op = ops.add(x, 1.0, out=x)
    before = direct()
    await op
    assert direct() == before + 1
    with pytest.raises(OpAlreadyExecuted):
        await op
    np.testing.assert_array_equal(await x.to_host(), np.full(8, 5.0, np.float32))


async def test_a_fault_in_direct_work_names_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    x, w, y = await api.ones((8, 8)), await api.ones((8, 8)), await api.zeros((8, 8))
    for _ in range(2):
        await ops.matmul(w, x, out=y)
    failing = []

    def query(handle: object) -> bool:
        failing.append(handle)
        raise trio_cuda.DeviceFault("injected: the work before this event failed", device=dev.ordinal)

    monkeypatch.setattr(dev._driver, "query", query)
    before = direct()
    with pytest.raises(trio_cuda.DeviceFault) as info:
        await ops.matmul(w, x, out=y)
    assert direct() == before + 1 and failing
    assert info.value.op == "ops.matmul" and "injected" in str(info.value)
    monkeypatch.undo()
    await trio.to_thread.run_sync(dev.synchronize)
    np.testing.assert_array_equal(await y.to_host(), np.full((8, 8), 8.0, np.float32))


async def test_a_direct_submission_frees_what_was_dropped_first() -> None:
    # Memory freed by a finalizer waits in the device's list until the next submission
    # frees it (stream-ordered, after its last accesses): a direct submission does that too.
    dev = trio_cuda.current_device()
    x = await api.ones((8,))
    for _ in range(3):
        await ops.add(x, 1.0, out=x)
    tmp = await api.zeros((1 << 16,))
    await ops.add(tmp, 1.0, out=tmp)
    await tidy(dev)
    s0, nbytes = dev.statistics(), tmp.nbytes
    del tmp
    gc.collect()
    assert freed(dev, s0) == (0, 0), "the dropped tensor's free should wait for the next submission"
    before = direct()
    await ops.add(x, 1.0, out=x)
    assert direct() == before + 1
    assert freed(dev, s0) == (1, nbytes), "the direct submission should have enqueued the free first"
    np.testing.assert_array_equal(await x.to_host(), np.full(8, 5.0, np.float32))


def test_direct_submissions_from_threads_and_trio_on_one_buffer_all_land(dev: trio_cuda.Device) -> None:
    # Read-modify-write of one buffer from four threads (op.sync(), each on the pool's
    # streams) and two trio tasks at once: the ordering the direct path keeps across
    # streams makes every increment count.
    x = api.zeros((64,)).sync()
    ops.add(x, 1.0, out=x).sync()
    ops.add(x, 1.0, out=x).sync()
    before = direct()
    per = 60

    def worker() -> None:
        for _ in range(per):
            ops.add(x, 1.0, out=x).sync()

    async def main() -> None:
        async def task() -> None:
            for _ in range(per):
                await ops.add(x, 1.0, out=x)

        def run_threads() -> None:
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        async with trio.open_nursery() as n:
            for _ in range(2):
                n.start_soon(task)
            await trio.to_thread.run_sync(run_threads)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    trio.run(main)
    assert direct() - before >= per  # most of them went direct (the rest waited in the general path)
    np.testing.assert_array_equal(x.to_host().sync(), np.full(64, 2.0 + 6 * per, np.float32))


@pytest.mark.faults_device
def test_resets_from_another_thread_while_tasks_submit_directly(dev: trio_cuda.Device) -> None:
    # Each task repeats a direct op on its own tensors; a thread resets the device. Every
    # await either lands or raises a DeviceError (or, for a tensor from before the reset,
    # ValueError); nothing hangs or crashes, and the device works afterwards.
    resetter = Resetter(dev)

    async def main() -> int:
        landed = 0

        async def task() -> None:
            nonlocal landed
            x = w = y = None
            for _ in range(60):
                try:
                    if x is None:
                        x, w, y = await api.ones((8, 8)), await api.ones((8, 8)), await api.zeros((8, 8))
                    await ops.add(x, 0.0, out=x)
                    await ops.matmul(w, x, out=y)
                    got = await y.to_host()
                except trio_cuda.DeviceUnavailable:
                    await trio.sleep(0.005)
                    continue
                except (trio_cuda.DeviceError, ValueError):
                    x = w = y = None
                    continue
                np.testing.assert_array_equal(got, np.full((8, 8), 8.0, np.float32))
                landed += 1
                if landed % 20 == 0:  # pacing: a reset after every 20 (the ops go direct in between)
                    resetter.progress.set()

        async with trio.open_nursery() as n:
            for _ in range(6):
                n.start_soon(task)
        return landed

    before = direct()
    with resetter:
        landed = run_with_deadline(main)
    assert resetter.resets > 0 and landed > 0
    assert direct() > before, "no submission went direct between the resets"
    x = api.ones((4,)).sync()
    for _ in range(3):
        ops.add(x, 1.0, out=x).sync()
    np.testing.assert_array_equal(x.to_host().sync(), np.full(4, 4.0, np.float32))


async def test_with_direct_submissions_off_every_submission_is_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    # (_submission.direct_on, a test hook): the same results, no direct submission.
    monkeypatch.setattr(_submission, "direct_on", False)
    hx, hw = f32(8, 8), f32(8, 8)
    x, w, y = await api.from_host(hx), await api.from_host(hw), await api.zeros((8, 8))
    before = direct()
    planned = lowlevel.submission_statistics().planned
    for _ in range(4):
        await ops.matmul(w, x, out=y)
        await ops.add(x, y, out=x)
    assert direct() == before
    assert lowlevel.submission_statistics().planned - planned == 8
    ref = hx.astype(np.float64)
    for _ in range(4):
        ref = ref + hw.astype(np.float64) @ ref
    np.testing.assert_allclose(await x.to_host(), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("on", [True, False])
async def test_a_failed_enqueue_counts_the_same_both_ways(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    # A step the driver refuses: planned and failed (not enqueued), the op consumed.
    dev = trio_cuda.current_device()
    x, w, y = await api.ones((8, 8)), await api.ones((8, 8)), await api.zeros((8, 8))
    for _ in range(3):
        await ops.matmul(w, x, out=y)

    def refuse(*args: object, **kwargs: object) -> None:
        raise trio_cuda.LaunchError("the driver refused the GEMM", device=dev.ordinal)

    monkeypatch.setattr(dev._driver, "matmul", refuse)
    monkeypatch.setattr(_submission, "direct_on", on)
    op = ops.matmul(w, x, out=y)
    s0 = lowlevel.submission_statistics()
    with pytest.raises(trio_cuda.LaunchError, match="refused"):
        await op
    assert counted(s0) == {"planned": 1, "enqueued": 0, "failed": 1, "abandoned": 0, "direct": 0}
    with pytest.raises(OpAlreadyExecuted):
        await op


@pytest.mark.parametrize("on", [True, False])
async def test_a_failed_tidy_up_abandons_the_submission_both_ways(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    # Freeing dropped memory fails before anything is enqueued: abandoned, the op not consumed.
    dev = trio_cuda.current_device()
    x = await api.ones((8,))
    for _ in range(3):
        await ops.add(x, 1.0, out=x)
    tmp = await api.zeros((1 << 12,))
    await tidy(dev)
    d0, nbytes = dev.statistics(), tmp.nbytes
    del tmp
    gc.collect()  # its free waits for the next submission

    def fail() -> None:
        raise trio_cuda.DeviceError("free failed", device=dev.ordinal)

    monkeypatch.setattr(dev, "flush_frees", fail)
    monkeypatch.setattr(_submission, "direct_on", on)
    op = ops.add(x, 1.0, out=x)
    s0 = lowlevel.submission_statistics()
    with pytest.raises(trio_cuda.DeviceError, match="free failed"):
        await op
    assert counted(s0) == {"planned": 1, "enqueued": 0, "failed": 0, "abandoned": 1, "direct": 0}
    assert freed(dev, d0) == (0, 0)  # the free still waits
    monkeypatch.undo()
    await op  # not consumed: it runs now (and frees the memory first)
    assert freed(dev, d0) == (1, nbytes)
    np.testing.assert_array_equal(await x.to_host(), np.full(8, 5.0, np.float32))


async def test_a_renamed_kernel_is_named_by_its_new_name_in_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    x = await api.ones((8,))
    for _ in range(2):
        await add(x.partition((8,)), x, x)
    monkeypatch.setattr(add, "name", "my_add")

    def query(handle: object) -> bool:
        raise trio_cuda.DeviceFault("injected", device=dev.ordinal)

    monkeypatch.setattr(dev._driver, "query", query)
    before = direct()
    with pytest.raises(trio_cuda.DeviceFault) as info:
        await add(x.partition((8,)), x, x)
    assert direct() == before + 1
    assert info.value.op == "my_add"
    monkeypatch.undo()
    await trio.to_thread.run_sync(dev.synchronize)


async def test_a_prepared_gemm_does_not_outlive_its_operands_memory() -> None:
    # A GEMM prepared on some memory is never run on other memory at the same address:
    # new tensors (which may get the freed addresses) make new recipes.
    hw = f32(16, 16)
    w = await api.from_host(hw)
    for round_ in range(3):
        hx = f32(16, 8) + round_
        x, y = await api.from_host(hx), await api.zeros((16, 8))
        for _ in range(3):
            await ops.matmul(w, x, out=y)
        np.testing.assert_allclose(await y.to_host(), hw.astype(np.float64) @ hx, rtol=1e-4, atol=1e-4)
        del x, y
        await tidy(trio_cuda.current_device())


def test_a_prepared_gemm_after_a_reset_is_not_run(dev: trio_cuda.Device) -> None:
    async def rounds() -> None:
        hw, hx = f32(16, 16), f32(16, 8)
        w, x, y = await api.from_host(hw), await api.from_host(hx), await api.zeros((16, 8))
        for _ in range(3):
            await ops.matmul(w, x, out=y)
        np.testing.assert_allclose(await y.to_host(), hw.astype(np.float64) @ hx, rtol=1e-4, atol=1e-4)

    trio.run(rounds)
    dev.reset()
    trio.run(rounds)  # the same shapes and, maybe, the same addresses: new memory, new recipes


@pytest.mark.parametrize("access", ["its output", "its input"])
async def test_work_on_another_stream_waits_for_a_prepared_gemm(monkeypatch: pytest.MonkeyPatch, access: str) -> None:
    # A prepared GEMM queued behind slow work registers its accesses: a later read of
    # its output (read-after-write), or a later write of its input (write-after-read),
    # on another stream waits for it.
    dev = trio_cuda.current_device()
    s_gemm, s_other = dev.create_stream(), dev.create_stream()
    hx, hw = f32(16, 8), f32(16, 16)
    x, w, y = await api.from_host(hx), await api.from_host(hw), await api.zeros((16, 8))
    seen = await api.zeros((16, 8))
    monkeypatch.setattr(dev, "policy", trio_cuda.SingleStream(stream=s_gemm))
    for _ in range(3):
        await ops.matmul(w, x, out=y)  # prepared from the third call
    await ops.copy(await api.zeros((16, 8)), out=y)
    await tidy(dev)
    before = direct()

    async def gemm_behind_slow_work(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await lowlevel.submit(sleep(counter(), SLOW_NS), s_gemm)
        task_status.started()
        # (this task goes on before its parent resumes: a direct await submits before its
        # first schedule point)
        await ops.matmul(w, x, out=y)

    async with trio.open_nursery() as nursery:
        await nursery.start(gemm_behind_slow_work)  # its GEMM is enqueued, behind the sleep
        assert direct() == before + 1
        if access == "its output":
            await lowlevel.submit(ops.copy(y, out=seen), s_other)
        else:
            await lowlevel.submit(ops.multiply(x, 0.0, out=x), s_other)
    expected = hw.astype(np.float64) @ hx
    if access == "its output":
        np.testing.assert_allclose(await seen.to_host(), expected, rtol=1e-4, atol=1e-4)
    else:
        np.testing.assert_allclose(await y.to_host(), expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(await x.to_host(), np.zeros((16, 8), np.float32))
