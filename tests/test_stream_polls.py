"""Polls answered from the stream (Device.poll, docs/notifier.md).

The promises: once a later point of a stream is seen done, an earlier event reads done
without a driver query; the newest event is asked about once while it is pending, and
its being pending never delays an earlier event that is done; a submission that failed
never reads done because later work on its stream succeeded; a faulted device fails
every event not yet seen done, as without this path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _device, api, lowlevel, ops
from trio_cuda.kernels import sleep

from .conftest import counter, needs_devices
from .test_adversarial import ready_to_fault, scribble


def wordless_stream(dev: trio_cuda.Device) -> trio_cuda.Stream:
    """A stream without a completion word (as every CUDA stream by default), so its
    polls go to the driver on the simulated device too."""
    free, dev._flag_free = dev._flag_free, []
    try:
        s = dev.create_stream()
    finally:
        dev._flag_free = free
    assert s._flag < 0
    return s


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
    """A word-less stream, a tensor of 16 zeros, and the events of ``n`` submitted
    (not awaited) increments of it on that stream."""
    s = wordless_stream(dev)
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
    streams = [wordless_stream(dev) for _ in range(2)]
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
    s0 = wordless_stream(d0)
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
    c1, z1 = await ready_to_fault(1)
    s0 = wordless_stream(d0)
    y0 = await api.zeros((32,))
    await ops.add(y0, 1.0, out=y0)
    with trio_cuda.use_device(1):
        await lowlevel.submit(sleep(c1.partition((4,)), 300_000_000))
    assert not d0._cross_device  # the wait below is the first cross-device work
    failing = await lowlevel.submit(api.memcpy(c1, np.zeros(4, np.int32)), s0)
    good = await lowlevel.submit(ops.add(y0, 1.0, out=y0), s0)
    await fault_device_1_then_check(z1, failing, good, y0)
