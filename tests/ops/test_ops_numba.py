"""The numba-cuda kernels the ops generate, run in numba's CUDA simulator (no GPU needed).

On the simulated device the ops normally run their numpy twins; with
``TRIO_CUDA_SIM_OPS_NUMBA=1`` they run the generated numba code thread by thread, so the
kernel source (indexing, unravelling, block reductions, Philox, bfloat16 bit tricks) is
checked against numpy in CI too. Small shapes: the simulator is slow.
"""

from __future__ import annotations

import pytest

from ..helpers.faults import child

PROGRAM = """
import math
import numpy as np
import trio_cuda
from trio_cuda import api, ops
from trio_cuda._ops._random import philox
import trio_cuda._ops._core as core

core.MAX_ROW_BLOCKS = 2  # row kernels loop over rows past the grid: every row op below does

rng = np.random.default_rng(1)
a = rng.uniform(-2, 2, (5, 37)).astype(np.float32)
b = rng.uniform(-2, 2, (37,)).astype(np.float32)
x, y = api.from_host(a).sync(), api.from_host(b).sync()

def check(got, want, tol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)

check((x + y * 2).to_host().sync(), a + b * 2)
check((x.T[::-1] - 1).to_host().sync(), a.T[::-1] - 1)
check(ops.maximum(x, 0.5).to_host().sync(), np.maximum(a, np.float32(0.5)))
check(ops.where(x, 1.0, y).to_host().sync(), np.where(a != 0, 1.0, b).astype(np.float32))  # the scalar is weak
check(ops.gelu(x, approximate="none").to_host().sync(), (0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))).astype(np.float32))
check(ops.sigmoid(x).to_host().sync(), (1 / (1 + np.exp(-a))).astype(np.float32))
i8 = api.from_host(np.arange(-6, 6, dtype=np.int8)).sync()
check((i8 * 3).to_host().sync(), np.arange(-6, 6, dtype=np.int8) * 3)
check(ops.abs(i8).to_host().sync(), np.abs(np.arange(-6, 6, dtype=np.int8)))
# comparisons and logic: bool results, NaN and infinities, integer and bool inputs
sp = np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -2.0], np.float32)
S = api.from_host(sp).sync()
check((x < y).to_host().sync(), a < b)
check((S == S).to_host().sync(), sp == sp)
check((S != 1.0).to_host().sync(), sp != 1.0)
check(ops.isnan(S).to_host().sync(), np.isnan(sp))
check(ops.isinf(S).to_host().sync(), np.isinf(sp))
check(ops.isfinite(S).to_host().sync(), np.isfinite(sp))
check(ops.isinf(i8).to_host().sync(), np.isinf(np.arange(-6, 6, dtype=np.int8)))
check(ops.logical_and(S, x[0, :6]).to_host().sync(), np.logical_and(sp, a[0, :6]))
check(ops.logical_not(S).to_host().sync(), np.logical_not(sp))
check(((i8 & 5) ^ 3).to_host().sync(), (np.arange(-6, 6, dtype=np.int8) & 5) ^ 3)
bm = (x > 0).to_host().sync()
check((~(x > 0)).to_host().sync(), ~bm)
check(((x > 0) | (x < -1)).to_host().sync(), bm | (a < -1))
# reductions (one block per row, shared memory)
check(ops.sum(x, axis=1).to_host().sync(), a.sum(axis=1))
check(ops.mean(x, axis=0).to_host().sync(), a.mean(axis=0))
check(ops.max(x, axis=(0, 1), keepdims=True).to_host().sync(), a.max(axis=(0, 1), keepdims=True))
t = np.tile(np.array([1, 5, 5, 2, 5], np.float32), 60).reshape(1, 300)
check(ops.argmax(api.from_host(t).sync(), axis=1).to_host().sync(), t.argmax(axis=1))
v = a.astype(np.float64) - a.max(-1, keepdims=True)
sm = np.exp(v) / np.exp(v).sum(-1, keepdims=True)
check(ops.softmax(x).to_host().sync(), sm.astype(np.float32))
check(ops.log_softmax(x, 0).to_host().sync(), np.log(np.exp(a - a.max(0)) / np.exp(a - a.max(0)).sum(0)).astype(np.float32), 1e-4)
w = api.from_host(b).sync()
m = a.mean(-1, keepdims=True)
ln = (a - m) / np.sqrt(((a - m) ** 2).mean(-1, keepdims=True) + 1e-5) * b
check(ops.layer_norm(x, w, w).to_host().sync(), (ln + b).astype(np.float32), 1e-4)
check(ops.rms_norm(x, w).to_host().sync(), (a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * b).astype(np.float32), 1e-4)
# past 1024 elements / columns: the unrolled paths (four loads per thread) and their tails
big = rng.uniform(-2, 2, (2, 1300)).astype(np.float32) + 100  # a large mean: layer_norm's shifted moments
gb = rng.uniform(0.5, 1.5, (1300,)).astype(np.float32)
X, G = api.from_host(big).sync(), api.from_host(gb).sync()
check((X * 2 - G).to_host().sync(), big * 2 - gb, 1e-4)
check(ops.sum(X, axis=1).to_host().sync(), big.sum(axis=1), 1e-2)
vb = big.astype(np.float64) - big.max(-1, keepdims=True)
check(ops.softmax(X).to_host().sync(), (np.exp(vb) / np.exp(vb).sum(-1, keepdims=True)).astype(np.float32))
mb = big.astype(np.float64).mean(-1, keepdims=True)
lnb = (big - mb) / np.sqrt(((big - mb) ** 2).mean(-1, keepdims=True) + 1e-5) * gb + gb
check(ops.layer_norm(X, G, G).to_host().sync(), lnb.astype(np.float32), 2e-3)
check(ops.rms_norm(X, G).to_host().sync(), (big / np.sqrt((big.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * gb).astype(np.float32), 1e-4)
# Philox: the numba code gives the numpy twin's numbers
u = ops.uniform((50,), seed=99, offset=7).to_host().sync()
w0 = philox(np.arange(7, 57, dtype=np.uint64), 99)[0]
np.testing.assert_array_equal(u, (w0 >> np.uint64(8)).astype(np.float32) * np.float32(2**-24))
nrm = ops.normal((10,), seed=5, dtype=np.float64).to_host().sync()
w0, w1, _, _ = philox(np.arange(10, dtype=np.uint64), 5)
z = np.sqrt(-2 * np.log((w0.astype(np.float64) + 1) * 2.0**-32)) * np.cos(2 * np.pi * w1.astype(np.float64) * 2.0**-32)
np.testing.assert_allclose(nrm, z, rtol=1e-12)
# casts, bfloat16 bits, copies of views
import ml_dtypes
f = np.array([1.0, 1.00390625, 1.01171875, -3.5, np.inf, np.nan, 1e-40, 65504.0], np.float32)
bf = api.from_host(f).astype("bfloat16").to_host().sync()
np.testing.assert_array_equal(bf.view(np.uint16), f.astype(ml_dtypes.bfloat16).view(np.uint16))
check(api.from_host(bf).astype(np.float32).to_host().sync(), bf.astype(np.float32))
check(x.astype(np.int16).to_host().sync(), a.astype(np.int16))
check(ops.concatenate([x, x[:, ::-1]], axis=1).to_host().sync(), np.concatenate([a, a[:, ::-1]], axis=1))
assert trio_cuda.device(0)._driver._kernels, "the generated kernels did not run their numba code"
print("OK")
"""


@pytest.mark.sim_only
def test_generated_kernels_in_numbas_simulator() -> None:
    r = child(PROGRAM, TRIO_CUDA_SIM_OPS_NUMBA="1")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
