"""C = A @ B twice: a hand-written tiled kernel, and trio_cuda.ops.matmul (cuBLASLt).

The kernel is an ``@trio_cuda.kernel`` over the output partitioned into 16x16 tiles: one
block of 16x16 threads per tile of C, each thread computing one element. The block walks
the K dimension in steps of 16, staging a 16x16 tile of A and one of B in shared memory,
so every element of A and B is read from global memory once per block instead of once
per thread. The sizes need not be multiples of the tile: the last tiles of C are partial
(the launcher makes the grid the ceiling of shape / tile), and the staged tiles are padded
with zeros past the edges of A and B.

Both results are checked against numpy (float64 reference, float32 error bound). On a GPU
the default size is 4096 x 4096 x 4096 in float32 and the script prints TFLOP/s for both:
after a warm-up launch (which compiles the kernel and plans cuBLASLt), ``--reps`` launches
are chained with ``.then`` and awaited once, so the timing holds no host round trips. On
the simulated device (numba's CUDA simulator runs every GPU thread as a Python thread) the
default size is a small ragged 60 x 70 x 50 and nothing is timed.

Exits non-zero if either result is wrong.

Usage: python examples/async_gemm.py [--m M] [--k K] [--n N] [--reps R] [--seed S]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

import trio_cuda  # import trio_cuda before numba.cuda: it decides how numba.cuda runs
from trio_cuda import api, ops

from numba import cuda, float32

TILE = 16  # C is cut into TILE x TILE tiles; the block is TILE x TILE threads


@trio_cuda.kernel
def tiled_gemm(c: Any, a: Any, b: Any) -> None:
    """``c = a @ b`` for float32 ``a`` (m, k) and ``b`` (k, n); ``c`` a partition of (m, n)
    in (TILE, TILE) tiles.

    Tile grid dimension 0 (rows of C) is CUDA's x, so ``blockIdx.x`` picks the tile's rows
    and ``blockIdx.y`` its columns. The tile is square, so inside it we are free to read
    ``threadIdx.x`` as the column: consecutive threads of a warp then touch consecutive
    addresses of the row-major A, B and C (coalesced loads and stores).
    """
    sa = cuda.shared.array((TILE, TILE), float32)
    sb = cuda.shared.array((TILE, TILE), float32)
    tx = cuda.threadIdx.x  # column within the tile
    ty = cuda.threadIdx.y  # row within the tile
    row = cuda.blockIdx.x * TILE + ty
    col = cuda.blockIdx.y * TILE + tx
    m = a.shape[0]
    k = a.shape[1]
    n = b.shape[1]
    acc = float32(0.0)
    for k0 in range(0, k, TILE):
        # Stage one tile of A (rows of C x K) and one of B (K x columns of C); pad with
        # zeros past the edges, so the inner loop needs no bounds checks.
        if row < m and k0 + tx < k:
            sa[ty, tx] = a[row, k0 + tx]
        else:
            sa[ty, tx] = float32(0.0)
        if k0 + ty < k and col < n:
            sb[ty, tx] = b[k0 + ty, col]
        else:
            sb[ty, tx] = float32(0.0)
        cuda.syncthreads()  # the tiles are complete
        for kk in range(TILE):
            acc += sa[ty, kk] * sb[kk, tx]
        cuda.syncthreads()  # everyone is done with the tiles before they are overwritten
    if row < m and col < n:  # threads of a partial edge tile past the shape store nothing
        c[row, col] = acc


def check(name: str, got: np.ndarray, a: np.ndarray, b: np.ndarray, ref: np.ndarray) -> bool:
    """True if ``got`` is ``a @ b`` to float32 accuracy.

    The bound per element is ``2 sqrt(k) eps32 (|a| @ |b|)_ij`` (the typical growth of
    rounding errors in a float32 dot product of length k, with a margin), which a wrong
    index or a missed tile exceeds by orders of magnitude.
    """
    k = a.shape[1]
    bound = 2.0 * np.sqrt(k) * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b)) + np.finfo(np.float32).tiny
    err = np.abs(got.astype(np.float64) - ref)
    ok = bool(got.shape == ref.shape and np.isfinite(got).all() and (err <= bound).all())
    worst = float((err / bound).max()) if err.size else 0.0
    print(
        f"  {name}: max |error| {float(err.max(initial=0.0)):.3g}, worst error / bound {worst:.3f} -> {'ok' if ok else 'WRONG'}"
    )
    return ok


async def timed(make: Callable[[], trio_cuda.DeviceOp[Any]], reps: int) -> float:
    """Seconds per launch of ``reps`` launches made by ``make()``, chained and awaited once
    (after one warm-up launch, awaited on its own)."""
    await make()  # warm-up: compiles / plans, and allocates what the first launch needs
    op = make()
    for _ in range(reps - 1):
        op = op.then(lambda _: make())
    start = time.perf_counter()
    await op
    return (time.perf_counter() - start) / reps


async def main() -> int:
    on_gpu = trio_cuda.backend_name() == "cuda"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096 if on_gpu else 60, help="rows of A and C")
    parser.add_argument("--k", type=int, default=4096 if on_gpu else 70, help="columns of A, rows of B")
    parser.add_argument("--n", type=int, default=4096 if on_gpu else 50, help="columns of B and C")
    parser.add_argument("--reps", type=int, default=10, help="timed launches per method (GPU only)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    m, k, n = args.m, args.k, args.n
    if min(m, k, n) < 1 or args.reps < 1:
        parser.error("sizes and --reps must be positive")

    rng = np.random.default_rng(args.seed)
    a_host = rng.uniform(-1.0, 1.0, (m, k)).astype(np.float32)
    b_host = rng.uniform(-1.0, 1.0, (k, n)).astype(np.float32)
    dev = trio_cuda.current_device()
    print(f"C = A @ B with A {m}x{k}, B {k}x{n}, float32, on {dev.name} ({trio_cuda.backend_name()})")

    # Upload both operands and allocate both outputs: one submission, awaited once.
    a, b, c_kernel, c_blas = await trio_cuda.zip(
        api.from_host(a_host), api.from_host(b_host), api.empty((m, n)), api.empty((m, n))
    )
    c_tiles = c_kernel.partition((TILE, TILE))  # ragged when TILE does not divide m or n
    grid = (-(-m // TILE), -(-n // TILE))
    print(f"tiled kernel: {grid[0]}x{grid[1]} blocks of {TILE}x{TILE} threads")

    def kernel_launch() -> trio_cuda.DeviceOp[Any]:
        return tiled_gemm(c_tiles, a, b)

    def blas_launch() -> trio_cuda.DeviceOp[Any]:
        return ops.matmul(a, b, out=c_blas)

    if on_gpu:
        flops = 2.0 * m * k * n
        for name, make in (("tiled kernel", kernel_launch), ("ops.matmul", blas_launch)):
            seconds = await timed(make, args.reps)
            print(
                f"{name:>12}: {seconds * 1e3:8.3f} ms per launch, {flops / seconds / 1e12:7.2f} TFLOP/s ({args.reps} launches, one await)"
            )
    else:
        # One launch each, the kernel's and the matmul's awaited together.
        await trio_cuda.zip(kernel_launch(), blas_launch())

    got_kernel = await c_kernel.to_host()
    got_blas = await c_blas.to_host()
    ref = a_host.astype(np.float64) @ b_host.astype(np.float64)
    print("checked against numpy:")
    ok = check("tiled kernel", got_kernel, a_host, b_host, ref)
    ok = check("ops.matmul", got_blas, a_host, b_host, ref) and ok
    print("correct" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
