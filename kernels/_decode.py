"""Kernels of a transformer decode step: RMS normalization and matrix-vector products.

Reductions use shared memory (no warp shuffles), so the same code runs on a GPU and
in numba's simulator.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import trio_cuda

from numba import cuda, float64

NORM_THREADS = 256
MATVEC_ROWS = 8  # rows of y per block: matvec's output partition has tiles of 8
WARP = 32


def _check_rms_norm(out: Any, x: Any, w: Any, eps: Any) -> None:
    if not isinstance(out, trio_cuda.Partition) or not isinstance(x, trio_cuda.Tensor) or not isinstance(w, trio_cuda.Tensor):
        raise TypeError("rms_norm(out_partition, x, w, eps): out is a partition, x and w tensors")
    if x.ndim != 2 or out.shape != x.shape:
        raise ValueError(f"rms_norm: x must be 2-D (rows, hidden) and out the same shape; got x {x.shape}, out {out.shape}")
    if w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: w must have shape ({x.shape[1]},), got {w.shape}")
    if out.tile_shape != (1, x.shape[1]):
        raise ValueError(f"rms_norm: partition out in tiles of one row, (1, {x.shape[1]}), got {out.tile_shape}")
    if len({out.dtype, x.dtype, w.dtype}) != 1 or x.dtype.kind != "f":
        raise TypeError(f"rms_norm: out, x and w must share one float dtype, got {out.dtype}, {x.dtype}, {w.dtype}")
    if not isinstance(eps, (int, float, np.integer, np.floating)) or isinstance(eps, (bool, np.bool_)):
        raise TypeError(f"rms_norm: eps must be a real number, got {eps!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"rms_norm: eps must be a positive finite number, got {eps!r}")


@trio_cuda.kernel(block=(NORM_THREADS,), validate=_check_rms_norm)
def rms_norm(out: Any, x: Any, w: Any, eps: Any) -> None:
    """``out[r] = x[r] / sqrt(mean(x[r]**2) + eps) * w`` for each row ``r``.

    ``x``: (rows, hidden); ``w``: (hidden,); ``out``: a partition of a (rows, hidden)
    tensor in tiles of one row. One block of 256 threads per row.
    """
    partial = cuda.shared.array(NORM_THREADS, float64)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = x.shape[1]
    acc = 0.0
    for j in range(tid, n, NORM_THREADS):
        v = x[row, j]
        acc += v * v
    partial[tid] = acc
    cuda.syncthreads()
    step = NORM_THREADS // 2
    while step > 0:
        if tid < step:
            partial[tid] += partial[tid + step]
        cuda.syncthreads()
        step //= 2
    scale = 1.0 / math.sqrt(partial[0] / n + eps)
    for j in range(tid, n, NORM_THREADS):
        out[row, j] = x[row, j] * scale * w[j]


def _check_matvec(y: Any, a: Any, x: Any) -> None:
    if not isinstance(y, trio_cuda.Partition) or not isinstance(a, trio_cuda.Tensor) or not isinstance(x, trio_cuda.Tensor):
        raise TypeError("matvec(y_partition, a, x): y is a partition, a and x tensors")
    if a.ndim != 2 or x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"matvec: a must be 2-D, x and y 1-D; got a {a.shape}, x {x.shape}, y {y.shape}")
    if a.shape[1] != x.shape[0] or a.shape[0] != y.shape[0]:
        raise ValueError(f"matvec: shapes do not agree: a {a.shape} @ x {x.shape} -> y {y.shape}")
    if y.tile_shape != (MATVEC_ROWS,):
        raise ValueError(f"matvec: partition y in tiles of {MATVEC_ROWS} rows, got {y.tile_shape}")
    if len({y.dtype, a.dtype, x.dtype}) != 1 or a.dtype.kind != "f":
        raise TypeError(f"matvec: y, a and x must share one float dtype, got {y.dtype}, {a.dtype}, {x.dtype}")


@trio_cuda.kernel(block=(WARP, MATVEC_ROWS), validate=_check_matvec)
def matvec(y: Any, a: Any, x: Any) -> None:
    """``y = a @ x``: ``a`` (n, k), ``x`` (k,), ``y`` a partition of (n,) in tiles of 8.

    Each block computes 8 rows, 32 threads per row, coalesced along the row, four
    columns per thread per step.
    """
    partial = cuda.shared.array((MATVEC_ROWS, WARP), float64)
    lane = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    r = cuda.blockIdx.x * MATVEC_ROWS + ty
    acc = 0.0
    if r < a.shape[0]:
        n = a.shape[1]
        k = lane
        # four columns per step, loads first: four reads in flight per thread
        while k + 3 * WARP < n:
            a0, a1, a2, a3 = a[r, k], a[r, k + WARP], a[r, k + 2 * WARP], a[r, k + 3 * WARP]
            x0, x1, x2, x3 = x[k], x[k + WARP], x[k + 2 * WARP], x[k + 3 * WARP]
            acc += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
            k += 4 * WARP
        while k < n:
            acc += a[r, k] * x[k]
            k += WARP
    partial[ty, lane] = acc
    cuda.syncthreads()
    step = WARP // 2
    while step > 0:
        if lane < step:
            partial[ty, lane] += partial[ty, lane + step]
        cuda.syncthreads()
        step //= 2
    if lane == 0 and r < a.shape[0]:
        y[r] = partial[ty, 0]
