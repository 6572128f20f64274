"""The packed layer_norm / rms_norm kernels' numba source (tests/ops/test_norm.py checks
their numpy twin) runs in numba's CUDA simulator: bfloat16 and float16 rows as words of
two and four values, kept in registers and read twice, weights packed, of float32 and
misaligned, against numpy through ml_dtypes. Small shapes: the simulator is slow."""

from __future__ import annotations

import pytest

from ..helpers.faults import child, child_ok

PROGRAM = """
import numpy as np
import ml_dtypes
from trio_cuda import api, ops
from trio_cuda._ops import _norm
import trio_cuda._ops._core as core

core.MAX_ROW_BLOCKS = 2  # row kernels loop over rows past the grid
rng = np.random.default_rng(3)


def want(a, w, b, rms, eps):
    v = a.astype(np.float64)
    if rms:
        r = v / np.sqrt((v * v).mean(1, keepdims=True) + eps)
    else:
        r = (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + eps)
    if w is not None:
        r = r * w.astype(np.float64)
    if b is not None:
        r = r + b.astype(np.float64)
    return r


def check(tuning, dt, shape, wdt, rms, offset=0):
    _norm.TUNING = tuning
    a = rng.uniform(2, 6, shape).astype(np.float32).astype(dt)
    k = shape[1]
    wb = rng.uniform(0.5, 2, k + offset).astype(np.float32).astype(wdt)
    bb = rng.uniform(-1, 1, k + offset).astype(np.float32).astype(wdt)
    w, b = wb[offset:], bb[offset:]
    wt, bt = api.from_host(wb).sync()[offset:], api.from_host(bb).sync()[offset:]
    x = api.from_host(a).sync()
    got = (ops.rms_norm(x, wt) if rms else ops.layer_norm(x, wt, bt)).to_host().sync()
    eps = 1e-6 if rms else 1e-5
    ulp = 2.0**-8 if dt == ml_dtypes.bfloat16 else 2.0**-11
    expected = want(a, w, None if rms else b, rms, eps).astype(np.float32).astype(dt).astype(np.float64)
    assert got.dtype == dt
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=8 * ulp, atol=8 * ulp)


BF, F16 = ml_dtypes.bfloat16, np.float16
for rms in (False, True):
    for dt in (BF, F16):
        check(_norm.NormTuning(), dt, (3, 40), dt, rms)  # 4 per word, packed weights
        check(_norm.NormTuning(), dt, (1, 1100), np.float32, rms)  # past a step of 4 x 256 words
        check(_norm.NormTuning(pack=2), dt, (2, 6), dt, rms, offset=1)  # misaligned weights
        check(_norm.NormTuning(threads=64, cache_words=4), dt, (2, 36), BF, rms)  # in registers
        check(_norm.NormTuning(threads=64, cache_words=2), dt, (1, 300), dt, rms)  # 2 words, of 75
print("OK")
"""


@pytest.mark.sim_only
def test_packed_norm_kernels_in_numbas_simulator() -> None:
    child_ok(child(PROGRAM, TRIO_CUDA_SIM_OPS_NUMBA="1"))
