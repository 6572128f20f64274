"""The reductions beyond sum/mean/max/min/argmax against numpy: prod, any, all, argmin,
var and std (ddof), logsumexp; every axis form, keepdims, numpy's result dtypes, NaN,
empty axes, the tensor and op methods, out= and bad input."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from trio_cuda import api, ops

from ..helpers.arrays import close, host, up

RNG = np.random.default_rng(4)
A = RNG.normal(size=(3, 4, 5)).astype(np.float32)
AXES = [None, 0, 1, 2, -1, (0, 2), (1, 2)]


def logsumexp(a: np.ndarray, axis: object = None, keepdims: bool = False) -> np.ndarray:
    """scipy.special.logsumexp's definition, in float64."""
    v = a.astype(np.float64)
    mx = np.max(v, axis=axis, keepdims=True)  # type: ignore[arg-type]
    r = np.log(np.sum(np.exp(v - mx), axis=axis, keepdims=True)) + mx  # type: ignore[arg-type]
    if not keepdims:
        r = r.reshape(()) if axis is None else np.squeeze(r, axis=axis)  # type: ignore[arg-type]
    return r.astype(a.dtype if a.dtype.kind == "f" else np.float64)


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("keepdims", [False, True])
def test_prod_any_all_var_std_logsumexp_of_floats(axis: object, keepdims: bool) -> None:
    x = up(A)
    kw = {"keepdims": keepdims}
    close(host(ops.prod(x, axis, **kw)), np.prod(A, axis, **kw), 1e-4)  # type: ignore[arg-type]
    close(host(ops.any(x > 1, axis, **kw)), np.any(A > 1, axis, **kw), tol=1e-5)  # type: ignore[arg-type]
    close(host(ops.all(x > -1, axis, **kw)), np.all(A > -1, axis, **kw), tol=1e-5)  # type: ignore[arg-type]
    close(host(ops.var(x, axis, **kw)), np.var(A, axis, **kw), tol=1e-5)  # type: ignore[arg-type]
    close(host(ops.std(x, axis, ddof=1, **kw)), np.std(A, axis, ddof=1, **kw), tol=1e-5)  # type: ignore[arg-type]
    close(host(ops.logsumexp(x, axis, **kw)), logsumexp(A, axis, keepdims), tol=1e-5)


@pytest.mark.parametrize("axis", [None, 0, 2, -2])
def test_argmin_first_occurrence_and_nan(axis: int | None) -> None:
    a = RNG.integers(0, 3, size=(3, 4, 5)).astype(np.float32)  # many ties
    a[1, 2, 3] = np.nan
    close(host(ops.argmin(up(a), axis)), np.argmin(a, axis), tol=1e-5)
    close(host(ops.argmin(up(a), axis, keepdims=True)), np.argmin(a, axis, keepdims=True), tol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64, np.bool_])
def test_integer_and_bool_inputs_give_numpys_dtypes(dtype: type) -> None:
    a = RNG.integers(0, 4, size=(4, 6)).astype(dtype)
    x = up(a)
    close(host(ops.prod(x, 1)), np.prod(a, 1), tol=1e-5)
    close(host(ops.any(x, 0)), np.any(a, 0), tol=1e-5)
    close(host(ops.all(x, 1)), np.all(a, 1), tol=1e-5)
    close(host(ops.var(x, 1)), np.var(a, 1), 1e-12)
    close(host(ops.std(x)), np.std(a), 1e-12)
    if dtype != np.bool_:
        close(host(ops.argmin(x, 1)), np.argmin(a, 1), tol=1e-5)
        close(host(ops.logsumexp(x, 0)), logsumexp(a, 0), 1e-12)


def test_nan_and_truth_values() -> None:
    a = np.array([[0.0, np.nan, 1.0], [0.0, 0.0, 0.5]], np.float32)
    x = up(a)
    close(host(ops.any(x, 1)), np.any(a, 1), tol=1e-5)  # NaN and 0.5 are true
    close(host(ops.all(x, 0)), np.all(a, 0), tol=1e-5)
    close(host(ops.var(x, 1)), np.var(a, 1), tol=1e-5)
    close(host(ops.logsumexp(x, 1)), np.array([np.nan, logsumexp(a[1])], np.float32), tol=1e-5)
    inf = up(np.array([[-np.inf, -np.inf], [np.inf, 1.0], [-np.inf, 2.0]], np.float32))
    close(host(ops.logsumexp(inf, 1)), np.array([-np.inf, np.inf, 2.0], np.float32), tol=1e-5)
    big = np.array([1000.0, 1000.0], np.float32)  # exp would overflow without the shift
    close(host(ops.logsumexp(up(big))), np.float32(1000.0 + np.log(2.0)), tol=1e-5)


def test_ddof_and_empty_axes() -> None:
    x = up(A)
    for ddof in (0, 1, 2.5):
        close(host(ops.var(x, 2, ddof=ddof)), np.var(A, 2, ddof=ddof), tol=1e-5)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "degrees of freedom <= 0"
        close(host(ops.var(x, 2, ddof=5)), np.var(A, 2, ddof=5), tol=1e-5)  # n - ddof = 0: inf, as numpy
        e = np.zeros((2, 0), np.float32)
        close(host(ops.var(up(e), 1)), np.full(2, np.nan, np.float32), tol=1e-5)
    close(host(ops.prod(up(e), 1)), np.prod(e, 1), tol=1e-5)
    close(host(ops.any(up(e), 1)), np.any(e, 1), tol=1e-5)
    close(host(ops.all(up(e), 1)), np.all(e, 1), tol=1e-5)
    close(host(ops.logsumexp(up(e), 1)), np.full(2, -np.inf, np.float32), tol=1e-5)


def test_methods_on_tensors_and_ops() -> None:
    x = up(A)
    close(host(x.var()), np.var(A), tol=1e-5)
    close(host((x + 1).std(1, ddof=1, keepdims=True)), np.std(A + 1, 1, ddof=1, keepdims=True), tol=1e-5)
    close(host(x.prod(0)), np.prod(A, 0), 1e-4)
    close(host((x > 0).any(2)), np.any(A > 0, 2), tol=1e-5)
    close(host((x > -2).all()), np.all(A > -2), tol=1e-5)
    close(host(x.argmin(1)), np.argmin(A, 1), tol=1e-5)
    close(host((x * 2).argmin()), np.argmin(A * 2), tol=1e-5)
    close(host(x.cumsum(1)), np.cumsum(A, 1), tol=1e-5)


async def test_out_and_errors() -> None:
    x = await api.from_host(A)
    out = await api.zeros((3, 5))
    assert await ops.var(x, 1, out=out) is out
    close(await out.to_host(), np.var(A, 1), tol=1e-5)
    strided = await api.zeros((5, 6))
    await ops.logsumexp(x, 1, out=strided[:, ::2].T)
    close((await strided.to_host())[:, ::2].T, logsumexp(A, 1), tol=1e-5)
    with pytest.raises(ValueError, match="zero-size"):
        ops.argmin(await api.from_host(np.zeros((2, 0), np.float32)), 1)
    with pytest.raises(TypeError, match="axis must be an int or None"):
        ops.argmin(x, (0, 1))
    with pytest.raises(TypeError, match="ddof must be a real number"):
        ops.var(x, ddof="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repeated axis"):
        ops.std(x, (1, 1))
    with pytest.raises(TypeError, match=r"axis must be an int, a tuple"):
        ops.logsumexp(x, 1.5)
    with pytest.raises(TypeError, match=r"cannot cast the float32 result"):
        ops.var(x, 1, out=await api.zeros((3, 5), np.int32))
