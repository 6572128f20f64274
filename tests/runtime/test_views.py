"""Views: numpy's basic indexing on tensors and ops, free and immediate; every consumer
(kernels, copies, read-backs, ops) takes strided views, and ordering covers the whole buffer."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import add, sleep

from numba import cuda

from ..helpers.devices import needs_devices, started

KEYS = [
    (slice(1, 3), slice(None, None, 2)),
    (slice(None, None, -1),),
    (Ellipsis, 1),
    (1, Ellipsis, slice(None, None, -2)),
    (None, slice(2, None), None),
    (-1,),
    (slice(5, 1, -2), 0, slice(None)),
    (slice(10, 20),),  # empty
    (0, 0, 0),  # 0-d
]


@pytest.mark.parametrize("key", KEYS)
async def test_basic_indexing_matches_numpy(key: tuple[object, ...]) -> None:
    a = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    t = await api.from_host(a)
    v = t[key]
    want = a[key]
    assert v.shape == want.shape
    assert v.strides == want.strides  # numpy's byte strides
    np.testing.assert_array_equal(await v.to_host(), want)
    # on an op: an op producing the view
    np.testing.assert_array_equal(await api.from_host(a)[key].to_host(), want)


async def test_views_are_free_and_share_memory(dev: trio_cuda.Device) -> None:
    t = await api.zeros((8, 8))
    before = dev.statistics()
    v = t[2:6, ::2].T
    assert dev.statistics() == before  # no device work, no allocation
    assert v.ptr == t.ptr + 2 * 8 * 4
    await api.memcpy(v, np.ones(v.shape, np.float32))  # written through the view
    host = await t.to_host()
    assert host[2:6, ::2].sum() == 16 and host.sum() == 16


async def test_transpose_and_reshape() -> None:
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    t = await api.from_host(a)
    np.testing.assert_array_equal(await t.transpose(2, 0, 1).to_host(), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(await t.transpose((1, 0, 2)).to_host(), a.transpose(1, 0, 2))
    np.testing.assert_array_equal(await t.T.to_host(), a.T)
    np.testing.assert_array_equal(await api.from_host(a).T.to_host(), a.T)
    np.testing.assert_array_equal(await t.reshape(4, 6).to_host(), a.reshape(4, 6))
    with pytest.raises(ValueError, match="non-contiguous"):
        t.T.reshape(24)
    np.testing.assert_array_equal(await t.T.copy().reshape(24).to_host(), a.T.reshape(24))
    with pytest.raises(ValueError, match="permutation"):
        t.transpose(0, 0, 1)


async def test_bad_indices_are_refused() -> None:
    t = await api.zeros((3, 4))
    with pytest.raises(IndexError, match="out of bounds"):
        t[3]
    with pytest.raises(IndexError, match="too many"):
        t[0, 0, 0]
    with pytest.raises(TypeError, match="basic indexing"):
        t[[0, 1]]
    with pytest.raises(IndexError, match="ellipsis"):
        t[..., ...]


@trio_cuda.kernel
def _scale(out, x, a):  # type: ignore[no-untyped-def]
    i, j = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        out[i, j] = a * x[i, j]


async def test_kernels_take_strided_views() -> None:
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    t = await api.from_host(a)
    out = await api.zeros((8, 8))
    # write every other column of out (a strided partition), read a transposed, reversed view
    src = t.T[::-1][:, ::2]
    dst = out[:, 1::2]
    await _scale(dst.partition((4, 2)), src, 2.0)
    want = np.zeros((8, 8), np.float32)
    want[:, 1::2] = 2 * a.T[::-1][:, ::2]
    np.testing.assert_array_equal(await out.to_host(), want)


async def test_copies_between_views() -> None:
    a = np.arange(30, dtype=np.float64).reshape(5, 6)
    t = await api.from_host(a)
    u = await api.zeros((6, 5), np.float64)
    await api.memcpy(u[::-1], t.T)  # device view to device view
    np.testing.assert_array_equal(await u.to_host(), a.T[::-1])
    d = await api.dup(t[1:4, ::3])
    assert d.is_contiguous
    np.testing.assert_array_equal(await d.to_host(), a[1:4, ::3])


@needs_devices(2)
async def test_views_across_devices() -> None:
    a = np.arange(20, dtype=np.float32).reshape(4, 5)
    t = await api.from_host(a)
    d = await api.dup(t.T, device=1)
    assert d.device.ordinal == 1
    np.testing.assert_array_equal(await d.to_host(), a.T)
    u = await api.zeros((5, 8), device=1)
    await api.memcpy(u[:, ::2], t.T)
    np.testing.assert_array_equal((await u.to_host())[:, ::2], a.T)


async def test_a_write_through_a_view_orders_reads_of_the_whole_buffer(dev: trio_cuda.Device) -> None:
    # A slow write through a view on one stream; a read of another part of the buffer
    # submitted on another stream must wait for it (ordering is per buffer, not per view).
    p1, p2 = trio_cuda.SingleStream(dev), trio_cuda.SingleStream(dev)
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)
    t = await api.zeros((2, 64))
    ones = await api.ones((64,))
    async with trio.open_nursery() as n:
        op = trio_cuda.zip(sleep(c.partition((1,)), 200_000_000), add(t[0].partition((64,)), ones, ones))
        await n.start(started, op, p1)  # enqueued: sleeps, then writes row 0
        row0 = await api.memcpy(np.empty(64, np.float32), t[0]).schedule(p2)
        whole = await t.to_host().schedule(p2)
    np.testing.assert_array_equal(row0, np.full(64, 2.0, np.float32))
    np.testing.assert_array_equal(whole[0], np.full(64, 2.0, np.float32))
    assert lowlevel.accesses(t)  # the buffer's pending accesses are tracked


async def test_untracked_and_views_keep_memory_alive(dev: trio_cuda.Device) -> None:
    t = await api.ones((1024,))
    v = t[10:20]
    base = dev.memory_in_use()
    del t
    await api.zeros((1,))
    assert dev.memory_in_use() >= base  # the view keeps the buffer (4 KiB)
    np.testing.assert_array_equal(await v.to_host(), np.ones(10, np.float32))


async def test_ops_take_views_and_write_views() -> None:
    a = np.arange(48, dtype=np.float32).reshape(6, 8)
    t = await api.from_host(a)
    np.testing.assert_array_equal(await (t[::2] + t[1::2]).to_host(), a[::2] + a[1::2])
    out = await api.zeros((8, 6))
    await ops.exp(t[:, ::-1] / 48, out=out.T)
    np.testing.assert_allclose(await out.to_host(), np.exp(a[:, ::-1] / 48).T, rtol=1e-6)
