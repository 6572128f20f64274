"""Scheduling policies, stream overlap, devices and the current device."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, ops
from trio_cuda.kernels import saxpy, sleep

from ..helpers.devices import counter, needs_devices

SLOW_NS = 300_000_000  # 0.3 s


async def slow_op(ns: int = SLOW_NS) -> np.ndarray:
    return await sleep(counter(), ns).first().to_host()


@contextlib.contextmanager
def policy(dev: trio_cuda.Device, p: trio_cuda.SchedulingPolicy) -> Iterator[trio_cuda.SchedulingPolicy]:
    """``dev`` schedules with ``p`` inside the block, with its own policy again after."""
    old = dev.policy
    dev.policy = p
    try:
        yield p
    finally:
        dev.policy = old


async def two_slow_ops() -> float:
    """Seconds that two independent slow ops, awaited by two tasks at once, take."""
    start = time.perf_counter()
    async with trio.open_nursery() as n:
        n.start_soon(slow_op)
        n.start_soon(slow_op)
    return time.perf_counter() - start


def test_default_policy_chooses_by_load() -> None:
    # (a fresh device, in a child: the shared test device's pool may have grown)
    code = (
        "import trio_cuda\n"
        "p = trio_cuda.current_device().policy\n"
        "print(type(p).__name__, len(p.streams), p.statistics().streams)\n"
    )
    env = dict(os.environ, TRIO_CUDA_QUIET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["StreamPoolByLoad", "4", "4"]


def test_round_robin_rotates_over_its_pool(dev: trio_cuda.Device) -> None:
    p = trio_cuda.StreamPoolRoundRobin(dev)
    assert len(p.streams) == 4
    picks = [p.next_stream() for _ in range(8)]
    assert picks[:4] == picks[4:]
    assert len(set(picks[:4])) == 4


def test_single_stream_pins(dev: trio_cuda.Device) -> None:
    p = trio_cuda.SingleStream(dev)
    assert {p.next_stream() for _ in range(5)} == {p.streams[0]}
    s = dev.create_stream()
    assert trio_cuda.SingleStream(stream=s).next_stream() is s


def test_policy_arguments_are_checked(dev: trio_cuda.Device) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        trio_cuda.StreamPoolRoundRobin(dev, 0)
    with pytest.raises(TypeError, match="num_streams"):
        trio_cuda.StreamPoolRoundRobin(dev, 2.0)  # type: ignore[arg-type]
    assert len(trio_cuda.StreamPoolRoundRobin(dev, np.int64(2)).streams) == 2
    with pytest.raises(TypeError, match="SchedulingPolicy"):
        dev.policy = "fast"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="Stream"):
        trio_cuda.SingleStream(stream=3)  # type: ignore[arg-type]


async def test_independent_slow_ops_overlap_on_the_pool(dev: trio_cuda.Device) -> None:
    # A pool of its own: earlier tests leave long kernels running on the device's pool
    # (cancelled awaits), and a pool at its cap may have to queue behind one of them.
    with policy(dev, trio_cuda.StreamPoolByLoad(dev)):
        await slow_op(1000)  # warm up
        elapsed = await two_slow_ops()
    assert elapsed < 1.6 * SLOW_NS / 1e9, f"two slow ops took {elapsed:.3f} s: no overlap"


async def test_single_stream_serializes(dev: trio_cuda.Device) -> None:
    with policy(dev, trio_cuda.SingleStream(dev)):
        elapsed = await two_slow_ops()
    assert elapsed >= 1.9 * SLOW_NS / 1e9


async def test_zip_branches_overlap(dev: trio_cuda.Device) -> None:
    # A pool of its own: earlier tests leave long kernels running on the device's pool.
    with policy(dev, trio_cuda.StreamPoolByLoad(dev)):
        await slow_op(1000)  # warm up
        start = time.perf_counter()
        a, b = await trio_cuda.zip(sleep(counter(), SLOW_NS).first(), sleep(counter(), SLOW_NS).first())
        elapsed = time.perf_counter() - start
    assert elapsed < 1.6 * SLOW_NS / 1e9
    np.testing.assert_array_equal(await a.to_host(), [1])
    np.testing.assert_array_equal(await b.to_host(), [1])


async def test_current_device_and_use_device() -> None:
    assert trio_cuda.current_device() is trio_cuda.device(0)
    last = trio_cuda.device(trio_cuda.device_count() - 1)
    with trio_cuda.use_device(last) as d:
        assert d is last and trio_cuda.current_device() is last
        t = await api.ones((2,))
        assert t.device is last

        seen = []

        async def child() -> None:
            seen.append(trio_cuda.current_device())

        async with trio.open_nursery() as n:
            n.start_soon(child)
        assert seen == [last]
    assert trio_cuda.current_device() is trio_cuda.device(0)


def test_device_lookup_errors() -> None:
    with pytest.raises(ValueError, match="no device"):
        trio_cuda.device(trio_cuda.device_count())
    with pytest.raises(TypeError):
        trio_cuda.device("0")  # type: ignore[arg-type]
    assert trio_cuda.devices() == [trio_cuda.device(i) for i in range(trio_cuda.device_count())]


@needs_devices(2)
def test_policy_is_per_device() -> None:
    d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
    assert d0.policy.device is d0 and d1.policy.device is d1
    with pytest.raises(ValueError, match="device"):
        d0.policy = trio_cuda.SingleStream(d1)


@needs_devices(3)
async def test_several_devices_work_concurrently() -> None:
    results: dict[int, np.ndarray] = {}

    async def on_device(i: int) -> None:
        with trio_cuda.use_device(i):
            x = await api.full((8,), float(i))
            y = await saxpy(2.0, x, api.ones((8,)).partition((4,))).last().unpartition()
            assert y.device is trio_cuda.device(i)
            await sleep(counter(), SLOW_NS)
            results[i] = await y.to_host()

    start = time.perf_counter()
    async with trio.open_nursery() as n:
        for i in range(3):
            n.start_soon(on_device, i)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.2 * SLOW_NS / 1e9, f"three devices took {elapsed:.3f} s"
    for i in range(3):
        np.testing.assert_array_equal(results[i], np.full(8, 2.0 * i + 1, np.float32))


async def test_one_await_after_another_stays_on_one_pool_stream(dev: trio_cuda.Device) -> None:
    # The pool hands a submission the previous submission's stream while that stream is
    # known idle: serial awaits do not hop over the pool (each hop costs ~3 us on an H200).
    old = dev.policy
    p = dev.policy = trio_cuda.StreamPoolRoundRobin(dev)
    try:
        x = await api.zeros((64,))
        before = [s.seq for s in p.streams]
        for _ in range(6):
            await ops.add(x, 1.0, out=x)
        moved = [s for s, b in zip(p.streams, before, strict=True) if s.seq != b]
        assert len(moved) == 1, f"{len(moved)} pool streams used by 6 serial awaits"
        np.testing.assert_array_equal(await x.to_host(), np.full(64, 6.0, np.float32))
        assert len({p.next_stream() for _ in range(4)}) == 4  # branches still rotate
    finally:
        dev.policy = old


async def test_submissions_while_work_runs_spread_over_the_pool(dev: trio_cuda.Device) -> None:
    old = dev.policy
    p = dev.policy = trio_cuda.StreamPoolRoundRobin(dev)
    try:
        counters = [await counter() for _ in range(8)]
        before = [s.seq for s in p.streams]
        async with trio.open_nursery() as nursery:
            for c in counters:  # all submitted before any of them completes (0.3 s each)
                nursery.start_soon(_await, sleep(c, SLOW_NS))
        moved = [s for s, b in zip(p.streams, before, strict=True) if s.seq != b]
        assert len(moved) == 4, f"8 concurrent submissions used {len(moved)} of the 4 pool streams"
        for c in counters:
            np.testing.assert_array_equal(await c.tensor.to_host(), [1])
    finally:
        dev.policy = old


async def _await(op: object) -> None:
    await op  # type: ignore[misc]


# -- StreamPoolByLoad: streams chosen by what is pending on them ----------------------------


async def _hold(pool: trio_cuda.StreamPoolByLoad, task_status: trio.TaskStatus[tuple[trio_cuda.Stream, object]]) -> None:
    """Submit a long kernel on the stream the pool gives this task; report (stream, its
    Submitted); wait for it."""
    c = await counter()
    s = pool.submission_stream()
    sub = await trio_cuda.lowlevel.submit(sleep(c, SLOW_NS), s)
    task_status.started((s, sub))
    await sub.wait()


async def test_by_load_never_queues_behind_another_tasks_pending_work(dev: trio_cuda.Device) -> None:
    pool = trio_cuda.StreamPoolByLoad(dev, num_streams=2, max_streams=8)
    await counter()  # (the device's own policy made its streams)
    live = dev.statistics().streams
    async with trio.open_nursery() as n:
        held = [await n.start(_hold, pool) for _ in range(3)]
        busy = {s for s, _ in held}
        assert len(busy) == 3  # three tasks, three streams: none shares another's pending kernel
        st = pool.statistics()
        assert st.streams == 3 and st.grown == 1  # two in use at once, one grown
        # Growing made no stream while the kernels ran (making one can block the loop
        # until the device's work completes): the pool made all eight with itself.
        assert dev.statistics().streams == live
        mine = pool.submission_stream()  # this task: no pending work anywhere
        assert mine not in busy
        assert all(not sub.event.query() for _, sub in held)  # (they were pending all along)


async def test_by_load_grows_for_overlap_then_keeps_a_task_on_its_own_busy_stream(dev: trio_cuda.Device) -> None:
    pool = trio_cuda.StreamPoolByLoad(dev, num_streams=1, max_streams=2)
    c = await counter()
    s = pool.submission_stream()
    sub = await trio_cuda.lowlevel.submit(sleep(c, SLOW_NS), s)
    # Its own stream busy, none idle, room to grow: a new stream (the next work overlaps).
    other = pool.submission_stream()
    assert other is not s and pool.statistics().grown == 1
    sub2 = await trio_cuda.lowlevel.submit(sleep(await counter(), SLOW_NS), other)
    # At the cap, nothing idle: stay on its last stream, whose pending work is its own.
    before = pool.statistics()
    assert pool.submission_stream() is other
    after = pool.statistics()
    assert (after.kept, after.shared, after.streams) == (before.kept + 1, before.shared, 2)
    # Another task finds only streams busy with work not its own: the least loaded.
    async with trio.open_nursery() as n:
        await n.start(_pick, pool)
    assert pool.statistics().shared == before.shared + 1
    await sub.wait()
    await sub2.wait()
    # Both seen done: this task's last stream is idle again, and it stays there.
    assert pool.submission_stream() is other


async def _pick(pool: trio_cuda.StreamPoolByLoad, task_status: trio.TaskStatus[trio_cuda.Stream]) -> None:
    task_status.started(pool.submission_stream())


async def test_by_load_shares_the_least_loaded_stream_at_its_cap(dev: trio_cuda.Device) -> None:
    pool = trio_cuda.StreamPoolByLoad(dev, num_streams=1, max_streams=2)
    async with trio.open_nursery() as n:
        first = [await n.start(_hold, pool) for _ in range(2)]
        # one more kernel on the first stream: it is now the more loaded one
        extra = await trio_cuda.lowlevel.submit(sleep(await counter(), 1000), first[0][0])
        assert pool.statistics().shared == 0
        s = pool.submission_stream()
        assert s is first[1][0]
        st = pool.statistics()
        assert st.streams == 2 and st.shared == 1
        await extra.wait()


async def test_by_load_asks_the_driver_about_one_stream_when_every_stream_is_busy(dev: trio_cuda.Device) -> None:
    pool = trio_cuda.StreamPoolByLoad(dev, num_streams=3, max_streams=3)
    async with trio.open_nursery() as n:
        held = [await n.start(_hold, pool) for _ in range(3)]
        before = pool.statistics()
        for _ in range(3):  # other tasks' choices: nothing known idle, nothing to grow
            await n.start(_pick_and_stay, pool)
        after = pool.statistics()
        assert after.shared - before.shared == 3
        # (a stream handed out to one of them is not asked about by the next)
        assert after.asked - before.asked == 3, "more than one query a choice about busy streams"
        assert all(not sub.event.query() for _, sub in held)
        n.cancel_scope.cancel()


async def _pick_and_stay(pool: trio_cuda.StreamPoolByLoad, task_status: trio.TaskStatus[trio_cuda.Stream]) -> None:
    # (a task that stays alive: a new task may reuse a finished one's id, and a policy
    # keyed by ids would take it for the same task)
    task_status.started(pool.submission_stream())
    await trio.sleep_forever()


async def test_by_load_finds_work_nobody_awaited_done_by_asking(dev: trio_cuda.Device) -> None:
    pool = trio_cuda.StreamPoolByLoad(dev, num_streams=2, max_streams=2)
    subs = []
    for s in pool.streams:  # fire and forget: no poll of theirs sees them complete
        subs.append(await trio_cuda.lowlevel.submit(sleep(await counter(), 1000), s))
    other = dev.create_stream()  # waited for through another stream's event
    for sub in subs:
        trio_cuda.lowlevel.stream_wait(other, sub.event)
    await trio_cuda.lowlevel.wait(trio_cuda.lowlevel.record(other))
    before = pool.statistics()
    async with trio.open_nursery() as n:
        s = await n.start(_pick, pool)
    after = pool.statistics()
    assert s in pool.streams
    assert (after.asked - before.asked, after.idle - before.idle, after.shared - before.shared) == (1, 1, 0)
    for sub in subs:
        await sub.wait()


async def test_by_load_arguments_are_checked(dev: trio_cuda.Device) -> None:
    with pytest.raises(ValueError, match="max_streams"):
        trio_cuda.StreamPoolByLoad(dev, num_streams=4, max_streams=2)
    with pytest.raises(ValueError, match="at least 1"):
        trio_cuda.StreamPoolByLoad(dev, num_streams=0)
    with pytest.raises(TypeError, match="max_streams"):
        trio_cuda.StreamPoolByLoad(dev, max_streams=2.5)  # type: ignore[arg-type]


async def _short_task(done: list[bool], long_sub: object) -> None:
    x = await api.zeros((16,))  # allocations, launches and a copy back, all after the long kernel began
    for _ in range(10):
        x = await ops.add(x, 1.0)
    np.testing.assert_array_equal(await x.to_host(), np.full(16, 10.0, np.float32))
    done.append(not long_sub.event.query())  # type: ignore[attr-defined]


async def test_short_tasks_do_not_wait_behind_a_long_kernel(dev: trio_cuda.Device) -> None:
    # Head of line: one task's long kernel in flight (and a tensor of its freed while it
    # runs), three short tasks: each finishes while the long kernel is still pending, on
    # the default policy. (Under StreamPoolRoundRobin two of them queue behind it.)
    old = dev.policy
    dev.policy = pool = trio_cuda.StreamPoolByLoad(dev)
    try:
        c = await counter()
        scratch = await api.zeros((1 << 16,))
        long_sub = await trio_cuda.lowlevel.submit(sleep(c, 3 * SLOW_NS).then(lambda p, t=scratch: ops.add(t, 1.0)))
        del scratch  # freed while the long work may still use it
        done: list[bool] = []
        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(_short_task, done, long_sub)
        assert done == [True, True, True]
        assert pool.statistics().shared == 0
        await long_sub.wait()
    finally:
        dev.policy = old


@pytest.mark.faults_device
async def test_by_load_makes_no_driver_call_on_streams_from_before_a_reset(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a reset the pool's streams keep their old driver streams until a submission
    # rebinds them; those that looked busy must not be asked about (an event recorded on
    # a destroyed CUDA stream crashes the process).
    pool = trio_cuda.StreamPoolByLoad(dev, num_streams=2, max_streams=2)
    for s in pool.streams:
        await trio_cuda.lowlevel.submit(sleep(await counter(), SLOW_NS), s)
        s.mark()  # a point past its last event: asking about it would record a new one
    await trio.to_thread.run_sync(dev.reset)
    old = {id(s.handle) for s in pool.streams}
    recorded: list[object] = []
    real = dev._driver.record

    def record(event: object, stream: object) -> None:
        recorded.append(stream)
        real(event, stream)

    monkeypatch.setattr(dev._driver, "record", record)
    async with trio.open_nursery() as n:
        s = await n.start(_pick, pool)
    assert s in pool.streams
    assert not [h for h in recorded if id(h) in old]
    x = await trio_cuda.lowlevel.submit(api.ones((4,)), s)  # the stream is rebound on use
    np.testing.assert_array_equal(await (await x.wait()).to_host(), np.ones(4, np.float32))
