"""trio_cuda.ops against numpy: dtypes, broadcasting, axes, views, out=, laziness, errors.

The same tests run on CUDA (tolerances per dtype); on the simulated device every op runs
its numpy twin (tests/ops/test_ops_numba.py runs the generated numba kernels themselves).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, ops

from ..helpers.arrays import BINARY

RNG = np.random.default_rng(7)
FLOATS = [np.float16, np.float32, np.float64]
TOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}


def data(shape: tuple[int, ...], dtype: type = np.float32, low: float = -3, high: float = 3) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return RNG.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        lo = 0 if dt.kind == "u" else -50
        return RNG.integers(lo, 50, shape).astype(dt)
    return RNG.uniform(low, high, shape).astype(dt)


def close(got: np.ndarray, want: np.ndarray, dtype: object = None) -> None:
    want = np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    dt = np.dtype(dtype) if dtype is not None else got.dtype
    if dt.kind == "f":
        tol = TOL[dt]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol * 4, atol=tol * 4, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


async def up(a: np.ndarray) -> trio_cuda.Tensor:
    return await api.from_host(a)


# -- elementwise ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,fn", BINARY)
@pytest.mark.parametrize(
    "dtypes",
    [
        (np.float32, np.float32),
        (np.float16, np.float16),
        (np.int32, np.float32),
        (np.int64, np.int64),
        (np.uint8, np.int8),
        (np.float64, np.float32),
    ],
)
async def test_binary_ops_follow_numpy(name: str, fn: object, dtypes: tuple[type, type]) -> None:
    a, b = data((4, 5), dtypes[0]), data((5,), dtypes[1])
    if name == "divide":
        b = np.where(b == 0, 1, b).astype(dtypes[1])
    with np.errstate(all="ignore"):
        want = fn(a, b)  # type: ignore[operator]
    got = await getattr(ops, name)(await up(a), await up(b)).to_host()
    close(got, want)


@pytest.mark.parametrize("shapes", [((3, 1, 4), (2, 1)), ((1,), (2, 3)), ((), (4,)), ((2, 0, 3), (3,)), ((5, 4), (5, 4))])
async def test_broadcasting_shapes(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    a, b = data(shapes[0]), data(shapes[1])
    close(await (await up(a) + await up(b)).to_host(), a + b)


async def test_weak_python_scalars_and_strong_numpy_scalars() -> None:
    x16 = await up(data((3,), np.float16))
    assert (await (x16 * 2.5)).dtype == np.float16  # a Python float is weak (NEP 50)
    assert (await (x16 * np.float32(2.5))).dtype == np.float32  # a numpy scalar is not
    ai = data((3,), np.int8)
    xi = await up(ai)
    assert (await (xi + 1)).dtype == np.int8
    assert (await (xi + 1.0)).dtype == np.float64
    close(await (3 - xi).to_host(), 3 - ai)
    with pytest.raises(OverflowError):
        xi + 1000


async def test_bool_tensors_and_python_bools_follow_numpy() -> None:
    """A Python bool is numpy's bool (not a weak int); bool - bool and -bool are refused
    as numpy refuses them, bool - int is allowed."""
    flags, ints = data((6,), np.bool_), data((6,), np.int16)
    f, i = await up(flags), await up(ints)
    for name, fn in BINARY:
        for args, np_args in (((i, True), (ints, True)), ((False, f), (False, flags)), ((f, i), (flags, ints))):
            try:
                with np.errstate(all="ignore"):
                    want = fn(*np_args)  # type: ignore[operator]
            except TypeError:
                with pytest.raises(TypeError):
                    getattr(ops, name)(*args)
                continue
            close(await getattr(ops, name)(*args).to_host(), want)
    with pytest.raises(TypeError, match="boolean subtract"):
        ops.subtract(f, f)
    with pytest.raises(TypeError, match="boolean negative"):
        ops.negative(f)


UNARY = [
    ("negative", np.negative, np.float32),
    ("abs", np.abs, np.int32),
    ("abs", np.abs, np.float32),
    ("exp", np.exp, np.float32),
    ("exp", np.exp, np.int16),
    ("log", np.log, np.float64),
    ("sqrt", np.sqrt, np.float32),
    ("tanh", np.tanh, np.float16),
]


@pytest.mark.parametrize("name,fn,dtype", UNARY)
async def test_unary_ops_follow_numpy(name: str, fn: object, dtype: type) -> None:
    a = data((6, 7), dtype)
    if name in ("log", "sqrt"):
        a = np.abs(a) + np.asarray(1, a.dtype)
    want = fn(a)  # type: ignore[operator]
    close(await getattr(ops, name)(await up(a)).to_host(), want)


def _gelu_exact(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("dtype", FLOATS)
async def test_activations(dtype: type) -> None:
    a = data((5, 8), dtype)
    a[0, 0] = np.nan
    x = await up(a)
    a64 = a.astype(np.float64)
    for got, want in [
        (await ops.relu(x).to_host(), np.where(np.isnan(a64), np.nan, np.maximum(a64, 0))),
        (await ops.sigmoid(x).to_host(), 1 / (1 + np.exp(-a64))),
        (await ops.silu(x).to_host(), a64 / (1 + np.exp(-a64))),
        (await ops.gelu(x).to_host(), _gelu_tanh(a64)),
        (await ops.gelu(x, approximate="none").to_host(), _gelu_exact(a64)),
        (await ops.rsqrt(ops.abs(x) + 1).to_host(), 1 / np.sqrt(np.abs(a64) + 1)),
    ]:
        close(got, want.astype(dtype))


async def test_where() -> None:
    c = data((4, 1), np.bool_)
    a, b = data((4, 3)), data((3,), np.float64)
    close(await ops.where(await up(c), await up(a), await up(b)).to_host(), np.where(c, a, b))
    close(await ops.where(await up(a), 1.0, await up(b)).to_host(), np.where(a != 0, 1.0, b))


async def test_operators_on_tensors_and_ops() -> None:
    a, b = data((3, 4)), data((4,))
    x, y = await up(a), await up(b)
    close(await ((x + y) * 2 - y / 4).to_host(), ((a + b) * 2 - b / 4).astype(np.float32))
    close(await (-(x - 1)).to_host(), -(a - 1))
    close(await abs(x - 1).to_host(), np.abs(a - 1))
    close(await (np.float32(2) * x).to_host(), 2 * a)  # numpy scalars defer to the tensor
    op = (api.from_host(a) + 1).shared()  # ops compose with operators too (used twice: shared)
    assert isinstance(op, trio_cuda.DeviceOp)
    close(await (op * op).to_host(), (a + 1) * (a + 1))


# -- laziness, out=, graphs ----------------------------------------------------------------------------
async def test_a_lazy_expression_is_one_submission(dev: trio_cuda.Device) -> None:
    xh, w1h, b1h, w2h = data((8, 16)), data((16, 32)), data((32,)), data((32, 4))
    x, w1, b1, w2 = [await up(v) for v in (xh, w1h, b1h, w2h)]
    before = trio_cuda.lowlevel.submission_statistics().planned
    expr = ((x @ w1 + b1).relu() @ w2).sum(axis=1)
    assert trio_cuda.lowlevel.submission_statistics().planned == before  # nothing happened yet
    got = await expr.to_host()
    assert trio_cuda.lowlevel.submission_statistics().planned == before + 1
    want = (np.maximum(xh @ w1h + b1h, 0) @ w2h).sum(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


async def test_out_writes_in_place_and_checks() -> None:
    a, b = data((3, 4)), data((3, 4))
    x, y = await up(a), await up(b)
    z = await api.zeros((3, 4))
    r = await ops.add(x, y, out=z)
    assert r is z
    close(await z.to_host(), a + b)
    zz = await api.zeros((3, 8))
    await ops.multiply(x, 2, out=zz[:, ::2])  # into a strided view
    close(await zz.to_host(), np.stack([2 * a, np.zeros_like(a)], axis=-1).reshape(3, 8))
    with pytest.raises(ValueError, match="shape"):
        ops.add(x, y, out=await api.zeros((4, 3)))
    with pytest.raises(TypeError, match="cast"):
        ops.add(x, y, out=await api.zeros((3, 4), np.int32))


async def test_out_overlapping_an_input_behaves_as_in_numpy() -> None:
    # numpy computes as if the inputs were copied first when out= overlaps them.
    a = data((10, 6))
    x = await up(a)
    want = a.copy()
    np.add(want[1:], want[:-1], out=want[1:])
    await ops.add(x[1:], x[:-1], out=x[1:])
    close(await x.to_host(), want)
    x = await up(a)
    await ops.multiply(x, 3, out=x)  # exactly in place: allowed as it is
    close(await x.to_host(), a * 3)
    x = await up(a)
    want = a.copy()
    np.sum(want, axis=1, out=want[:, 0])
    await ops.sum(x, axis=1, out=x[:, 0])
    close(await x.to_host(), want)
    sq = data((6, 6))
    x = await up(sq)
    await ops.matmul(x, x, out=x)
    close(await x.to_host(), sq @ sq)
    x = await up(sq)
    await ops.softmax(x, out=x)  # in place, row by row
    v = np.exp(sq - sq.max(-1, keepdims=True))
    close(await x.to_host(), v / v.sum(-1, keepdims=True))
    x = await up(a)
    want = a.copy()
    want[:, 3:] = want[:, :3].T.T  # concatenate into its own input
    await ops.concatenate([x[:, :3]], axis=1, out=x[:, 3:])
    close(await x.to_host(), want)


async def test_out_inside_a_graph_capture_and_allocation_refused() -> None:
    a, b = data((64,)), data((64,))
    x, y, z = await up(a), await up(b), await api.zeros((64,))
    w = await api.zeros((64,))
    graph = ops.multiply(ops.add(x, y, out=z), 2.0, out=w).graph()
    close(await w.to_host(), np.zeros(64, np.float32))  # capture runs nothing
    await graph.launch()
    close(await w.to_host(), 2 * (a + b))
    with pytest.raises(trio_cuda.GraphCaptureError, match="allocat"):
        (x + y).graph()  # a new output: allocation inside a capture


async def test_matmul_and_norms_with_out_are_captured_without_copies() -> None:
    """GEMMs of contiguous and transposed operands (2-D, matrix-vector, batched) and the
    norms read their operands in place: with out= they capture, nothing is allocated."""
    m, v, bt = data((32, 48)), data((48,)), data((3, 48, 16))
    wt, gamma = data((16, 48)), data((48,))
    xm, xv, xb, xw, xg = await up(m), await up(v), await up(bt), await up(wt), await up(gamma)
    o1, o2, o3, o4 = await api.zeros((32,)), await api.zeros((3, 32, 16)), await api.zeros((32, 16)), await api.zeros((32, 48))
    o5 = await api.zeros((32, 48))
    graph = trio_cuda.zip(
        ops.matmul(xm, xv, out=o1),
        ops.matmul(xm, xb, out=o2),
        ops.matmul(xm, xw.T, out=o3),
        ops.rms_norm(xm, xg, 1e-5, out=o4),
        ops.layer_norm(xm, xg, xg, 1e-5, out=o5),
    ).graph()
    await graph.launch()
    np.testing.assert_allclose(await o1.to_host(), m @ v, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(await o2.to_host(), m @ bt, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(await o3.to_host(), m @ wt.T, rtol=1e-4, atol=1e-4)
    want = m / np.sqrt((m.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * gamma
    np.testing.assert_allclose(await o4.to_host(), want, rtol=1e-4, atol=1e-4)


# -- reductions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2), (2, 0)])
@pytest.mark.parametrize("keepdims", [False, True])
async def test_reductions_over_axes(name: str, axis: object, keepdims: bool) -> None:
    a = data((3, 4, 5))
    got = await getattr(ops, name)(await up(a), axis, keepdims=keepdims).to_host()
    close(got, getattr(np, name)(a, axis=axis, keepdims=keepdims))


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int32, np.uint16, np.float16, np.float64])
async def test_reduction_dtypes(dtype: type) -> None:
    a = data((6, 300), dtype)
    x = await up(a)
    close(await ops.sum(x, axis=1).to_host(), a.sum(axis=1))
    close(await ops.max(x, axis=0).to_host(), a.max(axis=0))
    if dtype != np.bool_:
        close(await ops.mean(x, axis=1).to_host(), a.mean(axis=1))
    close(await ops.argmax(x, axis=1).to_host(), a.argmax(axis=1))


async def test_argmax_ties_and_nans_follow_numpy() -> None:
    a = np.array([[1, 5, 5, 2], [np.nan, 1, np.nan, 9], [3, 3, 3, 3], [0, 1, 9, np.nan]], np.float32)
    a = np.tile(a, (1, 200))  # more columns than threads: ties across threads
    x = await up(a)
    close(await ops.argmax(x, axis=1).to_host(), a.argmax(axis=1))
    close(await ops.argmax(x).to_host(), np.asarray(a.argmax()))
    close(await ops.max(x, axis=1).to_host(), a.max(axis=1))


async def test_reductions_of_views_and_empty() -> None:
    a = data((6, 8))
    x = await up(a)
    close(await ops.sum(x[::2, 1:7:2], axis=0).to_host(), a[::2, 1:7:2].sum(axis=0))
    close(await ops.sum(x.T, axis=1).to_host(), a.T.sum(axis=1))
    e = await api.zeros((0, 3))
    close(await ops.sum(e, axis=0).to_host(), np.zeros(3, np.float32))
    close(await ops.sum(e, axis=1).to_host(), np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="identity"):
        ops.max(e, axis=0)
    with pytest.raises(TypeError, match="axis"):
        ops.argmax(x, axis=(0, 1))
    with pytest.raises(ValueError, match="repeated"):
        ops.sum(x, axis=(1, -1))


# -- normalisation -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axis", [-1, 0])
async def test_softmax_and_log_softmax(dtype: type, axis: int) -> None:
    a = data((5, 300), dtype, -20, 20)
    x = await up(a)
    v = a.astype(np.float64)
    v = v - v.max(axis=axis, keepdims=True)
    sm = np.exp(v) / np.exp(v).sum(axis=axis, keepdims=True)
    close(await ops.softmax(x, axis).to_host(), sm.astype(dtype))
    close(await ops.log_softmax(x, axis).to_host(), np.log(sm).astype(dtype))


@pytest.mark.parametrize("dtype", FLOATS)
async def test_layer_norm_and_rms_norm(dtype: type) -> None:
    a, w, b = data((4, 3, 70), dtype), data((70,), dtype), data((70,), dtype)
    x, wt, bt = await up(a), await up(w), await up(b)
    v = a.astype(np.float64)
    mean = v.mean(-1, keepdims=True)
    ln = (v - mean) / np.sqrt(((v - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    close(await ops.layer_norm(x, wt, bt).to_host(), (ln * w + b).astype(dtype))
    close(await ops.layer_norm(x).to_host(), ln.astype(dtype))
    rms = v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6)
    close(await ops.rms_norm(x, wt).to_host(), (rms * w).astype(dtype))
    # over the last two axes (weight of shape (3, 70))
    w2 = data((3, 70), dtype)
    v2 = v.reshape(4, -1)
    m2 = v2.mean(-1, keepdims=True)
    ln2 = ((v2 - m2) / np.sqrt(((v2 - m2) ** 2).mean(-1, keepdims=True) + 1e-5)).reshape(a.shape)
    close(await ops.layer_norm(x, await up(w2)).to_host(), (ln2 * w2).astype(dtype))


async def test_norm_arguments_are_checked() -> None:
    x = await api.zeros((2, 8))
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, eps=float("nan"))
    with pytest.raises(ValueError, match="does not match"):
        ops.layer_norm(x, await api.ones((7,)))
    with pytest.raises(TypeError, match="floating"):
        ops.softmax(await api.zeros((3,), np.int32))
    # numpy scalars are accepted wherever Python scalars are
    close(await ops.rms_norm(x + 1, eps=np.float32(1e-5)).to_host(), np.ones((2, 8), np.float32))


# -- matmul and linear ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shapes", [((5, 7), (7, 3)), ((7,), (7, 3)), ((5, 7), (7,)), ((2, 5, 7), (7, 3)), ((4, 1, 5, 7), (3, 7, 2)), ((7,), (7,))]
)
async def test_matmul_shapes_follow_numpy(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    a, b = data(shapes[0]), data(shapes[1])
    close(await ops.matmul(await up(a), await up(b)).to_host(), np.matmul(a, b))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
async def test_matmul_dtypes(dtype: str) -> None:
    dt = trio_cuda._checks.check_dtype(dtype)
    a, b = data((33, 65)), data((65, 17))
    x, y = await up(a.astype(dt)), await up(b.astype(dt))
    got = await (x @ y).to_host()
    assert got.dtype == dt
    want = a.astype(dt).astype(np.float64) @ b.astype(dt).astype(np.float64)
    tol = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


async def test_matmul_tf32_is_an_explicit_choice() -> None:
    a, b = data((64, 256)), data((256, 32))
    x, y = await up(a), await up(b)
    exact = await ops.matmul(x, y).to_host()
    fast = await ops.matmul(x, y, allow_tf32=True).to_host()
    want = a.astype(np.float64) @ b.astype(np.float64)
    bound = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)  # sum of |a_ik b_kj|
    assert (np.abs(exact - want) <= 1e-6 * bound + 1e-6).all()  # float32 products
    assert (np.abs(fast - want) <= 2 * 2.0**-11 * bound + 1e-6).all()  # TF32: 10-bit mantissas
    assert np.abs(fast - want).max() > 10 * np.abs(exact - want).max()  # TF32 rounds the inputs


async def test_matmul_of_transposed_and_strided_views() -> None:
    a, b = data((9, 6)), data((5, 9))
    x, y = await up(a), await up(b)
    close(await (x.T @ y.T).to_host(), a.T @ b.T)
    close(await (x[1:6, ::2] @ y.T[::3, 1:4]).to_host(), a[1:6, ::2] @ b.T[::3, 1:4])
    # reversed batches and reversed rows (negative strides) are copied before the GEMM
    c = data((3, 4, 9))
    z = await up(c)
    close(await (z[::-1] @ y.T).to_host(), c[::-1] @ b.T)
    close(await (z[:, ::-1] @ y.T[::-1]).to_host(), c[:, ::-1] @ b.T[::-1])


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
async def test_linear_matches_torch_semantics(activation: str | None, bias: bool) -> None:
    x, w, b = data((2, 3, 16)), data((8, 16)), data((8,))
    want = x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0)
    if activation == "relu":
        want = np.maximum(want, 0)
    elif activation == "gelu":
        want = _gelu_tanh(want)
    got = await ops.linear(await up(x), await up(w), await up(b) if bias else None, activation=activation).to_host()
    assert got.shape == (2, 3, 8)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


async def test_matmul_errors_before_any_work() -> None:
    x = await api.zeros((3, 4))
    with pytest.raises(ValueError, match="align"):
        x @ x
    with pytest.raises(TypeError, match="dtypes"):
        ops.matmul(x, await api.zeros((4, 2), np.float64))
    with pytest.raises(TypeError, match="not supported"):
        ops.matmul(await api.zeros((3, 4), np.int32), await api.zeros((4, 2), np.int32))
    with pytest.raises(ValueError, match="bias"):
        ops.linear(x, await api.zeros((5, 4)), await api.zeros((4,)))
    with pytest.raises(ValueError, match="activation"):
        ops.linear(x, await api.zeros((5, 4)), activation="tanh")


# -- random -----------------------------------------------------------------------------------------------------------------
async def test_random_is_reproducible_and_counter_based() -> None:
    u1 = await ops.uniform((1000,), seed=42).to_host()
    u2 = await ops.uniform((1000,), seed=42).to_host()
    np.testing.assert_array_equal(u1, u2)
    assert u1.dtype == np.float32 and u1.min() >= 0 and u1.max() < 1
    assert not np.array_equal(u1, await ops.uniform((1000,), seed=43).to_host())
    # counter-based: an offset continues the same sequence
    tail = await ops.uniform((500,), seed=42, offset=500).to_host()
    np.testing.assert_array_equal(tail, u1[500:])
    # the numpy twin of the generator gives the same numbers
    from trio_cuda._ops._random import philox

    w0 = philox(np.arange(1000, dtype=np.uint64), 42)[0]
    np.testing.assert_array_equal(u1, (w0 >> np.uint64(8)).astype(np.float32) * np.float32(2**-24))
    n = await ops.normal((20000,), seed=3, mean=2.0, std=0.5, dtype=np.float64).to_host()
    assert abs(n.mean() - 2.0) < 0.02 and abs(n.std() - 0.5) < 0.02
    r = await ops.uniform((3, 4), seed=1, low=-2, high=2, dtype=np.float16).to_host()
    assert r.dtype == np.float16 and r.shape == (3, 4) and r.min() >= -2 and r.max() <= 2
    # high is never drawn, also where rounding to the dtype would reach it
    for dt, lo, hi in ((np.float16, 0.0, 1.0), (np.float32, 1.0, 1.0000001), (np.float16, -1.0, 0.0), (np.float64, 0.0, 1.0)):
        r = await ops.uniform((1 << 18,), seed=5, low=lo, high=hi, dtype=dt).to_host()
        assert r.min() >= dt(lo) and r.max() < dt(hi), (dt, r.max())
    assert (await ops.uniform((4,), seed=5, low=2.0, high=2.0).to_host() == 2).all()
    with pytest.raises(ValueError, match="exceed"):
        ops.uniform((3,), seed=1, low=1, high=0)
    with pytest.raises(ValueError, match="finite in float16"):
        ops.uniform((3,), seed=1, high=1e6, dtype=np.float16)
    with pytest.raises(ValueError, match="seed"):
        ops.uniform((3,), seed=-1)
    with pytest.raises(TypeError, match="dtype"):
        ops.normal((3,), seed=1, dtype=np.int32)


# -- creation, casts, joins -----------------------------------------------------------------------------------------------------
async def test_like_constructors() -> None:
    x = await api.zeros((3, 2), np.int16)
    z = await ops.ones_like(x)
    assert z.shape == (3, 2) and z.dtype == np.int16
    close(await z.to_host(), np.ones((3, 2), np.int16))
    close(await ops.zeros_like(x + 1, np.float32).to_host(), np.zeros((3, 2), np.float32))
    close(await ops.full_like(x, 7).to_host(), np.full((3, 2), 7, np.int16))
    assert (await ops.empty_like(x)).shape == (3, 2)


@pytest.mark.parametrize(
    "src,dst",
    [
        (np.float32, np.int32),
        (np.float64, np.float16),
        (np.int32, np.bool_),
        (np.float32, "bfloat16"),
        ("bfloat16", np.float64),
        (np.uint8, np.float32),
    ],
)
async def test_astype(src: object, dst: object) -> None:
    sdt, ddt = trio_cuda._checks.check_dtype(src), trio_cuda._checks.check_dtype(dst)
    a = data((4, 5), np.float32).astype(sdt) if sdt.kind != "u" else data((4, 5), np.uint8)
    if ddt.kind in "iu" and sdt.kind == "f":
        a = np.round(a * 10).astype(sdt)
    x = await up(a)
    got = await x.astype(ddt).to_host()
    close(got, a.astype(ddt))
    close(await x.T.astype(ddt).to_host(), a.T.astype(ddt))  # from a view


async def test_bfloat16_rounds_to_nearest_even() -> None:
    import ml_dtypes

    a = np.array([1.0, 1.00390625, 1.01171875, 3.4e38, -0.0, np.inf, np.nan, 1e-40], np.float32)
    got = await (await up(a)).astype("bfloat16").to_host()
    np.testing.assert_array_equal(got.view(np.uint16), a.astype(ml_dtypes.bfloat16).view(np.uint16))


async def test_concatenate_and_stack() -> None:
    a, b, c = data((2, 3)), data((4, 3)), data((2, 3), np.int32)
    x, y, z = await up(a), await up(b), await up(c)
    close(await ops.concatenate([x, y]).to_host(), np.concatenate([a, b]))
    close(await ops.concatenate([x, z], axis=1).to_host(), np.concatenate([a, c], axis=1))
    close(await ops.stack([x, z]).to_host(), np.stack([a, c]))
    close(await ops.stack([x, z.T.T], axis=-1).to_host(), np.stack([a, c], axis=-1))
    close(await ops.concatenate([x + 1, y]).to_host(), np.concatenate([a + 1, b]))  # op inputs
    with pytest.raises(ValueError, match="differ"):
        ops.concatenate([x, y], axis=1)


# -- bad input --------------------------------------------------------------------------------------------------------------------
async def test_bad_operands_are_refused_when_the_op_is_made() -> None:
    x = await api.zeros((3,))
    with pytest.raises(TypeError, match="numpy array"):
        ops.add(x, np.ones(3))
    with pytest.raises(TypeError, match="complex"):
        ops.add(x, 1j)
    with pytest.raises(ValueError, match="broadcast"):
        ops.add(x, await api.zeros((4,)))
    with pytest.raises(TypeError, match="bool"):
        ops.subtract(await api.zeros((2,), np.bool_), await api.zeros((2,), np.bool_))
    with pytest.raises(TypeError, match="to_host"):
        np.asarray(x)
    with pytest.raises(TypeError, match="not iterable"):
        _a, _b = ops.add(x, x)  # forgot to await


async def test_an_op_input_with_bad_shape_fails_at_planning_and_runs_nothing(dev: trio_cuda.Device) -> None:
    x = await api.zeros((3,))
    launches = dev.statistics().launches
    op = ops.add(api.zeros((4,)), x)
    with pytest.raises(ValueError, match="broadcast"):
        await op
    assert dev.statistics().launches == launches


@pytest.mark.parametrize("n", [1, 255, 257, 70000])
async def test_sizes_around_block_boundaries(n: int) -> None:
    a = data((n,))
    close(await (ops.exp(await up(a)) * 2).to_host(), (np.exp(a) * 2).astype(np.float32))
    close(await ops.sum(await up(a)).to_host(), np.asarray(a.sum(dtype=np.float32)))


async def test_ops_in_concurrent_tasks_on_several_streams() -> None:
    outs: dict[int, np.ndarray] = {}
    w = data((32, 32))
    wt = await up(w)

    async def worker(i: int) -> None:
        x = data((16, 32))
        outs[i] = await ops.softmax((await up(x)) @ wt).to_host()
        v = x @ w
        v = np.exp(v - v.max(-1, keepdims=True))
        np.testing.assert_allclose(outs[i], v / v.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6)

    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(worker, i)
    assert len(outs) == 8


# -- found by an adversarial review -------------------------------------------------------------------
async def test_out_of_another_dtype_is_cast_into_for_every_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """out= may be any dtype the result casts to (same_kind): the library computes in the
    result's dtype and casts into out=, never writes the wrong bytes (or past its end)."""
    a, b = data((6, 5)), data((5, 4))
    x, y = await up(a), await up(b)
    o64 = await api.zeros((6, 4), np.float64)
    close(await ops.matmul(x, y, out=o64).to_host(), (a @ b).astype(np.float64), np.float32)
    o16 = await api.zeros((6, 4), np.float16)
    close(await ops.linear(x, y.T, out=o16).to_host(), (a @ b).astype(np.float16))
    s64 = await api.zeros((6,), np.float64)
    close(await ops.sum(x, axis=1, out=s64).to_host(), a.sum(axis=1).astype(np.float64), np.float32)
    i32 = await api.zeros((6,), np.int32)
    np.testing.assert_array_equal(await ops.argmax(x, 1, out=i32).to_host(), a.argmax(1).astype(np.int32))
    sm = await api.zeros((6, 5), np.float64)
    e = np.exp(a - a.max(-1, keepdims=True))
    close(await ops.softmax(x, out=sm).to_host(), (e / e.sum(-1, keepdims=True)).astype(np.float64), np.float32)
    rn = await api.zeros((6, 5), np.float16)
    want = a / np.sqrt((a.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    close(await ops.rms_norm(x, out=rn).to_host(), want.astype(np.float16))
    np.testing.assert_array_equal(await (x + 1).to_host(), a + 1)  # the device is fine


async def test_checks_that_need_no_gpu_run_when_the_op_is_made() -> None:
    i8 = await up(data((4,), np.int8))
    with pytest.raises(OverflowError):
        ops.where(i8, i8, 1000)  # the scalar does not fit int8
    if trio_cuda.device_count() > 1:
        other = await api.zeros((4,), device=1)
        with pytest.raises(ValueError, match="devices"):
            ops.add(await api.zeros((4,)), other)
        with pytest.raises(ValueError, match="device"):
            ops.uniform((4,), seed=1, device=0, out=other)
    with pytest.raises(ValueError, match="overflows"):
        ops.uniform((4,), seed=1, low=-3e38, high=3e38)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        ops.uniform((4,), seed=1, offset=2**64 - 2)
    x = await api.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(await ops.copy(x.partition((4,))).to_host(), np.arange(8, dtype=np.float32))


async def test_row_ops_loop_over_rows_past_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda._ops import _core

    monkeypatch.setattr(_core, "MAX_ROW_BLOCKS", 3)  # 10 rows on 3 blocks: each block takes several rows
    a = data((10, 300))
    x = await up(a)
    close(await ops.sum(x, axis=1).to_host(), a.sum(axis=1), np.float32)
    np.testing.assert_array_equal(await ops.argmax(x, axis=1).to_host(), a.argmax(axis=1))
    e = np.exp(a - a.max(-1, keepdims=True))
    close(await ops.softmax(x).to_host(), e / e.sum(-1, keepdims=True))
