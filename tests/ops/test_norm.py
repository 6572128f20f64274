"""layer_norm and rms_norm on bfloat16 and float16 rows, in every kernel variant
(``_norm.NormTuning``: the scalar kernel, two or four values per word, rows kept in
registers or read twice, 64 to 512 threads per row), against numpy through ml_dtypes:
computed in float64 and rounded once to the half type, a few units in its last place
apart. The shapes and layouts decide between the packed and the scalar kernel: widths
that are multiples of 4, of 2 and odd ones (8191, 7, 3, 1), zero rows, non-contiguous
and misaligned inputs, outputs and weights, weights of another dtype, in place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import trio_cuda  # noqa: F401  (before numba.cuda: it chooses the backend)
from trio_cuda import api, ops
from trio_cuda._ops import _norm

RNG = np.random.default_rng(35)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
ULP = {BF16: 2.0**-8, F16: 2.0**-11}
VARIANTS = {
    "scalar": _norm.NormTuning(pack=1),
    "pack2": _norm.NormTuning(pack=2),
    "pack4": _norm.NormTuning(),
    "pack4 t64 regs": _norm.NormTuning(threads=64, cache_words=4),
    "pack4 t512 regs": _norm.NormTuning(threads=512, cache_words=2),
}


@pytest.fixture(params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    _norm.TUNING = VARIANTS[request.param]
    yield request.param
    _norm.TUNING = _norm.NormTuning()


def data(shape: tuple[int, ...], dt: np.dtype[Any], low: float = -3.0, high: float = 3.0) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float32).astype(dt)


def want(x: np.ndarray, w: Any, b: Any, rms: bool, eps: float, nd: int = 1) -> np.ndarray:
    axes = tuple(range(x.ndim - nd, x.ndim))
    v = x.astype(np.float64)
    if rms:
        r = v / np.sqrt((v * v).mean(axes, keepdims=True) + eps)
    else:
        r = (v - v.mean(axes, keepdims=True)) / np.sqrt(v.var(axes, keepdims=True) + eps)
    if w is not None:
        r = r * np.asarray(w).astype(np.float64)
    if b is not None:
        r = r + np.asarray(b).astype(np.float64)
    return r


def close(got: np.ndarray, expected: np.ndarray, dt: np.dtype[Any], ulps: float = 8) -> None:
    assert got.dtype == dt and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    tol = ULP[dt] * ulps
    rounded = expected.astype(np.float32).astype(dt).astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), rounded, rtol=tol, atol=tol)


async def norm(rms: bool, x: Any, w: Any = None, b: Any = None, eps: float = 1e-5, out: Any = None) -> np.ndarray:
    op = ops.rms_norm(x, w, eps, out=out) if rms else ops.layer_norm(x, w, b, eps, out=out)
    return await op.to_host()


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("width", [8, 6, 7, 3, 1, 36, 8191, 8192])
async def test_widths(variant: str, dt: np.dtype[Any], rms: bool, width: int) -> None:
    a = data((3, width), dt, 2.0, 6.0)  # a mean far from 0 against the spread: the shifted moments
    w, b = data((width,), dt, 0.5, 2.0), data((width,), dt)
    x, wt, bt = await api.from_host(a), await api.from_host(w), await api.from_host(b)
    close(await norm(rms, x, wt, bt), want(a, w, None if rms else b, rms, 1e-5), dt)
    close(await norm(rms, x), want(a, None, None, rms, 1e-5), dt)


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
async def test_layouts(variant: str, dt: np.dtype[Any], rms: bool) -> None:
    a = data((6, 17), dt)
    x = await api.from_host(a)
    w32 = data((8,), np.dtype(np.float32), 0.5, 2.0)
    wbig = data((9,), dt, 0.5, 2.0)
    wt32, wtbig = await api.from_host(w32), await api.from_host(wbig)
    b = None if rms else wtbig[1:9]
    bh = None if rms else wbig[1:9]
    # rows offset by one row (16 bytes: aligned) and by one element (2 bytes: not)
    close(await norm(rms, x[1:, :8]), want(a[1:, :8], None, None, rms, 1e-5), dt)
    close(await norm(rms, x[:, 1:9], wt32, b), want(a[:, 1:9], w32, bh, rms, 1e-5), dt)
    # a weight of float32, one misaligned (a view from the second element), a column view
    close(await norm(rms, x[:, :8], wtbig[1:9], wt32), want(a[:, :8], wbig[1:9], None if rms else w32, rms, 1e-5), dt)
    close(await norm(rms, x[:, ::2]), want(a[:, ::2], None, None, rms, 1e-5), dt)
    close(await norm(rms, x.T[:8]), want(a.T[:8], None, None, rms, 1e-5), dt)
    # a 3-d input over its last two axes, zero rows
    a3 = data((2, 3, 4), dt)
    w3 = data((3, 4), dt, 0.5, 2.0)
    x3, wt3 = await api.from_host(a3), await api.from_host(w3)
    close(await norm(rms, x3, wt3), want(a3, w3, None, rms, 1e-5, nd=2), dt)
    empty = await norm(rms, await api.from_host(np.zeros((0, 8), dt)))
    assert empty.shape == (0, 8) and empty.dtype == dt


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
async def test_outputs(variant: str, rms: bool) -> None:
    a = data((4, 8), BF16)
    expected = want(a, None, None, rms, 1e-5)
    x = await api.from_host(a)
    big = await api.zeros((40,), "bfloat16")
    for start in (1, 2, 4):  # out= at 2, 4 and 8 bytes from a word's start
        out = big[start : start + 32].reshape(4, 8)
        await norm(rms, x, out=out)
        close(await out.to_host(), expected, BF16)
    strided = (await api.zeros((4, 16), "bfloat16"))[:, ::2]
    await norm(rms, x, out=strided)
    close(await strided.to_host(), expected, BF16)
    await norm(rms, x, out=x)  # in place
    close(await x.to_host(), expected, BF16)


async def test_special_values(variant: str) -> None:
    """A NaN spreads over its row only (it is quiet in the result)."""
    a = data((3, 8), BF16)
    a[1, 3] = np.nan
    got = await norm(False, await api.from_host(a))
    assert np.isnan(got[1].astype(np.float32)).all()
    close(got[[0, 2]], want(a[[0, 2]], None, None, False, 1e-5), BF16)
