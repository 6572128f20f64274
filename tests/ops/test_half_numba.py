"""The generated kernels on bfloat16 (their bits: BF16_IN and BF16_OUT) run in numba's CUDA
simulator: elementwise ops, comparisons and where, reductions, softmax and the norms,
cumsum, sort, argsort and topk, against numpy through ml_dtypes. Small shapes: the simulator is slow."""

from __future__ import annotations

import pytest

from ..helpers.faults import child, child_ok

PROGRAM = """
import numpy as np
import ml_dtypes
import trio_cuda
from trio_cuda import api, ops
import trio_cuda._ops._core as core

core.MAX_ROW_BLOCKS = 2  # row kernels loop over rows past the grid
BF = ml_dtypes.bfloat16
rng = np.random.default_rng(2)
a = rng.uniform(-3, 3, (3, 40)).astype(np.float32).astype(BF)
b = rng.uniform(0.5, 2, (40,)).astype(np.float32).astype(BF)
fa, fb = a.astype(np.float32), b.astype(np.float32)
x, y = api.from_host(a).sync(), api.from_host(b).sync()


def check(got, want, ulps=4):
    assert got.dtype == BF, got.dtype
    want = np.asarray(want, np.float32).astype(BF).astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=ulps * 2.0**-8, atol=ulps * 2.0**-8)


check((x * y - 1.5).to_host().sync(), (fa * fb).astype(BF).astype(np.float32) - 1.5)
check(ops.exp(x).to_host().sync(), np.exp(fa))
check(ops.gelu(x).to_host().sync(), 0.5 * fa * (1 + np.tanh(0.7978845608028654 * (fa + 0.044715 * fa**3))))
check(ops.where(x > 0, x, y).to_host().sync(), np.where(fa > 0, fa, fb))
np.testing.assert_array_equal((x >= y).to_host().sync(), fa >= fb)
sp = np.array([np.nan, np.inf, -0.0, 1.0], np.float32).astype(BF)
S = api.from_host(sp).sync()
np.testing.assert_array_equal(ops.isnan(S).to_host().sync(), np.isnan(sp.astype(np.float32)))
np.testing.assert_array_equal(ops.logical_not(S).to_host().sync(), [False, False, True, False])
check(ops.sum(x, axis=1).to_host().sync(), fa.astype(np.float64).sum(1), ulps=8)
check(ops.max(x, axis=0).to_host().sync(), fa.max(0))
np.testing.assert_array_equal(ops.argmax(x, axis=1).to_host().sync(), fa.argmax(1))
e = np.exp(fa - fa.max(1, keepdims=True))
check(ops.softmax(x).to_host().sync(), e / e.sum(1, keepdims=True))
v = fa.astype(np.float64)
ln = (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + 1e-5) * fb + fb
check(ops.layer_norm(x, y, y).to_host().sync(), ln, ulps=8)
check(ops.rms_norm(x, y).to_host().sync(), v / np.sqrt((v * v).mean(1, keepdims=True) + 1e-6) * fb, ulps=8)
# past 16 * 256 columns: the bfloat16 row loops' unrolled steps (16 columns per thread
# per step when reading, 8 when writing) and their tails
big = rng.uniform(-3, 3, (1, 4200)).astype(np.float32).astype(BF)
fbig = big.astype(np.float64)
X = api.from_host(big).sync()
e = np.exp(fbig - fbig.max())
check(ops.softmax(X).to_host().sync(), e / e.sum())
lnb = (fbig - fbig.mean()) / np.sqrt(fbig.var() + 1e-5)
check(ops.layer_norm(X).to_host().sync(), lnb, ulps=8)
# scans and sorts: bfloat16 decoded when loaded (cumsum rounds each sum once; sorts move bits)
ties = a.copy()
ties[0, 3], ties[1, 5:9] = np.nan, ties[1, 4]
T = api.from_host(ties).sync()
ft = ties.astype(np.float32)
check(ops.cumsum(x, axis=1).to_host().sync(), np.cumsum(fa.astype(np.float64), 1), ulps=8)
np.testing.assert_array_equal(ops.sort(T).to_host().sync().astype(np.float32), np.sort(ft, -1))
np.testing.assert_array_equal(ops.argsort(T).to_host().sync(), np.argsort(ft, -1, kind="stable"))
tv, ti = ops.topk(T, 5).then(lambda r: trio_cuda.zip(r[0].to_host(), r[1].to_host())).sync()
order = np.argsort(np.where(np.isnan(ft), -np.inf, -ft), -1, kind="stable")[:, :5]
np.testing.assert_array_equal(ti, order)
np.testing.assert_array_equal(tv.astype(np.float32), np.take_along_axis(ft, order, -1))
print("OK")
"""


@pytest.mark.sim_only
def test_bfloat16_kernels_in_numbas_simulator() -> None:
    child_ok(child(PROGRAM, TRIO_CUDA_SIM_OPS_NUMBA="1"))
