"""Elementwise kernels: any rank up to 3, one thread per element of the output tile."""

from __future__ import annotations

from typing import Any

import trio_cuda

from numba import cuda

from ._checks import same_shape


@trio_cuda.kernel(validate=same_shape("add", 0, 1, 2))
def add(z: Any, x: Any, y: Any) -> None:
    """``z = x + y`` elementwise; ``z`` is the output partition."""
    if z.ndim == 1:
        i = cuda.grid(1)
        if i < z.shape[0]:
            z[i] = x[i] + y[i]
    elif z.ndim == 2:
        i, j = cuda.grid(2)
        if i < z.shape[0] and j < z.shape[1]:
            z[i, j] = x[i, j] + y[i, j]
    else:
        i, j, k = cuda.grid(3)
        if i < z.shape[0] and j < z.shape[1] and k < z.shape[2]:
            z[i, j, k] = x[i, j, k] + y[i, j, k]


@trio_cuda.kernel(validate=same_shape("saxpy", 1, 2))
def saxpy(a: Any, x: Any, y: Any) -> None:
    """``y = a * x + y`` elementwise; ``y`` is the output partition, ``a`` a scalar."""
    if y.ndim == 1:
        i = cuda.grid(1)
        if i < y.shape[0]:
            y[i] = a * x[i] + y[i]
    elif y.ndim == 2:
        i, j = cuda.grid(2)
        if i < y.shape[0] and j < y.shape[1]:
            y[i, j] = a * x[i, j] + y[i, j]
    else:
        i, j, k = cuda.grid(3)
        if i < y.shape[0] and j < y.shape[1] and k < y.shape[2]:
            y[i, j, k] = a * x[i, j, k] + y[i, j, k]
