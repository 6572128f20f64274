"""Automatic cross-stream ordering through buffers' pending writers and readers."""

from __future__ import annotations

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import saxpy, sleep

from ..helpers.devices import counter, started

SLOW_NS = 300_000_000


def two_streams(dev: trio_cuda.Device) -> tuple[trio_cuda.SchedulingPolicy, trio_cuda.SchedulingPolicy]:
    return trio_cuda.SingleStream(dev), trio_cuda.SingleStream(dev)


async def test_read_on_another_stream_waits_for_the_writer(dev: trio_cuda.Device) -> None:
    a, b = two_streams(dev)
    c = await counter().schedule(a)
    async with trio.open_nursery() as n:
        await n.start(started, sleep(c, SLOW_NS), a)
        # Submitted while the writer runs on stream a; runs on stream b.
        out = await c.to_host().schedule(b)
    np.testing.assert_array_equal(out, [1])


async def test_write_on_another_stream_waits_for_readers(dev: trio_cuda.Device) -> None:
    a, b = two_streams(dev)
    x = await api.full((4,), 1.0).schedule(a)
    y = await api.zeros((4,)).schedule(a)
    # Slow reader of x on stream a (the sleep runs first, then the saxpy reads x), then a
    # write to x on stream b.
    reader = sleep(counter(), SLOW_NS).then(lambda _: saxpy(1.0, x, y.partition((4,))))
    async with trio.open_nursery() as n:
        await n.start(started, reader, a)
        await api.memcpy(x, np.full(4, 100.0, np.float32)).schedule(b)
    # The read saw the old value of x, not 100.
    np.testing.assert_array_equal(await y.to_host(), np.full(4, 1.0, np.float32))
    np.testing.assert_array_equal(await x.to_host(), np.full(4, 100.0, np.float32))


async def test_same_stream_chains_add_no_waits(dev: trio_cuda.Device) -> None:
    policy = trio_cuda.SingleStream(dev)
    x = await api.ones((8,)).schedule(policy)
    y = await api.zeros((8,)).schedule(policy)
    before = dev.statistics().stream_waits
    for _ in range(5):
        await saxpy(2.0, x, y.partition((4,))).schedule(policy)
    assert dev.statistics().stream_waits == before
    np.testing.assert_array_equal(await y.to_host().schedule(policy), np.full(8, 10.0, np.float32))


async def test_untracked_view_opts_out_of_ordering(dev: trio_cuda.Device) -> None:
    a, b = two_streams(dev)
    c = await counter().schedule(a)
    async with trio.open_nursery() as n:
        await n.start(started, sleep(c, SLOW_NS), a)
        waits = dev.statistics().stream_waits
        # The untracked read does not wait for the slow writer: it sees the old value.
        stale = await c.tensor.untracked().to_host().schedule(b)
        assert dev.statistics().stream_waits == waits
    np.testing.assert_array_equal(stale, [0])
    assert not c.tensor.untracked().is_tracked and c.tensor.is_tracked
    np.testing.assert_array_equal(await c.to_host(), [1])


async def test_accesses_show_the_pending_writer_and_readers(dev: trio_cuda.Device) -> None:
    a, b = two_streams(dev)
    x = await api.ones((4,)).schedule(a)
    writer, readers = lowlevel.accesses(x)
    assert writer is not None and writer[0] is a.streams[0] and readers == {}
    await x.to_host().schedule(b)
    writer2, readers2 = lowlevel.accesses(x)
    assert writer2 == writer and set(readers2) == {b.streams[0]}


async def test_zip_branches_join_before_the_consumer(dev: trio_cuda.Device) -> None:
    c1, c2 = await counter(), await counter()
    both = trio_cuda.zip(sleep(c1, SLOW_NS).first(), sleep(c2, SLOW_NS // 3).first())
    a, b = await both
    # Both branches completed when the zip's await returned: an untracked read (which
    # waits for nothing) sees both increments.
    np.testing.assert_array_equal(await a.tensor.untracked().to_host(), [1])
    np.testing.assert_array_equal(await b.tensor.untracked().to_host(), [1])
