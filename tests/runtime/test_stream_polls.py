"""Polls answered from the stream (Device.poll, docs/notifier.md).

The promises: once a later point of a stream is seen done, an earlier event reads done
without a driver query; the newest event is asked about once while it is pending, and
its being pending never delays an earlier event that is done; a submission that failed
never reads done because later work on its stream succeeded; a faulted device fails
every event not yet seen done, as without this path.
"""

from __future__ import annotations

import gc
import random
import threading
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _device, _notifier, _submission, api, lowlevel, ops
from trio_cuda import _notifier as notifier_mod
from trio_cuda.kernels import sleep

from numba import cuda

from ..helpers.devices import ON_CUDA, Resetter, counter, needs_devices
from ..helpers.faults import ready_to_fault, scribble


class Queries:
    """Counts the driver's event queries, by handle."""

    def __init__(self, dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
        real = dev._driver.query
        self.handles: list[Any] = []

        def query(handle: Any) -> bool:
            self.handles.append(handle)
            return bool(real(handle))

        monkeypatch.setattr(dev._driver, "query", query)

    def of(self, ev: trio_cuda.Event) -> int:
        return sum(1 for h in self.handles if h is ev.handle)


@pytest.fixture
def fresh_device(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> trio_cuda.Device:
    # A cross-device test earlier in the session turns stream polls off for the device
    # for good (see Device.poll); these tests are about a device that never did that.
    monkeypatch.setattr(dev, "_cross_device", False)
    return dev


async def submit_adds(x: trio_cuda.Tensor, s: trio_cuda.Stream, n: int) -> list[trio_cuda.Event]:
    events = []
    for _ in range(n):
        sub = await lowlevel.submit(ops.add(x, 1.0, out=x), s)
        assert sub.event is not None
        events.append(sub.event)
    return events


async def adds_on_a_new_stream(dev: trio_cuda.Device, n: int) -> tuple[trio_cuda.Stream, trio_cuda.Tensor, list[trio_cuda.Event]]:
    """A new stream, a tensor of 16 zeros, and the events of ``n`` submitted
    (not awaited) increments of it on that stream."""
    s = dev.create_stream()
    x = await api.zeros((16,))
    return s, x, await submit_adds(x, s, n)


@pytest.mark.parametrize("by_stream", [True, False])
async def test_earlier_events_read_done_without_a_query_after_a_later_one(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch, by_stream: bool
) -> None:
    dev = fresh_device
    monkeypatch.setattr(_device, "poll_by_stream", by_stream)
    _s, x, events = await adds_on_a_new_stream(dev, 6)
    assert len({ev.seq for ev in events}) == 6
    await lowlevel.wait(events[-1])
    q = Queries(dev, monkeypatch)
    assert all(dev.poll(ev) for ev in events[:-1])
    # By the stream: no query at all. Without it (the contrast): one per event.
    assert len(q.handles) == (0 if by_stream else 5)
    np.testing.assert_array_equal(await x.to_host(), np.full(16, 6.0, np.float32))


async def test_a_poll_asks_about_the_newest_event_first_and_learns_the_rest(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = fresh_device
    s, _x, events = await adds_on_a_new_stream(dev, 5)
    with trio.fail_after(30):  # all done, asking the driver directly: the runtime knows nothing
        while not dev._driver.query(events[-1].handle):
            await trio.sleep(0.001)
    assert s._ok_seq < events[0].seq and not events[-1].done
    q = Queries(dev, monkeypatch)
    assert dev.poll(events[0])  # asks about the newest: done, so the oldest is too
    assert q.handles == [events[-1].handle]
    assert all(dev.poll(ev) for ev in events[1:])
    assert len(q.handles) == 1


async def test_a_pending_newest_event_is_asked_once_and_delays_no_earlier_one(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = fresh_device
    s, x, short = await adds_on_a_new_stream(dev, 3)
    long = await lowlevel.submit(sleep(counter(), 400_000_000), s)  # 0.4 s behind them
    newest = long.event
    assert newest is not None and newest.seq > short[-1].seq
    q = Queries(dev, monkeypatch)
    seen = [False] * len(short)
    with trio.fail_after(30):
        while not all(seen):
            for i, ev in enumerate(short):
                seen[i] = seen[i] or dev.poll(ev)
            await trio.sleep(0)
    assert not newest.done, "the long kernel finished first: the test proves nothing"
    assert q.of(newest) == 1, "the pending newest event was asked about more than once"
    await long.wait()
    np.testing.assert_array_equal(await x.to_host(), np.full(16, 3.0, np.float32))


async def test_awaits_of_many_tasks_on_few_streams_stay_right(fresh_device: trio_cuda.Device) -> None:
    # 16 tasks, 2 streams, each task's own tensor: every await's result is its own work
    # done, whether the poll asked the driver or answered from the stream.
    dev = fresh_device
    streams = [dev.create_stream() for _ in range(2)]
    xs = [await api.zeros((8,)) for _ in range(16)]
    rounds = 6
    seen: list[float] = []

    async def worker(i: int) -> None:
        policy = trio_cuda.SingleStream(stream=streams[i % 2])
        for r in range(rounds):
            out = await ops.add(xs[i], 1.0, out=xs[i]).schedule(policy)
            if r == rounds - 1:
                seen.append(float((await out.to_host().schedule(policy))[0]))

    async with trio.open_nursery() as nursery:
        for i in range(len(xs)):
            nursery.start_soon(worker, i)
    assert seen == [float(rounds)] * len(xs)
    for x in xs:
        np.testing.assert_array_equal(await x.to_host(), np.full(8, float(rounds), np.float32))


@pytest.mark.faults_device
async def test_a_faulted_device_fails_events_not_yet_seen_done(fresh_device: trio_cuda.Device) -> None:
    dev = fresh_device
    _, z = await ready_to_fault(0)
    _s, _x, events = await adds_on_a_new_stream(dev, 3)
    await lowlevel.wait(events[-1])  # the stream is known done past events[0]
    assert not events[0].done
    with pytest.raises(trio_cuda.DeviceFault):
        await scribble(z.partition((32,)))
    assert dev.is_faulted
    with pytest.raises(trio_cuda.DeviceFault):
        dev.poll(events[0])


async def fault_device_1_then_check(z1: trio_cuda.Tensor, failing: Any, good: Any, y0: trio_cuda.Tensor) -> None:
    """Fault device 1 (``z1`` is its scribble target). ``good``, later on the same stream
    of device 0 as ``failing``, succeeds; ``failing`` must still fail, however polled."""
    d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
    with trio_cuda.use_device(1), pytest.raises(trio_cuda.DeviceFault):
        await scribble(z1.partition((32,)))
    assert d1.is_faulted and not d0.is_faulted
    await good.wait()
    ev = failing.event
    assert ev is not None and ev.device is d0 and ev.seq < good.event.seq and not ev.done
    with pytest.raises(trio_cuda.DeviceFault):
        d0.poll(ev)
    with pytest.raises(trio_cuda.DeviceFault):
        await failing.wait()
    np.testing.assert_array_equal(await y0.to_host(), np.full(32, 2.0, np.float32))
    await trio.to_thread.run_sync(d1.reset)


@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_a_failed_peer_copy_does_not_read_done_after_a_later_success_on_its_stream(
    fresh_device: trio_cuda.Device,
) -> None:
    # The copy itself fails (device 1 faulted after it was enqueued); nothing made a
    # stream wait for device 1's work. Later work on the same stream succeeds.
    d0 = fresh_device
    with trio_cuda.use_device(1):  # all on device 1: device 0 waits for nothing of it
        t1 = await api.full((32,), 7.0)  # written and known done
    _, z1 = await ready_to_fault(1)
    s0 = d0.create_stream()
    y0 = await api.zeros((32,))
    await ops.add(y0, 1.0, out=y0)
    await lowlevel.submit(sleep(counter(), 300_000_000), s0)  # holds the copy back
    assert not d0._cross_device  # the copy below is the first cross-device work
    failing = await lowlevel.submit(api.dup(t1, device=0), s0)
    good = await lowlevel.submit(ops.add(y0, 1.0, out=y0), s0)
    await fault_device_1_then_check(z1, failing, good, y0)


@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_a_submission_failed_by_another_devices_fault_does_not_read_done_after_a_later_success(
    fresh_device: trio_cuda.Device,
) -> None:
    # Submitted on device 0's stream, a copy into device 1's memory runs on device 1
    # (after a long kernel there) and device 0's stream waits for it: device 1's fault
    # fails that submission alone.
    d0 = fresh_device
    d1 = trio_cuda.device(1)
    # A pool of its own: the faulting launch must not queue behind earlier tests' work.
    d1.policy = trio_cuda.StreamPoolByLoad(d1)
    c1, z1 = await ready_to_fault(1)
    s0 = d0.create_stream()
    y0 = await api.zeros((32,))
    await ops.add(y0, 1.0, out=y0)
    with trio_cuda.use_device(1):
        await lowlevel.submit(sleep(c1.partition((4,)), 300_000_000))
    assert not d0._cross_device  # the wait below is the first cross-device work
    failing = await lowlevel.submit(api.memcpy(c1, np.zeros(4, np.int32)), s0)
    good = await lowlevel.submit(ops.add(y0, 1.0, out=y0), s0)
    await fault_device_1_then_check(z1, failing, good, y0)


# -- from the adversarial review: sim-only, reading the simulated memory behind each await --
@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
@pytest.mark.parametrize("by_stream", [True, False])
async def test_stream_wait_on_another_devices_event_then_failure_does_not_read_done(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch, by_stream: bool
) -> None:
    # lowlevel.stream_wait ("an event of any device") made device 0's stream wait for
    # device 1's work without marking device 0 (found by review): the failed add read done.
    monkeypatch.setattr(_device, "poll_by_stream", by_stream)
    d0, d1 = fresh_device, trio_cuda.device(1)
    c1, z1 = await ready_to_fault(1)
    with trio_cuda.use_device(1):
        s1 = d1.create_stream()
        await lowlevel.submit(sleep(c1.partition((4,)), 300_000_000), s1)
        e1 = lowlevel.record(s1)
    s0 = d0.create_stream()
    y0 = await api.zeros((32,))
    await ops.add(y0, 1.0, out=y0)
    assert not d0._cross_device  # the wait below is the first cross-device work
    lowlevel.stream_wait(s0, e1)
    failing = await lowlevel.submit(ops.add(y0, 1.0, out=y0), s0)
    good = await lowlevel.submit(api.zeros((8,)), s0)
    with trio_cuda.use_device(1), pytest.raises(trio_cuda.DeviceFault):
        await scribble(z1.partition((32,)))
    assert d1.is_faulted and not d0.is_faulted
    await good.wait()
    ev = failing.event
    assert ev is not None and ev.seq < good.event.seq
    try:
        with pytest.raises(trio_cuda.DeviceFault):
            d0.poll(ev)  # by the stream: True (the failed add reads done)
        with pytest.raises(trio_cuda.DeviceFault):
            await failing.wait()
    finally:
        await trio.to_thread.run_sync(d1.reset)


async def counter_on_a_stream(
    dev: trio_cuda.Device,
) -> tuple[trio_cuda.SingleStream, trio_cuda.Tensor, trio_cuda.Partition]:
    """A policy of one new stream, and a 1-element int32 counter (and its
    partition) for the sleep kernel."""
    policy = trio_cuda.SingleStream(stream=dev.create_stream())
    c = await api.zeros((1,), np.int32)
    return policy, c, c.partition((1,))


def peek(dev: trio_cuda.Device, t: trio_cuda.Tensor) -> int:
    """counter[0] straight from the simulated memory (no ordering, no wait)."""
    return int(dev._driver._bytes(t.ptr, 4).view(np.int32)[0])


@pytest.mark.sim_only
@pytest.mark.parametrize("budget", [None, 0])
async def test_awaits_never_return_before_their_sleep_ran(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    dev = fresh_device
    if budget is not None:
        monkeypatch.setattr(_notifier, "_budget_ns", budget)
    streams = [dev.create_stream() for _ in range(2)]
    rng = random.Random(1)
    bad: list[str] = []

    async def worker(i: int) -> None:
        policy = trio_cuda.SingleStream(stream=streams[i % 2])
        c = await api.zeros((1,), np.int32)
        for r in range(8):
            await sleep(c.partition((1,)), rng.randrange(0, 2_000_000)).schedule(policy)
            v = peek(dev, c)
            if v != r + 1:
                bad.append(f"task {i} round {r}: counter {v}")

    async with trio.open_nursery() as nursery:
        for i in range(24):
            nursery.start_soon(worker, i)
    assert not bad, bad


@pytest.mark.sim_only
async def test_thread_syncs_and_trio_awaits_on_one_stream(
    fresh_device: trio_cuda.Device,
) -> None:
    dev = fresh_device
    s = dev.create_stream()
    policy = trio_cuda.SingleStream(stream=s)
    bad: list[str] = []
    cs = [await api.zeros((1,), np.int32) for _ in range(12)]

    def thread_worker(j: int) -> None:
        c = cs[j]
        for r in range(6):
            sleep(c.partition((1,)), 300_000 * (r % 3)).sync_on(s)
            v = peek(dev, c)
            if v != r + 1:
                bad.append(f"thread {j} round {r}: counter {v}")

    async def task_worker(j: int) -> None:
        c = cs[j]
        for r in range(6):
            await sleep(c.partition((1,)), 200_000 * (r % 4)).schedule(policy)
            v = peek(dev, c)
            if v != r + 1:
                bad.append(f"task {j} round {r}: counter {v}")

    async with trio.open_nursery() as nursery:
        for j in range(6):
            nursery.start_soon(trio.to_thread.run_sync, thread_worker, j)
        for j in range(6, 12):
            nursery.start_soon(task_worker, j)
    assert not bad, bad


@pytest.mark.sim_only
async def test_resets_racing_polls_never_read_done_early(fresh_device: trio_cuda.Device) -> None:
    dev = fresh_device
    streams = [dev.create_stream() for _ in range(2)]
    bad: list[str] = []
    stats = {"ok": 0, "reset": 0}
    stop = threading.Event()

    async def worker(i: int) -> None:
        policy = trio_cuda.SingleStream(stream=streams[i % 2])
        rng = random.Random(i)
        while not stop.is_set():
            try:
                c = await api.zeros((1,), np.int32).schedule(policy)
                gen = dev.generation
                await sleep(c.partition((1,)), rng.randrange(0, 1_000_000)).schedule(policy)
            except (trio_cuda.DeviceReset, trio_cuda.DeviceUnavailable, ValueError):
                stats["reset"] += 1
                await trio.sleep(0.001)
                continue
            try:
                v = peek(dev, c)
            except IndexError:
                continue  # memory gone with a reset after the await
            if v != 1 and dev.generation == gen:
                bad.append(f"task {i}: counter {v} after the await (generation {gen})")
            stats["ok"] += 1
            res.progress.set()

    with Resetter(dev) as res:
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(worker, i)
            await trio.sleep(3)
            stop.set()
    assert not bad, bad
    assert stats["ok"] > 20 and res.resets > 2, (stats, res.resets)


@pytest.mark.sim_only
async def test_ok_seq_of_the_old_binding_does_not_leak_after_a_reset(
    fresh_device: trio_cuda.Device,
) -> None:
    dev = fresh_device
    s = dev.create_stream()
    x = await api.zeros((16,))
    events = await submit_adds(x, s, 8)
    held = events[2]
    await lowlevel.wait(events[-1])
    assert s._ok_seq >= events[-1].seq and not held.done
    await trio.to_thread.run_sync(dev.reset)
    with pytest.raises(trio_cuda.DeviceReset):
        dev.poll(held)
    with pytest.raises(trio_cuda.DeviceReset):
        await lowlevel.wait(held)
    # The rebound stream restarts at seq 0: a new pending event at a low seq must not
    # read done from the old binding's _ok_seq.
    c = await api.zeros((1,), np.int32)
    long = await lowlevel.submit(sleep(c.partition((1,)), 400_000_000), s)
    assert long.event is not None and long.event.seq < events[-1].seq
    assert not dev.poll(long.event)
    await long.wait()
    assert peek(dev, c) == 1


@pytest.mark.sim_only
async def test_a_pending_newest_memo_never_hides_a_done_event(
    fresh_device: trio_cuda.Device,
) -> None:
    dev = fresh_device
    s = dev.create_stream()
    c = await api.zeros((1,), np.int32)
    c2 = await api.zeros((1,), np.int32)
    first = await lowlevel.submit(sleep(c.partition((1,)), 200_000_000), s)
    newest = await lowlevel.submit(sleep(c2.partition((1,)), 100_000_000), s)
    assert not dev.poll(first.event)  # asks about newest: pending (memo), then first: pending
    assert s._newest_pending == newest.event.seq
    # No newer event is ever recorded: both must still complete, by polling alone.
    with trio.fail_after(10):
        while not dev.poll(first.event):
            await trio.sleep(0.005)
        assert peek(dev, c) == 1
        while not dev.poll(newest.event):
            await trio.sleep(0.005)
    assert peek(dev, c2) == 1


@trio_cuda.kernel
def maybe_scribble(z, flag):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < z.shape[0]:
        z[i + flag[0]] = 1.0


@pytest.mark.sim_only
@pytest.mark.parametrize("budget", [0, 2_000_000_000])
async def test_the_first_poll_of_a_direct_await_counts_and_parks(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    dev = fresh_device
    monkeypatch.setattr(_notifier, "_budget_ns", budget)
    policy, c, p = await counter_on_a_stream(dev)
    await sleep(p, 50_000_000).schedule(policy)  # the direct path knows it now
    before = lowlevel.notifier_statistics()
    q = _submission.statistics().direct
    await sleep(p, 50_000_000).schedule(policy)  # pending at the first poll
    assert _submission.statistics().direct == q + 1, "not the direct path"
    assert peek(dev, c) == 2
    after = lowlevel.notifier_statistics()
    fast = after.fast_path - before.fast_path
    slow = after.slow_path - before.slow_path
    assert fast + slow == 1
    assert (slow == 1) if budget == 0 else (fast == 1)


@pytest.mark.sim_only
async def test_the_first_poll_of_a_direct_await_cancelled_leaves_work_running(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = fresh_device
    policy, c, p = await counter_on_a_stream(dev)
    await sleep(p, 200_000_000).schedule(policy)
    q = _submission.statistics().direct
    with trio.CancelScope() as cs:
        cs.cancel()  # cancelled before: the op does not happen (checkpoint_if_cancelled)
        await sleep(p, 200_000_000).schedule(policy)
    assert _submission.statistics().direct == q
    with trio.move_on_after(0.02) as mv:
        await sleep(p, 200_000_000).schedule(policy)
    assert mv.cancelled_caught
    assert _submission.statistics().direct == q + 1
    assert peek(dev, c) == 1
    await sleep(p, 200_000_000).schedule(policy)
    assert peek(dev, c) == 3


@pytest.mark.faults_device
@pytest.mark.sim_only
async def test_the_first_poll_of_a_direct_await_fault_names_the_op(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = fresh_device.create_stream()
    policy = trio_cuda.SingleStream(stream=s)
    z = await api.zeros((32,))
    flag = await api.zeros((1,), np.int64)
    zp = z.partition((32,))
    await maybe_scribble(zp, flag).schedule(policy)
    await api.memcpy(flag, np.array([1 << 40], np.int64))
    q = _submission.statistics().direct
    with pytest.raises(trio_cuda.DeviceFault) as info:
        await maybe_scribble(zp, flag).schedule(policy)
    assert _submission.statistics().direct == q + 1
    assert info.value.op is not None and "maybe_scribble" in info.value.op, info.value


@pytest.mark.sim_only
async def test_polls_during_and_after_a_capture_on_a_stream(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = fresh_device
    s = dev.create_stream()
    policy = trio_cuda.SingleStream(stream=s)
    c_pre = await api.zeros((1,), np.int32)
    c = await api.zeros((1,), np.int32)
    pre_p, p = c_pre.partition((1,)), c.partition((1,))
    await sleep(p, 1000).schedule(policy)
    first = await lowlevel.submit(sleep(pre_p, 100_000_000), s)
    pre = await lowlevel.submit(sleep(pre_p, 200_000_000), s)
    assert not dev.poll(first.event)  # newest (pre) pending: memo
    with trio_cuda.capture_graph(s) as scope:
        scope.record(sleep(p, 50_000_000))
        assert s.capture is not None
        with trio.fail_after(10):
            while not dev.poll(first.event):
                await trio.sleep(0.005)
            assert peek(dev, c_pre) >= 1
            while not dev.poll(pre.event):
                await trio.sleep(0.005)
            assert peek(dev, c_pre) == 2
    graph = scope.graph
    assert graph is not None and peek(dev, c) == 1
    launch = await lowlevel.submit(graph.launch(), s)
    with trio.fail_after(10):
        while not dev.poll(launch.event):
            await trio.sleep(0.005)
    assert peek(dev, c) == 2
    await sleep(p, 1000).schedule(policy)
    assert peek(dev, c) == 3


@pytest.mark.sim_only
async def test_events_of_a_dropped_stream(fresh_device: trio_cuda.Device) -> None:
    dev = fresh_device
    s = dev.create_stream()
    cs = [await api.zeros((1,), np.int32) for _ in range(3)]
    subs = [await lowlevel.submit(sleep(c.partition((1,)), 100_000_000 * (3 - i)), s) for i, c in enumerate(cs)]
    evs = [sub.event for sub in subs]
    assert not dev.poll(evs[0])
    del s
    gc.collect()
    await api.zeros((1,))  # housekeeping: the stream is destroyed behind its last work
    for ev, c in zip(evs, cs, strict=True):
        with trio.fail_after(10):
            while not dev.poll(ev):
                await trio.sleep(0.002)
        assert peek(dev, c) == 1
    for sub in subs:
        await sub.wait()


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial4.py)
# ======================================================================================
# ======================================================================================
# 2. wait_event
# ======================================================================================
def _poll_not_done_at_first(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> list[int]:
    """The trio thread's first poll of each event answers 'not done' (the op completes
    just after it); the notifier thread's polls and later ones ask the device."""
    trio_thread = threading.get_ident()
    seen: dict[int, Any] = {}  # the events themselves are kept: an id is not reused meanwhile
    polls: list[int] = []
    orig = dev.poll

    def poll(ev: Any) -> bool:
        if threading.get_ident() == trio_thread:
            polls.append(id(ev))
            if id(ev) not in seen:
                seen[id(ev)] = ev
                return False
        return orig(ev)

    monkeypatch.setitem(vars(dev), "poll", poll)  # (setattr would leave a bound method behind)
    return polls


async def _five_waits_pending_at_first_poll(monkeypatch: pytest.MonkeyPatch, budget_ns: int) -> tuple[int, int, int]:
    """Five awaited adds whose first poll says 'not done', under ``budget_ns``:
    (waits done on the fast path, waits parked, polls made in the trio thread)."""
    dev = trio_cuda.current_device()
    x = await api.zeros((4,))
    await ops.add(x, 1.0, out=x)
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    monkeypatch.setattr(notifier_mod, "_spin_ns", 0)
    polls = _poll_not_done_at_first(monkeypatch, dev)
    before = lowlevel.notifier_statistics()
    for _ in range(5):
        await ops.add(x, 1.0, out=x)
    after = lowlevel.notifier_statistics()
    monkeypatch.undo()
    np.testing.assert_array_equal(await x.to_host(), np.full(4, 6.0, np.float32))
    return after.fast_path - before.fast_path, after.slow_path - before.slow_path, len(polls)


async def test_zero_budget_parks_every_wait_not_complete_at_its_first_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/notifier.md: "TRIO_CUDA_POLL_BUDGET_US=0 parks every wait that is not complete
    # at its first poll".
    n_fast, n_slow, n_polls = await _five_waits_pending_at_first_poll(monkeypatch, 0)
    assert (n_fast, n_slow) == (0, 5), (
        f"budget 0: {n_fast} waits not complete at their first poll stayed on the fast path "
        f"({n_polls} polls in the trio thread for 5 waits)"
    )


async def test_budget_still_covers_waits_not_complete_at_their_first_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    # The other side: the pure polling wait (a budget of 1000 s or more) keeps such waits
    # on the fast path (no parking, no sleeping through them).
    n_fast, n_slow, _ = await _five_waits_pending_at_first_poll(monkeypatch, 10**12)
    assert (n_fast, n_slow) == (5, 0)


@pytest.mark.parametrize("budget_ns", [0, 10_000_000_000])
async def test_move_on_after_zero_around_a_long_op_submits_nothing_and_returns(
    monkeypatch: pytest.MonkeyPatch, budget_ns: int, dev: trio_cuda.Device
) -> None:
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    c = await counter()
    await sleep(c, 1000)  # loaded
    before = lowlevel.notifier_statistics()
    launches = dev.statistics().launches
    with trio.move_on_after(0) as scope:
        await sleep(c, 300_000_000)
    assert scope.cancelled_caught
    after = lowlevel.notifier_statistics()
    assert after.parked == 0 and after.slow_path == before.slow_path
    assert dev.statistics().launches == launches  # cancelled before it was submitted
    monkeypatch.undo()
    np.testing.assert_array_equal(await c.to_host(), [1])


@pytest.mark.parametrize("budget_ns", [0, 10_000_000_000])
async def test_cancelled_at_the_first_pass_then_parked_then_cancelled(monkeypatch: pytest.MonkeyPatch, budget_ns: int) -> None:
    # Cancelled while in the first scheduling pass, and (budget 0) while parked: the
    # wait ends with Cancelled promptly, nothing stays parked, the submitted work runs.
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    c = await counter()
    await sleep(c, 1000)
    cancel_first = trio.CancelScope()

    async def waiter(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with cancel_first:
            sub = await lowlevel.submit(sleep(c, 1_000_000_000))
            task_status.started()
            await sub.wait()  # runs to wait_event's first checkpoint before we resume

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        await n.start(waiter)
        cancel_first.cancel()
    assert cancel_first.cancelled_caught
    with trio.move_on_after(0.05) as scope:
        await sleep(c, 1_000_000_000)
    assert scope.cancelled_caught
    assert trio.current_time() - t0 < 0.6, "a cancelled wait waited for its 1 s of work"
    with trio.fail_after(2):
        while lowlevel.notifier_statistics().parked:
            await trio.sleep(0.005)
    monkeypatch.undo()
    np.testing.assert_array_equal(await c.to_host(), [3])


@pytest.mark.faults_device
@pytest.mark.parametrize("budget_ns", [0, 10_000_000_000])
async def test_a_fault_is_reported_by_the_first_poll_and_by_the_parked_path(
    monkeypatch: pytest.MonkeyPatch, budget_ns: int, dev: trio_cuda.Device
) -> None:
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    t = await api.zeros((32,))
    try:
        with trio.fail_after(10):
            with pytest.raises(trio_cuda.DeviceFault):
                await scribble(t.partition((32,)))
            # known faulted now: a later wait reports it too, it never hangs
            with pytest.raises((trio_cuda.DeviceFault, trio_cuda.DeviceUnavailable)):
                await api.zeros((4,))
    finally:
        monkeypatch.undo()
    if ON_CUDA:
        # The CUDA driver keeps an illegal-address error for the whole process.
        with pytest.raises(trio_cuda.DeviceFault, match="restart the process"):
            await trio.to_thread.run_sync(dev.reset)
        return
    await trio.to_thread.run_sync(dev.reset)
    np.testing.assert_array_equal(await (await api.ones((4,))).to_host(), np.ones(4, np.float32))


@pytest.mark.faults_device
async def test_a_reset_during_the_first_pass_is_reported(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> None:
    # The reset lands between the submission and the first poll (the poll after the
    # first scheduling pass): the wait reports DeviceReset, it neither hangs nor says done.
    c = await counter()
    await sleep(c, 1000)
    orig = dev.poll
    trio_thread = threading.get_ident()
    state = {"reset": False}

    def poll(ev: Any) -> bool:
        if threading.get_ident() == trio_thread and not state["reset"]:
            state["reset"] = True
            threading.Thread(target=dev.reset).start()
            while dev.generation == ev.generation:
                pass
        return orig(ev)

    monkeypatch.setitem(vars(dev), "poll", poll)  # (setattr would leave a bound method behind)
    with trio.fail_after(10):
        with pytest.raises(trio_cuda.DeviceReset):
            await sleep(c, 300_000_000)
    monkeypatch.undo()
    while dev._resetting:
        await trio.sleep(0.001)
    np.testing.assert_array_equal(await (await api.ones((4,))).to_host(), np.ones(4, np.float32))
