"""Host arrays in and out of the device, and comparisons of what comes back: the shared
vocabulary of the ops' tests (blocking calls: these tests are plain functions)."""

from __future__ import annotations

import numpy as np

import trio_cuda
from trio_cuda import api

#: The binary elementwise ops and their numpy twins.
BINARY = [
    ("add", np.add),
    ("subtract", np.subtract),
    ("multiply", np.multiply),
    ("divide", np.true_divide),
    ("maximum", np.maximum),
    ("minimum", np.minimum),
]


def up(a: np.ndarray) -> trio_cuda.Tensor:
    """``a`` uploaded to the current device."""
    return api.from_host(a).sync()


def host(op: trio_cuda.DeviceOp[trio_cuda.Tensor]) -> np.ndarray:
    """The output tensor of ``op``, read back."""
    return op.to_host().sync()


def close(got: np.ndarray, want: np.ndarray, tol: float = 2e-6) -> None:
    """Same dtype and shape; floats within ``tol`` (NaN equal to NaN), the rest exactly."""
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


def same(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype, shape and values."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(got, want)
