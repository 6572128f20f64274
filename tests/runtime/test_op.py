"""DeviceOp: laziness, entry points, combinators, execute-once semantics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, saxpy, sleep

from ..helpers.devices import counter, snapshot
from ..helpers.faults import child


async def test_constructing_ops_does_nothing(dev: trio_cuda.Device) -> None:
    before = snapshot(dev)
    x = api.ones((8, 8))
    z = add(api.zeros((8, 8)).partition((4, 4)), x, api.full((8, 8), 3.0))
    op = z.first().unpartition().then(lambda t: saxpy(2.0, t, api.zeros((8, 8)).partition((4, 4))))
    pipeline = trio_cuda.zip(op.shared(), api.arange(4).to_host()).map(lambda v: v)
    a, b = pipeline.unzip(2)
    _ = (a.first(), b.map(len), api.from_host(np.ones(3)), api.dup(api.ones(2)), api.memcpy(api.ones(2), np.ones(2, np.float32)))
    await trio.testing.wait_all_tasks_blocked()
    assert snapshot(dev) == before


async def test_await_runs_and_returns_output() -> None:
    t = await api.full((2, 3), 7.0)
    assert isinstance(t, trio_cuda.Tensor)
    assert t.shape == (2, 3) and t.dtype == np.float32
    np.testing.assert_array_equal(await t.to_host(), np.full((2, 3), 7.0, np.float32))


async def test_await_is_a_checkpoint_even_for_known_values() -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await trio_cuda.value(1)
        pytest.fail("await of a known value did not reach a cancel point")
    assert scope.cancelled_caught


async def test_await_known_value_is_a_schedule_point() -> None:
    # A task that only awaits known values must still let other tasks run.
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    async with trio.open_nursery() as n:
        n.start_soon(other)
        for _ in range(20):
            assert await trio_cuda.value(5) == 5
            if ran:
                break
        assert ran


async def test_cancelled_before_submission_submits_nothing(dev: trio_cuda.Device) -> None:
    op = add(api.zeros((4, 4)).partition((2, 2)), api.ones((4, 4)), api.ones((4, 4)))
    before = snapshot(dev)
    with trio.CancelScope() as scope:
        scope.cancel()
        await op
    assert scope.cancelled_caught
    assert snapshot(dev) == before
    # The op was not consumed: it can still run.
    z, _, _ = await op
    np.testing.assert_array_equal(await z.to_host(), np.full((4, 4), 2.0, np.float32))


def test_sync_from_plain_code() -> None:
    z = add(api.zeros((4,)).partition((2,)), api.ones((4,)), api.ones((4,))).first().to_host().sync()
    np.testing.assert_array_equal(z, np.full(4, 2.0, np.float32))


async def test_sync_inside_trio_raises_instead_of_blocking(dev: trio_cuda.Device) -> None:
    op = api.ones((2,))
    before = snapshot(dev)
    with pytest.raises(RuntimeError, match="would block the trio event loop"):
        op.sync()
    assert snapshot(dev) == before


async def test_sync_in_a_worker_thread_of_trio() -> None:
    op = api.full((3,), 4.0).to_host()
    out = await trio.to_thread.run_sync(op.sync)
    np.testing.assert_array_equal(out, np.full(3, 4.0, np.float32))


def test_sync_on_uses_the_given_stream(dev: trio_cuda.Device) -> None:
    s = dev.create_stream()
    before = s.seq
    t = api.ones((4,)).sync_on(s)
    assert s.seq > before
    writer, _ = lowlevel.accesses(t)
    assert writer is not None and writer[0] is s
    with pytest.raises(TypeError, match="Stream"):
        api.ones((4,)).sync_on("stream")  # type: ignore[arg-type]


async def test_schedule_binds_a_stream_without_submitting(dev: trio_cuda.Device) -> None:
    policy = trio_cuda.SingleStream(dev)
    before = snapshot(dev)
    scheduled = api.ones((4,)).schedule(policy)
    assert isinstance(scheduled, trio_cuda.ScheduledOp)
    assert scheduled.stream is policy.streams[0]
    assert snapshot(dev) == before
    t = await scheduled
    writer, _ = lowlevel.accesses(t)
    assert writer is not None and writer[0] is policy.streams[0]
    with pytest.raises(TypeError):
        api.ones((1,)).schedule("round robin")  # type: ignore[arg-type]


def test_schedule_then_sync(dev: trio_cuda.Device) -> None:
    policy = trio_cuda.SingleStream(dev)
    out = api.full((2,), 9, np.int64).to_host().schedule(policy).sync()
    np.testing.assert_array_equal(out, [9, 9])


@pytest.mark.parametrize(
    "make",
    [
        lambda x: trio_cuda.value(3),
        lambda x: trio_cuda.zip(api.zeros((2,)), api.ones((2,))),
        lambda x: add(x.partition((4,)), x, x),
        lambda x: api.zeros((2,)).to_host(),
        lambda x: trio_cuda.ops.topk(x, 2),
        lambda x: trio_cuda.external(lambda s: None, reads=(x,)),
        lambda x: trio_cuda.ops.sgd_step([x], [api.zeros((4,)).sync()], lr=0.1),
        lambda x: x[:1].item(),
        lambda x: api.ones((1,)).item(),
        lambda x: api.memcpy(np.zeros(4, np.float32), x),
        lambda x: add(x.partition((4,)), x, x).graph().launch(),
        lambda x: trio_cuda.zip(api.zeros((2,))).shared(),
        lambda x: trio_cuda.ops.topk(x, 2).shared(),
    ],
    ids=[
        "value(3)",
        "zip",
        "kernel launch",
        "to_host",
        "topk",
        "external",
        "optimizer step",
        "tensor item",
        "op item",
        "memcpy to the host",
        "graph of a launch",
        "shared zip",
        "shared topk",
    ],
)
def test_ops_whose_output_is_no_tensor_have_no_tensor_methods(make: Callable[[trio_cuda.Tensor], object]) -> None:
    op = make(api.zeros((4,)).sync())
    assert isinstance(op, trio_cuda.DeviceOp) and not isinstance(op, trio_cuda.TensorValuedOp)
    for name in ("softmax", "relu", "sum", "reshape", "T", "__add__", "astype"):
        assert not hasattr(op, name), name
    with pytest.raises(TypeError):
        op + 1  # type: ignore[operator]
    with pytest.raises(TypeError):
        op < 1  # type: ignore[operator]  # noqa: B015


def test_an_op_without_tensor_methods_is_still_an_operand_of_comparisons_and_indexing() -> None:
    # ``==`` compares elementwise as ``+`` adds (not an identity test giving False), and
    # an op in an index is a gather's index: one whose output is no tensor fails saying so
    x = api.arange(4).sync()
    np.testing.assert_array_equal((x == trio_cuda.value(3)).to_host().sync(), [False, False, False, True])
    np.testing.assert_array_equal((x < trio_cuda.value(2)).to_host().sync(), [True, True, False, False])
    for op in (x == trio_cuda.ops.topk(x, 2), x[trio_cuda.ops.topk(x, 2)], x[:, trio_cuda.zip(api.zeros((2,)))]):
        with pytest.raises(TypeError, match=r"pick the tensor with \.first\(\)"):
            op.sync()


def test_tensor_valued_ops_have_the_tensor_methods() -> None:
    x = api.zeros((4,)).sync()
    for op in (
        api.zeros((4,)),
        trio_cuda.ops.relu(x),
        trio_cuda.value(x),
        add(x.partition((4,)), x, x).first(),
        api.ones((4,)).then(lambda t: t),
        api.memcpy(x, np.ones(4, np.float32)),
        trio_cuda.ops.relu(x, out=x).graph().launch(),
        api.zeros((4,)).shared(),
        trio_cuda.zip(api.zeros((4,)), api.ones((4,))).unzip()[1],
    ):
        assert isinstance(op, trio_cuda.TensorValuedOp)
    y = (trio_cuda.ops.relu(x) + 1).softmax()
    np.testing.assert_allclose(y.to_host().sync(), np.full(4, 0.25, np.float32))


async def test_op_is_single_use() -> None:
    op = api.ones((2,))
    await op
    with pytest.raises(trio_cuda.OpAlreadyExecuted, match="shared"):
        await op


async def test_zip_of_the_same_plain_op_twice_is_an_error() -> None:
    op = api.ones((2,))
    with pytest.raises(trio_cuda.OpAlreadyExecuted):
        await trio_cuda.zip(op, op)


async def test_then_chain_keeps_order_and_one_stream(dev: trio_cuda.Device) -> None:
    # Each step reads the previous step's output: any reordering changes the result.
    x = await api.ones((8,))
    op = api.zeros((8,)).partition((4,))
    for _ in range(5):
        op = op.then(lambda out: saxpy(2.0, x, out[2] if isinstance(out, tuple) else out))
    waits_before = dev.statistics().stream_waits
    (y,) = (await op.last().unpartition().to_host(),)
    np.testing.assert_array_equal(y, np.full(8, 10.0, np.float32))
    # A then-chain stays on one stream: no cross-stream waits were needed.
    assert dev.statistics().stream_waits == waits_before


async def test_then_callback_gets_the_output_and_may_return_a_value() -> None:
    seen = []
    out = await api.ones((3,)).then(lambda t: seen.append(t.shape) or "done")
    assert out == "done" and seen == [(3,)]


async def test_then_callback_must_not_be_async() -> None:
    async def cb(t: object) -> None:
        pass

    with pytest.raises(TypeError, match="synchronous"):
        await api.ones((1,)).then(cb)  # type: ignore[arg-type]


async def test_executing_inside_a_then_callback_is_an_error() -> None:
    def cb(t: trio_cuda.Tensor) -> object:
        return api.ones((1,)).sync()

    with pytest.raises(trio_cuda.NestedExecutionError, match="callback"):
        await api.ones((1,)).then(cb)


async def test_deep_chains_do_not_recurse() -> None:
    op = trio_cuda.value(0)
    for _ in range(5000):
        op = op.then(lambda v: trio_cuda.value(v + 1)).map(lambda v: v)
    assert await op == 5000


async def test_map_transforms_on_the_host() -> None:
    assert await trio_cuda.value((1, 2)).map(sum) == 3
    with pytest.raises(TypeError, match="use then"):
        await trio_cuda.value(1).map(lambda v: api.ones((1,)))


async def test_map_over_read_back_runs_after_completion() -> None:
    total = await api.arange(10).to_host().map(lambda a: float(a.sum()))
    assert total == 45.0


async def test_then_over_read_back_is_refused() -> None:
    with pytest.raises(TypeError, match="to_host"):
        await api.arange(3).to_host().then(lambda a: trio_cuda.value(a))


async def test_first_last_and_zip() -> None:
    z = trio_cuda.zip(api.full((2,), 1.0), api.full((3,), 2.0), trio_cuda.value("tag"))
    a, b, tag = await z
    assert (a.shape, b.shape, tag) == ((2,), (3,), "tag")
    assert await trio_cuda.value((1, 2, 3)).first() == 1
    assert await trio_cuda.value((1, 2, 3)).last() == 3
    with pytest.raises(TypeError, match="tuple"):
        await trio_cuda.value(5).first()
    with pytest.raises(TypeError):
        trio_cuda.zip()


async def test_zip_of_read_backs_and_first() -> None:
    host = await trio_cuda.zip(api.full((2,), 1.0).to_host(), api.full((2,), 5.0).to_host()).last()
    np.testing.assert_array_equal(host, [5.0, 5.0])


async def test_unzip_executes_upstream_once(dev: trio_cuda.Device) -> None:
    upstream = add(api.zeros((4,)).partition((2,)), api.ones((4,)), api.ones((4,)))
    z, x, y = upstream.unzip()
    before = dev.statistics().launches
    # Consumers in reverse order and in separate awaits.
    y_t = await y
    z_t = await z.unpartition()
    x_t = await x
    assert dev.statistics().launches == before + 1
    np.testing.assert_array_equal(await z_t.to_host(), [2, 2, 2, 2])
    assert x_t.shape == y_t.shape == (4,)


async def test_unzip_arity_rules() -> None:
    with pytest.raises(TypeError, match="needs n"):
        api.ones((2,)).then(lambda t: (t, t)).unzip()
    a, b = api.ones((2,)).then(lambda t: (t, t)).unzip(2)
    assert (await a) is (await b)
    with pytest.raises(ValueError, match="unzip\\(3\\)"):
        trio_cuda.zip(api.ones((1,)), api.ones((1,))).unzip(3)
    c, _d, _e = trio_cuda.value((1, 2)).map(lambda v: v).unzip(3)
    with pytest.raises(ValueError, match="2 elements"):
        await c


async def test_shared_executes_once_for_any_number_and_order_of_consumers(dev: trio_cuda.Device) -> None:
    base = api.arange(8).shared()
    before = dev.statistics().allocations
    results = []

    async def consumer(i: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        t = await base
        results.append(await t.to_host())

    async with trio.open_nursery() as n:
        for i in range(5):
            await n.start(consumer, i)
    assert dev.statistics().allocations == before + 1
    for r in results:
        np.testing.assert_array_equal(r, np.arange(8, dtype=np.float32))
    assert (await base) is (await base)
    assert base.shared() is base


async def test_shared_failure_is_seen_by_every_consumer() -> None:
    def boom(_: object) -> object:
        raise KeyError("boom")

    op = api.ones((1,)).then(boom).shared()
    for _ in range(2):
        with pytest.raises(KeyError):
            await op


async def test_diamond_executes_each_node_once(dev: trio_cuda.Device) -> None:
    # zip -> unzip -> per-branch work -> zip
    n = 8
    source = trio_cuda.zip(api.arange(n), api.full((n,), 10.0))
    left, right = source.unzip()
    left2 = left.then(lambda x: add(api.zeros((n,)).partition((4,)), x, x)).first().unpartition()
    right2 = right.then(lambda y: saxpy(3.0, y, api.ones((n,)).partition((4,)))).last().unpartition()
    joined = trio_cuda.zip(left2, right2, left)
    before = dev.statistics()
    l2, r2, l_again = await joined
    after = dev.statistics()
    assert after.launches - before.launches == 2
    # arange, full, two zeros/ones outputs: four allocations, the sources once each.
    assert after.allocations - before.allocations == 4
    np.testing.assert_array_equal(await l2.to_host(), 2 * np.arange(n, dtype=np.float32))
    np.testing.assert_array_equal(await r2.to_host(), np.full(n, 31.0, np.float32))
    np.testing.assert_array_equal(await l_again.to_host(), np.arange(n, dtype=np.float32))


async def test_many_tasks_await_concurrently() -> None:
    results: dict[int, np.ndarray] = {}

    async def task(i: int) -> None:
        results[i] = await api.full((4,), float(i)).to_host()

    async with trio.open_nursery() as n:
        for i in range(32):
            n.start_soon(task, i)
    assert sorted(results) == list(range(32))
    for i, r in results.items():
        np.testing.assert_array_equal(r, np.full(4, float(i), np.float32))


def test_sync_from_several_threads() -> None:
    out: list[np.ndarray] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        r = api.full((3,), float(i)).to_host().sync()
        with lock:
            out.append(r)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(float(r[0]) for r in out) == [float(i) for i in range(8)]


async def test_sleep_kernel_counts(dev: trio_cuda.Device) -> None:

    c = await counter()
    for _ in range(3):
        await sleep(c, 1000)
    np.testing.assert_array_equal(await c.to_host(), [3])


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial.py)
# ======================================================================================
T = TypeVar("T")
MB = 1 << 20


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
