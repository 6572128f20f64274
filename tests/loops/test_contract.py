"""The await's contract under every loop: trio, asyncio and asyncio on uvloop, through
anyio (whose asyncio backend runs plain asyncio tasks and whose trio backend runs trio).

Each test is a plain function that runs its body with ``run`` (anyio.run on one loop,
with a deadline): pytest-trio's trio mode takes only coroutine tests.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable
from typing import Any

import anyio
import numpy as np
import pytest
import trio.testing

import trio_cuda
from trio_cuda import api, collectives, lowlevel, ops
from trio_cuda.kernels import add, sleep

from ..helpers.devices import counter, needs_devices, settle, started
from ..helpers.faults import scribble
from ..helpers.loads import fresh_kernel, hold_loads
from ..helpers.loops import LOOPS, Run
from ..helpers.stores import MemoryStore

SLOW_NS = 400_000_000


@pytest.fixture(params=LOOPS)
def run(request: pytest.FixtureRequest) -> Run:
    return request.param  # type: ignore[no-any-return]


def test_every_kind_of_op_is_awaitable(run: Run, dev: trio_cuda.Device) -> None:
    async def body() -> None:
        xs = np.arange(8, dtype=np.float32)
        x = await api.from_host(xs)  # creation from host data
        z = await api.zeros((8,))  # creation on the device
        await api.memcpy(z, x)  # a copy
        np.testing.assert_array_equal(await z.to_host(), xs)  # a read-back
        y = await ops.add(x, 1.0)  # ops
        np.testing.assert_array_equal(
            await ops.matmul(y.reshape((2, 4)), y.reshape((4, 2))).to_host(), (xs + 1).reshape(2, 4) @ (xs + 1).reshape(4, 2)
        )
        await add(z.partition((8,)), x, y)  # a kernel
        np.testing.assert_array_equal(await z.to_host(), 2 * xs + 1)
        both = await trio_cuda.zip(api.full((2,), 3.0), api.full((2,), 4.0)).then(lambda ab: ops.add(*ab)).to_host()
        np.testing.assert_array_equal(both, [7, 7])  # a composed DAG
        seen: list[object] = []
        assert await trio_cuda.external(lambda s: seen.append(s) or "ran", writes=[z]) == "ran"  # external work
        assert len(seen) == 1
        out = await api.zeros((8,))
        graph = ops.add(x, y, out=out).graph()  # a graph launch
        assert await graph.launch() is out
        np.testing.assert_array_equal(await out.to_host(), 2 * xs + 1)
        c = await counter()
        sub = await lowlevel.submit(sleep(c, 1000))  # submit, then wait
        await sub.wait()
        np.testing.assert_array_equal(await c.tensor.to_host(), [1])
        t = await (await lowlevel.submit(ops.add(x, 2.0))).wait()
        await t.ready()  # Tensor.ready()
        async with trio_cuda.trace() as tr:  # trace as an async context manager
            await ops.add(x, 3.0)
        assert tr.events is not None and any("add" in str(e.get("name", "")) for e in tr.events["traceEvents"])

    run(body)


@needs_devices(2)
def test_collectives_are_awaitable(run: Run) -> None:
    async def body() -> None:
        group = collectives.Group([0, 1])
        xs = [await api.from_host(np.full(4, d + 1.0, np.float32), device=d) for d in (0, 1)]
        await group.all_reduce(xs)
        for x in xs:
            np.testing.assert_array_equal(await x.to_host(), [3, 3, 3, 3])

    run(body)


@needs_devices(2)
def test_process_groups_join_through_a_store_and_reduce(run: Run) -> None:
    # Two ranks of one process (rank r on device r) joined through a store, as a launcher
    # would join processes; then a join that no other rank answers is cancelled at once.
    async def body() -> None:
        store = MemoryStore()
        groups: list[Any] = [None, None]

        async def join(r: int) -> None:
            groups[r] = await collectives.ProcessGroup.from_store(store, 2, r, device=r, timeout=20)

        async with anyio.create_task_group() as tg:
            for r in (0, 1):
                tg.start_soon(join, r)
        assert [(g.rank, g.nranks) for g in groups] == [(0, 2), (1, 2)]
        xs = [await api.from_host(np.full(4, r + 1.0, np.float32), device=r) for r in (0, 1)]

        async def reduce(r: int) -> None:
            with trio_cuda.use_device(r):
                await groups[r].all_reduce([xs[r]])

        async with anyio.create_task_group() as tg:
            for r in (0, 1):
                tg.start_soon(reduce, r)
        for x in xs:
            np.testing.assert_array_equal(await x.to_host(), [3, 3, 3, 3])
        for g in groups:
            g.close()
        # A join no other rank answers ends at its cancel (long before its timeout), and
        # takes its hello back: the next joins of both ranks through that store meet.
        store = MemoryStore()
        t0 = time.monotonic()
        with anyio.move_on_after(0.2) as scope:
            await collectives.ProcessGroup.from_store(store, 2, 0, device=0, timeout=60)
        assert scope.cancelled_caught and time.monotonic() - t0 < 5
        async with anyio.create_task_group() as tg:
            for r in (0, 1):
                tg.start_soon(join, r)
        assert [(g.rank, g.nranks) for g in groups] == [(0, 2), (1, 2)]
        for g in groups:
            g.close()

    run(body)


def test_cancelled_before_submission_runs_nothing(run: Run, dev: trio_cuda.Device) -> None:
    async def body() -> None:
        c = await counter()
        before = dev.statistics().submissions
        op = sleep(c, 1000)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await op
        assert scope.cancelled_caught
        assert dev.statistics().submissions == before  # nothing was submitted
        await op  # not consumed: it runs now, once
        np.testing.assert_array_equal(await c.tensor.to_host(), [1])

    run(body)


def test_cancelled_after_submission_returns_promptly_and_memory_outlives_the_work(run: Run, dev: trio_cuda.Device) -> None:
    async def body() -> None:
        await sleep(counter(), 1000)  # (compiled and loaded)
        await anyio.to_thread.run_sync(settle)
        baseline = dev.memory_in_use()
        c = await counter()
        start = time.perf_counter()
        with anyio.move_on_after(0.05) as scope:
            await sleep(c, SLOW_NS).then(lambda _: api.zeros((1 << 16,)))
        elapsed = time.perf_counter() - start
        assert scope.cancelled_caught
        assert elapsed < SLOW_NS / 2e9, f"the cancelled await took {elapsed:.3f} s"
        del c
        gc.collect()
        assert dev.memory_in_use() > baseline  # the pending work's memory is still held
        await anyio.to_thread.run_sync(settle)
        assert dev.memory_in_use() == baseline  # and let go once the GPU is done

    run(body)


async def _done_submission() -> tuple[trio_cuda.Tensor, Any, Any]:
    """A tensor of zeros, a submitted ``x + 1`` whose work is done, and its event."""
    x = await api.zeros((4,))
    await x.ready()
    sub = await lowlevel.submit(ops.add(x, 1.0))
    await anyio.to_thread.run_sync(settle)
    assert sub.event is not None
    return x, sub, sub.event


def test_every_await_is_a_cancellation_point(run: Run) -> None:
    async def body() -> None:
        x, sub, done = await _done_submission()
        for await_it in (x.ready, lambda: ops.add(x, 1.0), lambda: trio_cuda.value(3), sub.wait, lambda: lowlevel.wait(done)):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await await_it()  # (nothing pending, new work, or work done: all raise the cancel)
            assert scope.cancelled_caught
        np.testing.assert_array_equal(await (await sub.wait()).to_host(), [1, 1, 1, 1])  # (not taken by the cancelled wait)
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with trio_cuda.trace():
                pytest.fail("a cancelled task opened a trace")
        assert scope.cancelled_caught

    run(body)


def test_every_await_is_a_schedule_point(run: Run) -> None:
    # Also where nothing waits: no work, work complete already, a trace of nothing.
    async def body() -> None:
        x, sub, event = await _done_submission()

        async def trace_nothing() -> None:
            async with trio_cuda.trace():
                pass

        forms = {
            "value": lambda: trio_cuda.value(3),
            "ready": x.ready,
            "done": sub.wait,
            "event": lambda: lowlevel.wait(event),
            "trace": trace_nothing,
        }
        for name, await_it in forms.items():
            if run.backend == "trio":  # (trio runs the tasks of a batch in any order)
                with trio.testing.assert_checkpoints():
                    await await_it()
                continue
            ran: list[str] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_append, ran, name)  # (asyncio runs it as soon as this task yields)
                await await_it()
                assert ran == [name], f"awaiting {name} let no other task run"

    run(body)


def test_the_loop_runs_other_tasks_while_long_work_is_awaited(run: Run) -> None:
    async def body() -> None:
        await sleep(counter(), 1000)
        ticks = 0
        c = await counter()

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.sleep(0.005)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await sleep(c, 200_000_000)
            tg.cancel_scope.cancel()
        assert ticks >= 10, f"the loop ran {ticks} ticks of 5 ms during a 200 ms kernel"

    run(body)


@pytest.mark.parametrize("budget", [None, 0])
def test_many_tasks_get_their_own_results(run: Run, budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda import _notifier

    if budget is not None:  # every wait parks on the notifier
        monkeypatch.setattr(_notifier, "_budget_ns", budget)
    results: dict[int, np.ndarray] = {}

    async def task(i: int) -> None:
        x = await api.full((16,), float(i))
        for _ in range(3):
            x = await ops.add(x, 1.0)
        results[i] = await x.to_host()

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(task, i)

    run(body)
    assert sorted(results) == list(range(64))
    for i, r in results.items():
        np.testing.assert_array_equal(r, np.full(16, i + 3.0, np.float32))


def test_writes_then_reads_across_tasks_are_ordered(run: Run) -> None:
    async def body() -> None:
        c = await counter()
        async with anyio.create_task_group() as tg:
            await tg.start(started, sleep(c, 50_000_000))  # submitted: later reads see it
            got = await c.tensor.to_host()
        np.testing.assert_array_equal(got, [1])

    run(body)


def test_long_work_is_slept_through(run: Run) -> None:
    async def body() -> None:
        c = await counter()
        for _ in range(4):  # learned from the first ones: the later ones sleep on a timer
            await (await lowlevel.submit(sleep(c, 30_000_000))).wait()
        np.testing.assert_array_equal(await c.tensor.to_host(), [4])

    before = lowlevel.notifier_statistics().sleeping.timed
    run(body)
    assert lowlevel.notifier_statistics().sleeping.timed > before


def test_bad_input_raises_before_any_work(run: Run, dev: trio_cuda.Device) -> None:
    async def body() -> None:
        x = await api.zeros((4,))
        before = dev.statistics().submissions
        with pytest.raises(ValueError):
            await ops.add(x, api.zeros((5,)))
        with pytest.raises(TypeError):
            await ops.add(x, "one")  # type: ignore[arg-type]
        assert dev.statistics().submissions == before

    run(body)


def test_blocking_calls_are_refused_on_the_loop_thread(run: Run, dev: trio_cuda.Device) -> None:
    stream = dev.create_stream()
    c = counter().sync()
    calls: dict[str, Any] = {
        "op.sync()": lambda: api.zeros((2,)).sync(),
        "op.sync_on()": lambda: api.zeros((2,)).sync_on(stream),
        "Device.synchronize()": dev.synchronize,
        "Stream.synchronize()": stream.synchronize,
        "Device.reset()": dev.reset,
        "Kernel.prepare()": lambda: sleep.prepare(c, 1000),
    }

    async def body() -> dict[str, str]:
        refused = {}
        for name, call in calls.items():
            with pytest.raises(RuntimeError, match="would block") as info:
                call()
            refused[name] = str(info.value)
        # From a worker thread of the loop, the same call works.
        out = await anyio.to_thread.run_sync(lambda: api.full((2,), 5.0).to_host().sync())
        np.testing.assert_array_equal(out, [5, 5])
        return refused

    refused = run(body)
    hint = ["trio.to_thread"] if run.backend == "trio" else ["asyncio.to_thread", "anyio.to_thread.run_sync"]
    for name, message in refused.items():
        assert message.startswith(f"{name} would block the {run.backend} event loop"), message
        assert all(h in message for h in hint), message


@pytest.mark.faults_device
def test_a_fault_reaches_every_awaiter_and_the_task_group_cancels_siblings(run: Run, dev: trio_cuda.Device) -> None:
    outcome: list[str] = []
    # (the waiters' streams made before any long kernel runs: making a stream can wait for it)
    own = [trio_cuda.SingleStream(dev) for _ in range(2)]

    async def waiter(policy: trio_cuda.SingleStream, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await started(sleep(counter(), 3_000_000_000), policy, task_status=task_status)
        except trio_cuda.DeviceFault:
            outcome.append("fault")

    async def sibling(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            outcome.append("cancelled")
            raise

    async def body() -> None:
        target = await api.zeros((32,))
        await anyio.to_thread.run_sync(scribble.prepare, target.partition((32,)))
        await sleep(counter(), 1000)
        async with anyio.create_task_group() as waiters:  # (not cancelled by the fault)
            for policy in own:
                await waiters.start(waiter, policy)
            with pytest.raises(BaseExceptionGroup) as info:
                async with anyio.create_task_group() as tg:
                    await tg.start(sibling)
                    tg.start_soon(_await, scribble(target.partition((32,))))
        assert info.value.subgroup(trio_cuda.DeviceFault) is not None

    start = time.perf_counter()
    run(body)
    assert time.perf_counter() - start < 2.5, "the waiters of 3 s kernels were not woken by the fault"
    assert sorted(outcome) == ["cancelled", "fault", "fault"]


@pytest.mark.faults_device
def test_a_reset_wakes_waiters_with_device_reset(run: Run, dev: trio_cuda.Device) -> None:
    got: list[BaseException] = []

    async def waiter(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await started(sleep(counter(), SLOW_NS).first().to_host(), task_status=task_status)
        except trio_cuda.DeviceReset as err:
            got.append(err)

    async def body() -> None:
        await sleep(counter(), 1000)
        async with anyio.create_task_group() as outer:
            with anyio.fail_after(SLOW_NS / 2e9):  # long before the kernels could end
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        await tg.start(waiter)
                    # The reset itself may take as long as the device's running work (CUDA
                    # tears the context down); the waiters must not wait for it.
                    outer.start_soon(anyio.to_thread.run_sync, dev.reset)
        np.testing.assert_array_equal(await api.full((3,), 2.0).to_host(), [2, 2, 2])

    run(body)
    assert len(got) == 3 and all(e.device == dev.ordinal for e in got)


def test_a_submission_relied_on_whose_wait_fails_fails_its_dependents(
    run: Run, dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A waits for its kernel's first load; B, planned meanwhile, relies on A's plan. A is
    # cancelled, so it goes on for B (shielded: under anyio on asyncio, asleep, though its
    # scope cancels it again at every pass of the loop); then the load fails: both raise
    # that error, and a later consumer too, instead of waiting for A's plan forever.
    k = fresh_kernel()
    release = hold_loads(dev, monkeypatch, trio_cuda.LaunchError("the module does not load", device=dev.ordinal))
    got: dict[str, BaseException] = {}

    async def consume(name: str, shared: Any, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await shared
            except trio_cuda.LaunchError as err:
                got[name] = err

    async def body() -> None:
        x = await api.full((8,), 2.0)
        shared = k(api.empty((8,)).partition((8,)), x).first().unpartition().shared()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                a = await tg.start(consume, "a", shared)
                await anyio.wait_all_tasks_blocked()  # A waits for the load
                await tg.start(consume, "b", shared)
                await anyio.wait_all_tasks_blocked()  # B waits for A's plan
                a.cancel()
                await anyio.wait_all_tasks_blocked()  # A goes on for B
                release()
            with pytest.raises(trio_cuda.LaunchError, match="does not load"):
                await shared.to_host()
        monkeypatch.undo()  # the next load works: nothing was left holding the kernel or x
        out = await api.zeros((8,))
        await k(out.partition((8,)), x)
        np.testing.assert_array_equal(await out.to_host(), np.full(8, 4.0, np.float32))

    run(body)
    assert sorted(got) == ["a", "b"]
    assert all("does not load" in str(e) for e in got.values())


def test_many_tasks_waiting_for_one_submission_do_not_starve_it_of_threads(
    run: Run, dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # P compiles its kernel; A waits for P's submission (A's input is P's shared op),
    # then must compile a kernel of its own; 50 tasks wait for A's. Waiting for another
    # submission took a worker thread: the 50 took every one (trio's 40, the asyncio
    # executor's few), and A's compilation never got one.
    k1, k2 = fresh_kernel(), fresh_kernel()
    release = hold_loads(dev, monkeypatch)
    xs = np.arange(8, dtype=np.float32)
    results: list[np.ndarray] = []

    async def consume(op: Any) -> None:
        results.append(await op)

    async def body() -> None:
        x = await api.from_host(xs)
        p = k1(api.empty((8,)).partition((8,)), x).first().unpartition().shared()
        a = k2(api.empty((8,)).partition((8,)), p).first().unpartition().shared()
        before = lowlevel.submission_statistics().waited_for_submission
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, p)
                await anyio.wait_all_tasks_blocked()  # P waits for its kernel
                tg.start_soon(consume, a)
                await anyio.wait_all_tasks_blocked()  # A waits for P
                for _ in range(50):
                    tg.start_soon(consume, a.to_host())
                await anyio.wait_all_tasks_blocked()  # and 50 wait for A
                assert lowlevel.submission_statistics().waited_for_submission == before + 51
                release()

    run(body)
    read_back = [r for r in results if isinstance(r, np.ndarray)]
    assert len(results) == 52 and len(read_back) == 50
    for r in read_back:
        np.testing.assert_array_equal(r, 4 * xs)


def test_outside_any_loop_the_error_says_what_to_do() -> None:
    coro = _await(api.zeros((2,)))
    with pytest.raises(RuntimeError, match="trio or asyncio"):
        coro.send(None)
    coro.close()


async def _await(op: Awaitable[Any]) -> Any:
    return await op


async def _append(to: list[str], item: str) -> None:
    to.append(item)
