"""Gathers against numpy: take, take_along_axis, embedding and indexing by an integer
tensor; negative indices wrap; an index out of range fails the op with IndexError
(checked on the device); out= and graph captures; bad input refused before any work."""

from __future__ import annotations

import numpy as np
import pytest

from trio_cuda import api, ops

from ..helpers.arrays import host, same, up

RNG = np.random.default_rng(35)
X = RNG.normal(size=(3, 4, 5)).astype(np.float32)
IDX = np.array([[2, -1], [0, 1], [-3, 2]], np.int64)  # in range of every axis of X


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
@pytest.mark.parametrize("idx_dtype", [np.int64, np.int32, np.int8])
def test_take_matches_numpy(axis: int | None, idx_dtype: type) -> None:
    x, i = up(X), up(IDX.astype(idx_dtype))
    same(host(ops.take(x, i, axis)), np.take(X, IDX, axis))


def test_take_of_views_ints_and_ops() -> None:
    xi = np.arange(60, dtype=np.int32).reshape(3, 4, 5)
    t = up(xi)
    same(host(ops.take(t.transpose(2, 0, 1), up(IDX), 1)), np.take(xi.transpose(2, 0, 1), IDX, 1))
    same(host(ops.take(t[:, ::-1], up(np.array([3, 0], np.uint8)), 1)), np.take(xi[:, ::-1], [3, 0], 1))
    same(host(ops.take(t + 1, up(IDX) + 0, 2)), np.take(xi + 1, IDX, 2))  # both operands ops
    same(host(ops.take(t, up(np.array(-1)), None)), np.take(xi, -1))  # a 0-d index
    same(host(ops.take(t.astype(np.bool_), up(IDX), 0)), np.take(xi.astype(bool), IDX, 0))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_take_along_axis_broadcasts_as_numpy(axis: int) -> None:
    n = X.shape[axis]
    shape = [1, 1, 1]
    shape[axis] = 6
    idx = RNG.integers(-n, n, size=shape)
    same(host(ops.take_along_axis(up(X), up(idx), axis)), np.take_along_axis(X, idx, axis))
    order = np.argsort(X, axis=axis)
    same(host(ops.take_along_axis(up(X), up(order), axis)), np.sort(X, axis=axis))
    flat = RNG.integers(0, X.size, size=7)
    same(host(ops.take_along_axis(up(X), up(flat), None)), np.take_along_axis(X, flat, None))


def test_indexing_by_an_integer_tensor() -> None:
    t, i = up(X), up(IDX)
    same(host(t[i]), X[IDX])
    same(host(t[:, i]), X[:, IDX])
    same(host(t[..., i]), X[..., IDX])
    same(host(t[:, i, 1:4]), X[:, IDX, 1:4])
    same(host(t[:, i, 2]), X[:, IDX, 2])
    same(host((t * 2)[i]), (X * 2)[IDX])  # an op indexed
    same(host(t[i + 0]), X[IDX])  # by an op
    same(host((t * 2)[:, i + 0]), (X * 2)[:, IDX])


def test_embedding_is_rows_of_the_weight() -> None:
    w = RNG.normal(size=(10, 4)).astype(np.float32)
    ids = np.array([[1, 9, 0], [9, 9, -10]], np.int32)
    same(host(ops.embedding(up(w), up(ids))), w[ids])


def test_bfloat16_and_float16_tables_are_gathered_bit_exact() -> None:
    w = RNG.normal(size=(6, 4)).astype(np.float32)
    ids = up(np.array([5, 0, -1], np.int64))
    for dtype in ("bfloat16", np.float16):
        table = api.from_host(w).astype(dtype).sync()
        got = ops.embedding(table, ids).astype(np.float32).to_host().sync()
        same(got, table.astype(np.float32).to_host().sync()[[5, 0, -1]])


@pytest.mark.parametrize("bad", [3, -4, 100])
async def test_an_index_out_of_range_fails_the_op(bad: int) -> None:
    x = await api.from_host(X)
    i = await api.from_host(np.array([0, bad, 1]))
    with pytest.raises(IndexError, match=rf"ops\.take: index {bad} is out of range for axis 0 of size 3"):
        await ops.take(x, i, 0)
    with pytest.raises(IndexError, match=rf"index {bad} .*axis 0 of size 3"):
        await ops.take(x, i, 0).sum().to_host()  # later ops of the submission do not hide it
    with pytest.raises(IndexError, match=r"ops\.take \(indexing\)"):
        await x[i].to_host()
    with pytest.raises(IndexError, match=r"ops\.embedding"):
        await ops.embedding(x[:, :, 0], i)
    with pytest.raises(IndexError, match=r"ops\.take_along_axis: index"):
        await ops.take_along_axis(x, i.reshape(3, 1, 1), 0)
    with pytest.raises(IndexError, match=rf"index {30 * bad} is out of range for the flattened tensor of size 60"):
        await ops.take(x, i * 30)
    # the device keeps working: the kernel never read outside the tensor
    same(await ops.take(x, await api.from_host(np.array([2, 0])), 0).to_host(), X[[2, 0]])


def test_sync_raises_the_index_error_too() -> None:
    with pytest.raises(IndexError, match=r"ops\.take: index 5 is out of range for axis 1 of size 4"):
        ops.take(up(X), up(np.array([5])), 1).sync()


async def test_out_writes_into_the_given_tensor() -> None:
    x, i = await api.from_host(X), await api.from_host(IDX)
    out = await api.zeros((3, 3, 2, 5))
    got = await ops.take(x, i, 1, out=out)
    assert got is out
    same(await out.to_host(), np.take(X, IDX, 1))
    wide = await api.zeros((2, 9))
    await ops.take(x[0], i[0], 1, out=wide[:, 1:5].T)  # a strided out= view
    want = np.zeros((2, 9), np.float32)
    want[:, 1:5] = np.take(X[0], IDX[0], 1).T
    same(await wide.to_host(), want)


async def test_gathers_are_captured_and_replayed() -> None:
    w = RNG.normal(size=(6, 3)).astype(np.float32)
    weight = await api.from_host(w)
    ids = await api.from_host(np.array([1, 2], np.int64))
    out = await api.zeros((2, 3))
    graph = ops.embedding(weight, ids, out=out).graph()
    same(await out.to_host(), np.zeros((2, 3), np.float32))  # the capture ran nothing
    await graph.launch()
    same(await out.to_host(), w[[1, 2]])
    await api.memcpy(ids, await api.from_host(np.array([5, -1], np.int64)))
    await graph.launch()
    same(await out.to_host(), w[[5, -1]])
    # inside a graph an index out of range is clamped (documented), never read outside
    await api.memcpy(ids, await api.from_host(np.array([6, 0], np.int64)))
    await graph.launch()
    same(await out.to_host(), w[[0, 0]])


def test_bad_input_is_refused_before_any_work() -> None:
    x = up(X)
    with pytest.raises(TypeError, match="must be integers, not float32"):
        ops.take(x, x, 0)
    with pytest.raises(TypeError, match="boolean indices"):
        ops.take(x, up(np.array([True, False])), 0)
    with pytest.raises(TypeError, match="from_host"):
        ops.take(x, np.array([0, 1]), 0)
    with pytest.raises(TypeError, match="uint64"):
        ops.take(x, up(np.array([0], np.uint64)), 0)
    with pytest.raises(ValueError, match="axis 3"):
        ops.take(x, up(IDX), 3)
    with pytest.raises(TypeError, match="axis must be an int"):
        ops.take(x, up(IDX), 1.5)
    with pytest.raises(ValueError, match="differ in rank"):
        ops.take_along_axis(x, up(IDX), 1)
    with pytest.raises(ValueError, match="1-D"):
        ops.take_along_axis(x, up(IDX), None)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        ops.take_along_axis(x, up(np.zeros((2, 1, 1), np.int64)), 1)
    with pytest.raises(ValueError, match="must be 2-D"):
        ops.embedding(x, up(IDX))
    with pytest.raises(IndexError, match="empty axis"):
        ops.take(up(np.zeros((0, 3), np.float32)), up(IDX), 0)
    with pytest.raises(ValueError, match="out= has shape"):
        ops.take(x, up(IDX), 0, out=up(np.zeros((3,), np.float32)))
    with pytest.raises(TypeError, match="one integer index tensor"):
        x[up(IDX), up(IDX)]
    with pytest.raises(TypeError, match=r"x\[idx\]"):
        x[0, up(IDX)]
    with pytest.raises(TypeError, match="must be integers, not float32"):
        x[x + 0].sync()  # an op's dtype is known when the submission is planned
