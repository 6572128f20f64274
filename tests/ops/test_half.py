"""bfloat16 and float16 in every elementwise, activation, comparison, reduction, softmax and
normalisation op, against numpy through ml_dtypes: computed in float32 from the half
inputs and rounded once to the half type (tolerance: a few units in the last place of
the half type, since the device's float32 math and summation order may differ by an
ulp before rounding). Promotion as PyTorch: bfloat16 with bfloat16, integers or Python
scalars stays bfloat16; with float16 or float32 it is float32."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, ops

from ..helpers.arrays import BINARY

RNG = np.random.default_rng(55)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALVES = [BF16, F16]
ULP = {BF16: 2.0**-8, F16: 2.0**-11}


def data(shape: tuple[int, ...], dt: np.dtype[Any], low: float = -3, high: float = 3) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float32).astype(dt)


def f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def close(got: np.ndarray, want: Any, dt: np.dtype[Any], ulps: float = 4, atol: float = 0.0) -> None:
    """``got`` (of dtype ``dt``) against ``want`` computed in float32 and rounded once to ``dt``."""
    want = np.asarray(want)
    assert got.dtype == dt, (got.dtype, dt)
    assert got.shape == want.shape, (got.shape, want.shape)
    rounded = want.astype(np.float32).astype(dt).astype(np.float64) if dt != np.bool_ else want
    if dt == np.bool_ or dt.kind in "iu":
        np.testing.assert_array_equal(got, rounded)
        return
    tol = ULP[dt] * ulps
    np.testing.assert_allclose(got.astype(np.float64), rounded, rtol=tol, atol=atol or tol, equal_nan=True)


UNARY: list[tuple[str, Callable[..., Any], Callable[[np.ndarray], np.ndarray] | None]] = [
    ("negative", ops.negative, np.negative),
    ("abs", ops.abs, np.abs),
    ("exp", ops.exp, np.exp),
    ("log", lambda x: ops.log(ops.abs(x) + 1), None),
    ("sqrt", lambda x: ops.sqrt(ops.abs(x)), None),
    ("tanh", ops.tanh, np.tanh),
    ("relu", ops.relu, lambda a: np.maximum(a, 0)),
    ("sigmoid", ops.sigmoid, lambda a: 1 / (1 + np.exp(-a))),
    ("silu", ops.silu, lambda a: a / (1 + np.exp(-a))),
    ("gelu", ops.gelu, lambda a: 0.5 * a * (1 + np.tanh(0.7978845608028654 * (a + 0.044715 * a**3)))),
    ("gelu exact", lambda x: ops.gelu(x, approximate="none"), lambda a: 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))),
]


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("name,op,ref", UNARY, ids=[u[0] for u in UNARY])
async def test_unary_ops_and_activations(dt: np.dtype[Any], name: str, op: Any, ref: Any) -> None:
    a = data((6, 300), dt)  # past 1024 elements: the unrolled path
    a[0, 0] = np.nan
    got = await op(await api.from_host(a)).to_host()
    with np.errstate(all="ignore"):
        if name == "log":  # (two ops: the inner result is rounded to the half type first)
            want = np.log(f32((np.abs(f32(a)) + 1).astype(dt)))
        elif name == "sqrt":
            want = np.sqrt(np.abs(f32(a)))
        else:
            want = ref(f32(a))
    close(got, want.astype(np.float32), dt, atol=ULP[dt] * 4)


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("name,fn", BINARY, ids=[b[0] for b in BINARY])
async def test_binary_ops_with_tensors_scalars_and_integers(dt: np.dtype[Any], name: str, fn: Any) -> None:
    a, b = data((4, 5), dt), data((5,), dt, 0.5, 3)
    x, y = await api.from_host(a), await api.from_host(b)
    op = getattr(ops, name)
    close(await op(x, y).to_host(), fn(f32(a), f32(b)), dt)
    close(await op(x, 2.5).to_host(), fn(f32(a), np.float32(2.5)), dt)  # a weak scalar keeps the half type
    i8 = RNG.integers(1, 5, (5,)).astype(np.int8)
    close(await op(x, await api.from_host(i8)).to_host(), fn(f32(a), i8.astype(np.float32)), dt)
    f = data((5,), np.dtype(np.float32), 0.5, 3)
    got = await op(x, await api.from_host(f)).to_host()  # with float32: float32
    np.testing.assert_allclose(got, fn(f32(a), f), rtol=1e-6)


async def test_bfloat16_with_float16_is_float32_as_pytorch() -> None:
    a, b = data((3, 4), BF16), data((3, 4), F16)
    got = await (await api.from_host(a) + await api.from_host(b)).to_host()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, f32(a) + f32(b))


@pytest.mark.parametrize("idt", ["bool", "uint8", "int16", "uint16", "int32", "int64", "uint64"])
async def test_bfloat16_with_any_integers_stays_bfloat16_as_pytorch(idt: str) -> None:
    """numpy's float16 (bfloat16's stand-in) widens beside int16 and wider integers; PyTorch's
    bfloat16 does not, in arithmetic, where and concatenate alike."""
    a, i = data((3, 4), BF16), RNG.integers(0, 5, (4,)).astype(idt)
    x, t = await api.from_host(a), await api.from_host(i)
    close(await (x * t).to_host(), f32(a) * i.astype(np.float32), BF16)
    close(await (t - x).to_host(), i.astype(np.float32) - f32(a), BF16)
    close(await ops.where(x > 0, x, t).to_host(), np.where(f32(a) > 0, f32(a), i.astype(np.float32)), BF16)
    got = await ops.concatenate([x[0], t]).to_host()
    assert got.dtype == BF16


COMPARE = ["equal", "not_equal", "less", "less_equal", "greater", "greater_equal"]


@pytest.mark.parametrize("dt", HALVES, ids=str)
async def test_comparisons_logic_and_where(dt: np.dtype[Any]) -> None:
    a = np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -0.0, -2.5, 1.0], np.float32).astype(dt)
    b = np.array([1.0, 1.0, np.inf, 0.0, -0.0, 1.0, 2.0, 1.0078125], np.float32).astype(dt)
    x, y = await api.from_host(a), await api.from_host(b)
    for name in COMPARE:
        got = await getattr(ops, name)(x, y).to_host()
        np.testing.assert_array_equal(got, getattr(np, name)(f32(a), f32(b)), err_msg=name)
    np.testing.assert_array_equal(await (x > 0.5).to_host(), f32(a) > 0.5)
    for name in ("isnan", "isinf", "isfinite"):
        np.testing.assert_array_equal(await getattr(ops, name)(x).to_host(), getattr(np, name)(f32(a)), err_msg=name)
    for name in ("logical_and", "logical_or", "logical_xor"):  # -0.0 is false, NaN true
        np.testing.assert_array_equal(await getattr(ops, name)(x, y).to_host(), getattr(np, name)(f32(a), f32(b)), err_msg=name)
    np.testing.assert_array_equal(await ops.logical_not(x).to_host(), np.logical_not(f32(a)))
    w = await ops.where(x, x, 7.0).to_host()  # a half condition, half values, a weak scalar
    close(w, np.where(f32(a) != 0, f32(a), np.float32(7)), dt)
    with pytest.raises(TypeError, match="not supported"):
        ops.bitwise_and(x, y)


REDUCE = [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)]


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("axis", [1, 0, None, (0, 1)], ids=str)
async def test_reductions(dt: np.dtype[Any], axis: Any) -> None:
    a = data((6, 1500), dt)
    x = await api.from_host(a)
    for name, fn in REDUCE:
        got = await getattr(ops, name)(x, axis).to_host()
        want = fn(f32(a).astype(np.float64), axis=axis)
        # a sum of n terms in float32, in another order: cancellation bounds the error by
        # the sum of magnitudes, not by the result
        scale = np.sum(np.abs(f32(a)), axis=axis) if name == "sum" else 1.0
        close(got, np.asarray(want, np.float32), dt, atol=ULP[dt] * 4 * float(np.max(scale)) / max(a.size / np.size(want), 1) * 4)
    if axis is None or isinstance(axis, int):
        for arg in ("argmax", "argmin"):
            got = await getattr(ops, arg)(x, axis).to_host()
            np.testing.assert_array_equal(got, getattr(np, arg)(f32(a), axis=axis))
    small = data((6, 40), dt, 0.5, 1.5)  # a product of 40 terms stays in range
    xs = await api.from_host(small)
    close(await ops.prod(xs, 1).to_host(), np.prod(f32(small).astype(np.float64), axis=1).astype(np.float32), dt, ulps=8)
    truth = small * (RNG.random(small.shape) < 0.9)
    xt = await api.from_host(truth.astype(dt))
    for name in ("any", "all"):
        got = await getattr(ops, name)(xt, 1).to_host()
        np.testing.assert_array_equal(got, getattr(np, name)(f32(truth) != 0, axis=1))
    # the two-pass statistics: float32 inside, one rounding into the half type
    for name, ref in (("var", np.var), ("std", np.std)):
        close(
            await getattr(ops, name)(x, axis).to_host(),
            np.asarray(ref(f32(a).astype(np.float64), axis=axis), np.float32),
            dt,
            ulps=8,
        )
    if axis is None or isinstance(axis, int):
        v = f32(a).astype(np.float64)
        mx = np.max(v, axis=axis, keepdims=True)
        want = (np.log(np.sum(np.exp(v - mx), axis=axis, keepdims=True)) + mx).squeeze(axis=axis)
        close(await ops.logsumexp(x, axis).to_host(), np.asarray(want, np.float32), dt, ulps=8)


@pytest.mark.parametrize("dt", HALVES, ids=str)
async def test_softmax_and_log_softmax(dt: np.dtype[Any]) -> None:
    a = data((5, 1300), dt)
    x = await api.from_host(a)
    v = f32(a).astype(np.float64)
    for axis in (-1, 0):
        e = np.exp(v - v.max(axis=axis, keepdims=True))
        close(await ops.softmax(x, axis).to_host(), e / e.sum(axis=axis, keepdims=True), dt, atol=ULP[dt] * 2**-8)
        lsm = np.log(e / e.sum(axis=axis, keepdims=True))
        close(await ops.log_softmax(x, axis).to_host(), lsm, dt, atol=ULP[dt] * 8)


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("wdt", ["same", "float32"])
async def test_layer_norm_and_rms_norm(dt: np.dtype[Any], wdt: str) -> None:
    a = data((4, 1100), dt) + np.asarray(5, dt)  # a mean away from zero: the shifted moments
    wd = dt if wdt == "same" else np.dtype(np.float32)
    w, b = data((1100,), wd, 0.5, 1.5), data((1100,), wd)
    x, wt, bt = await api.from_host(a), await api.from_host(w), await api.from_host(b)
    v = f32(a).astype(np.float64)
    mean = v.mean(-1, keepdims=True)
    ln = (v - mean) / np.sqrt(((v - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * f32(w) + f32(b)
    close(await ops.layer_norm(x, wt, bt).to_host(), ln, dt, ulps=8)
    rms = v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * f32(w)
    close(await ops.rms_norm(x, wt).to_host(), rms, dt, ulps=8)


async def test_out_of_another_dtype_rounds_once_where_numpy_does() -> None:
    a, b = data((300,), BF16), data((300,), np.dtype(np.float32))
    x, y = await api.from_host(a), await api.from_host(b)
    o16 = await api.empty((300,), BF16)
    await ops.add(x, y, out=o16)  # a float32 sum stored into bfloat16: rounded once
    close(await o16.to_host(), f32(a) + b, BF16, ulps=0.5)
    o32 = await api.empty((300,), np.float32)
    await ops.multiply(x, x, out=o32)  # a bfloat16 product widened: rounded to bfloat16 first
    np.testing.assert_array_equal(await o32.to_host(), (f32(a) * f32(a)).astype(BF16).astype(np.float32))
    assert isinstance(trio_cuda.ops.exp(x), trio_cuda.DeviceOp)


@pytest.mark.parametrize("dt", HALVES, ids=str)
async def test_cumsum_sort_argsort_topk(dt: np.dtype[Any]) -> None:
    """cumsum in float32, each partial sum rounded once; sort, argsort and topk compare
    the values exactly (float32 holds them), ties by index, NaN last (topk: first), and
    keep the dtype (indices int64)."""
    a = data((4, 300), dt)
    a[0, 5] = a[0, 17] = a[2, 0] = np.nan
    a[1, 3:9] = a[1, 2]  # ties
    a[3, 10], a[3, 11] = -0.0, 0.0
    x = await api.from_host(a)
    v = f32(a).astype(np.float64)
    for axis in (1, 0, None):
        got = await ops.cumsum(x, axis).to_host()
        want = np.cumsum(np.nan_to_num(v, nan=0.0) if axis is not None else v, axis=axis)
        if axis is not None:
            want = np.where(np.cumsum(np.isnan(v), axis=axis) > 0, np.nan, want)
        scale = np.cumsum(np.abs(np.nan_to_num(v)), axis=axis)  # a scan's error: relative to the magnitudes
        close(got, want, dt, atol=float(np.max(scale)) * 2.0**-20 + ULP[dt] * 4)
    wide = await ops.cumsum(x, 1, dtype=np.float32).to_host()
    assert wide.dtype == np.float32
    np.testing.assert_allclose(wide[1:2], np.cumsum(f32(a[1:2]), axis=1), rtol=1e-5, atol=1e-4)
    for axis in (-1, 0, None):
        got = await ops.sort(x, axis).to_host()
        assert got.dtype == dt
        np.testing.assert_array_equal(f32(got), np.sort(f32(a), axis=axis, kind="stable"))
        idx = await ops.argsort(x, axis).to_host()
        assert idx.dtype == np.int64
        np.testing.assert_array_equal(idx, np.argsort(f32(a), axis=axis, kind="stable"))
    vals, ind = await ops.topk(x, 7).then(lambda r: trio_cuda.zip(r[0].to_host(), r[1].to_host()))
    # largest first, NaN as the largest, ties by index: numpy's stable order of -v
    order = np.argsort(np.where(np.isnan(v), -np.inf, -v), axis=-1, kind="stable")[:, :7]
    assert vals.dtype == dt and ind.dtype == np.int64
    np.testing.assert_array_equal(ind, order)
    np.testing.assert_array_equal(f32(vals), np.take_along_axis(f32(a), order, -1))
    small, small_i = await ops.topk(x, 3, largest=False).then(lambda r: trio_cuda.zip(r[0].to_host(), r[1].to_host()))
    np.testing.assert_array_equal(small_i, np.argsort(f32(a), axis=-1, kind="stable")[:, :3])
    np.testing.assert_array_equal(f32(small), np.sort(f32(a), axis=-1)[:, :3])
