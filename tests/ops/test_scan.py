"""cumsum against numpy: every axis, the flattened tensor, numpy's result dtypes
(integers and bools in int64), rows longer than one block's chunk, views, out= and
bad input."""

from __future__ import annotations

import numpy as np
import pytest

from trio_cuda import api, ops

from ..helpers.arrays import host, up

RNG = np.random.default_rng(5)


def close(got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8, np.bool_])
def test_cumsum_matches_numpy(axis: int | None, dtype: type) -> None:
    a = RNG.integers(0, 5, size=(3, 4, 5)).astype(dtype) if dtype != np.float32 else RNG.normal(size=(3, 4, 5)).astype(dtype)
    close(host(ops.cumsum(up(a), axis)), np.cumsum(a, axis))


def test_long_rows_views_and_dtype() -> None:
    a = RNG.normal(size=(2, 700)).astype(np.float32)  # several chunks of 256 per row
    close(host(ops.cumsum(up(a), 1)), np.cumsum(a, 1), 1e-4)
    i = RNG.integers(-1000, 1000, size=(700, 3)).astype(np.int64)
    close(host(ops.cumsum(up(i), 0)), np.cumsum(i, 0))  # exact for integers
    close(host(ops.cumsum(up(i).T[::-1], 1)), np.cumsum(i.T[::-1], 1))  # a strided view
    close(host(ops.cumsum(up(i), 0, dtype=np.float64)), np.cumsum(i, 0, dtype=np.float64))
    close(host(up(i).cumsum()), np.cumsum(i))


async def test_out_and_errors() -> None:
    a = RNG.normal(size=(4, 6)).astype(np.float32)
    x = await api.from_host(a)
    out = await api.zeros((4, 6))
    assert await ops.cumsum(x, 0, out=out) is out
    close(await out.to_host(), np.cumsum(a, 0))
    await ops.cumsum(x, 1, out=x)  # in place
    close(await x.to_host(), np.cumsum(a, 1))
    with pytest.raises(ValueError, match="out= has shape"):
        ops.cumsum(x, None, out=out)
    with pytest.raises(TypeError, match="axis must be an int or None"):
        ops.cumsum(x, (0, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="axis 2"):
        ops.cumsum(x, 2)
    with pytest.raises(TypeError, match="complex"):
        ops.cumsum(await api.from_host(np.ones(2, np.complex64)))
