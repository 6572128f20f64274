"""sort, argsort and topk against numpy: stable orders (ties by index), NaN last (first
among topk's largest), every axis, rows of any length (not only powers of two), integer
dtypes, out=, graph captures and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import trio_cuda
from trio_cuda import api, ops

from ..helpers.arrays import host, same, up

RNG = np.random.default_rng(6)
A = RNG.integers(-3, 4, size=(3, 5, 7)).astype(np.float32)  # many ties
A[0, 1, 2] = A[1, 2, 3] = A[1, 2, 5] = np.nan


def descending(a: np.ndarray) -> np.ndarray:
    """The stable largest-first order along the last axis (NaN first, ties by index)."""
    n = a.shape[-1]
    return (n - 1 - np.argsort(a[..., ::-1], axis=-1, kind="stable"))[..., ::-1]


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
def test_sort_and_argsort_are_numpys_stable_sort(axis: int | None) -> None:
    x = up(A)
    same(host(ops.sort(x, axis)), np.sort(A, axis, kind="stable"))
    same(host(ops.argsort(x, axis)), np.argsort(A, axis, kind="stable"))


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64, np.float64, np.bool_])
def test_other_dtypes_and_long_rows(dtype: type) -> None:
    a = RNG.integers(0, 50, size=(2, 300)).astype(dtype)  # several steps of 256 pairs
    same(host(ops.sort(up(a))), np.sort(a, kind="stable"))
    same(host(ops.argsort(up(a))), np.argsort(a, kind="stable"))
    same(host(ops.argsort(up(a).T, 0)), np.argsort(a.T, 0, kind="stable"))  # a strided view


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_topk_largest_and_smallest(k: int) -> None:
    values, indices = ops.topk(up(A), k).sync()
    order = descending(A)[..., :k]
    same(indices.to_host().sync(), order)
    same(values.to_host().sync(), np.take_along_axis(A, order, -1))
    v, i = ops.topk(up(A) * 1, k, largest=False).unzip()  # an op as input; unzip needs no count
    asc = np.argsort(A, -1, kind="stable")[..., :k]
    same(i.to_host().sync(), asc)
    same(v.to_host().sync(), np.take_along_axis(A, asc, -1))


async def test_out_and_errors() -> None:
    x = await api.from_host(A)
    out = await api.zeros(A.shape)
    assert await ops.sort(x, 1, out=out) is out
    same(await out.to_host(), np.sort(A, 1, kind="stable"))
    iout = await api.zeros(A.shape, np.int64)
    assert await ops.argsort(x, out=iout) is iout
    same(await iout.to_host(), np.argsort(A, kind="stable"))
    vo, io = await api.zeros((3, 5, 2)), await api.zeros((3, 5, 2), np.int64)
    got = await ops.topk(x, 2, out=(vo, io))
    assert got[0] is vo and got[1] is io
    same(await io.to_host(), descending(A)[..., :2])
    with pytest.raises(ValueError, match="k=8 is out of range for an axis of size 7"):
        ops.topk(x, 8)
    with pytest.raises(TypeError, match="k must be an int"):
        ops.topk(x, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="out= must be a tuple of two tensors"):
        ops.topk(x, 2, out=vo)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="axis 3"):
        ops.sort(x, 3)
    with pytest.raises(ValueError, match="0-d"):
        ops.argsort(await api.from_host(np.float32(1.0)))
    with pytest.raises(TypeError, match=r"cannot cast the int64 result"):
        ops.argsort(x, out=await api.zeros(A.shape, np.bool_))
    with pytest.raises(trio_cuda.GraphCaptureError, match="allocat"):
        ops.topk(x, 2, out=(vo, io)).graph()  # its scratch memory cannot be allocated in a capture


async def test_sort_and_argsort_along_the_last_axis_are_captured() -> None:
    x = await api.from_host(A)
    values, order = await api.zeros(A.shape), await api.zeros(A.shape, np.int64)
    graph = trio_cuda.zip(ops.sort(x, out=values), ops.argsort(x, out=order)).graph()
    await graph.launch()
    same(await values.to_host(), np.sort(A, kind="stable"))
    same(await order.to_host(), np.argsort(A, kind="stable"))
    b = RNG.normal(size=A.shape).astype(np.float32)
    await api.memcpy(x, b)
    await graph.launch()  # replayed on new data
    same(await values.to_host(), np.sort(b))
    same(await order.to_host(), np.argsort(b, kind="stable"))
