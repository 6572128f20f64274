"""The numba-cuda kernels of gathers, elementwise math, the newer reductions, cumsum and
sorting, run in numba's CUDA simulator (``TRIO_CUDA_SIM_OPS_NUMBA=1``): their generated
source (index checks, rounding, two-pass rows, the block scan, the bitonic network) is
checked against numpy without a GPU. Small shapes: the simulator is slow."""

from __future__ import annotations

import pytest

from ..helpers.faults import child, child_ok

PROGRAM = """
import math
import numpy as np
import trio_cuda
from trio_cuda import api, ops
import trio_cuda._ops._core as core

core.MAX_ROW_BLOCKS = 2  # row kernels loop over rows past the grid

rng = np.random.default_rng(2)
a = rng.uniform(-3, 3, (5, 37)).astype(np.float32)
x = api.from_host(a).sync()

def check(got, want, tol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol, equal_nan=True)

# gathers: wrap, the device-side check, the clamping variant of graphs
idx = np.array([[4, -1], [0, 2]])
i = api.from_host(idx).sync()
check(ops.take(x, i, 0).to_host().sync(), np.take(a, idx, 0))
check(x[:, i].to_host().sync(), a[:, idx])
check(ops.take_along_axis(x, api.from_host(np.argsort(a, 1)).sync(), 1).to_host().sync(), np.sort(a, 1))
try:
    ops.take(x, api.from_host(np.array([1, 5])).sync(), 0).sync()
    raise AssertionError("no IndexError")
except IndexError as err:
    assert "index 5 is out of range for axis 0 of size 5" in str(err), err
out = api.zeros((2, 37)).sync()
ids = api.from_host(np.array([3, 9])).sync()
g = ops.take(x, ids, 0, out=out).graph()
g.launch().sync()
check(out.to_host().sync(), a[[3, 0]])  # clamped inside a graph
bf = x.astype("bfloat16").sync()
check(ops.take(bf, i, 0).astype(np.float32).to_host().sync(), bf.astype(np.float32).to_host().sync()[idx])
ramp = np.arange(37, dtype=np.int64)
prod_bf = (bf * api.from_host(ramp).sync()).sync()  # bfloat16 beside int64 stays bfloat16
assert prod_bf.dtype == bf.dtype, prod_bf.dtype
want_bf = (bf.astype(np.float32).to_host().sync() * ramp).astype(bf.dtype).astype(np.float32)
check(prod_bf.astype(np.float32).to_host().sync(), want_bf)
# elementwise math (finite inputs: the simulator's math module refuses sin(inf))
s = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -3.7, 3.7, 0.0, -0.0, -0.4, np.nan], np.float32)
S = api.from_host(s).sync()
for got, want in (
    *((getattr(ops, name)(S), ref(s)) for name, ref in (("floor", np.floor), ("ceil", np.ceil), ("round", np.round), ("sign", np.sign))),
    (ops.round(S, 1), np.round(s, 1)),
    (ops.round(S, -1), np.round(s, -1)),
):
    got = got.to_host().sync()
    check(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0.0 where numpy gives it
check(ops.sin(x).to_host().sync(), np.sin(a))
check(ops.cos(x).to_host().sync(), np.cos(a))
check(ops.erf(x).to_host().sync(), np.vectorize(math.erf, otypes=[np.float32])(a))
check((abs(x) ** 0.5).to_host().sync(), np.abs(a) ** 0.5)
n = np.array([-3, -1, 0, 1, 2, 5], np.int32)
N = api.from_host(n).sync()
check((N ** 3).to_host().sync(), n ** 3)
for k in (np.array([3, -3, 2, 7], np.int8), np.array([3, 7, 2, 1], np.uint64)):  # exact, wrapping as numpy's
    K = api.from_host(k).sync()
    check((K ** api.from_host(np.array([5, 5, 7, 39], k.dtype)).sync()).to_host().sync(), k ** np.array([5, 5, 7, 39], k.dtype))
    check((K ** 39).to_host().sync(), k ** 39)
check((N ** api.from_host(np.array([1, -3, 2, -2, 0, 2], np.int32)).sync()).to_host().sync(), np.array([-3, -1, 0, 1, 1, 25], np.int32))
check(ops.floor(N).to_host().sync(), n)
for dt in (np.int8, np.int64, np.uint64):  # integers to negative decimals: float64, cast back
    k = np.array([0, 5, 15, 25, 35, 46, 99, 125], dt)
    check(ops.round(api.from_host(k).sync(), -1).to_host().sync(), np.round(k, -1))
check(ops.round(N, -1).to_host().sync(), np.round(n, -1))
flags = np.array([True, False, True])
F = api.from_host(flags).sync()
sq, rb = (F ** 2).to_host().sync(), ops.round(F).to_host().sync()
assert sq.dtype == np.int8 and rb.dtype == np.float16, (sq.dtype, rb.dtype)  # numpy's square and rint of bools
np.testing.assert_array_equal(sq, flags ** 2)
np.testing.assert_array_equal(rb, np.round(flags))
for name in ("isnan", "isinf", "isfinite"):  # bools have no subtraction: their own expressions
    check(getattr(ops, name)(F).to_host().sync(), getattr(np, name)(flags))
check((N ** 2).to_host().sync(), n ** 2)
check(ops.clip(x, -1, 1.5).to_host().sync(), np.clip(a, -1, 1.5))
check(ops.clip(S, None, 0.5).to_host().sync(), np.clip(s, None, 0.5))
# comparisons no one dtype holds: uint64 against int64, a Python int beyond the dtype
u, i = np.array([0, 2**63, 2**64 - 1], np.uint64), np.array([-1, 1, 2**63 - 1], np.int64)
U = api.from_host(u).sync()
check((U < api.from_host(i).sync()).to_host().sync(), u < i)
check((api.from_host(i).sync() >= U).to_host().sync(), i >= u)
check((U > -1).to_host().sync(), u > -1)
check(ops.prod(x[:, :6], 1).to_host().sync(), np.prod(a[:, :6], 1), 1e-4)
check(ops.any(x > 2.5, 1).to_host().sync(), np.any(a > 2.5, 1))
check(ops.all(x[:, :3], 0).to_host().sync(), np.all(a[:, :3], 0))  # (few rows: the simulator is slow)
check(ops.argmin(x, 1).to_host().sync(), np.argmin(a, 1))
check(ops.argmin(x).to_host().sync(), np.argmin(a))
check(ops.var(x[:2], 1).to_host().sync(), np.var(a[:2], 1))
check(ops.std(x[:, :3], 0, ddof=1).to_host().sync(), np.std(a[:, :3], 0, ddof=1))
v = a.astype(np.float64)
check(ops.logsumexp(x, 1).to_host().sync(), (np.log(np.exp(v - v.max(1, keepdims=True)).sum(1)) + v.max(1)).astype(np.float32))
# cumsum over more than one chunk of 256
c = rng.integers(-5, 5, (2, 300)).astype(np.int32)
check(ops.cumsum(api.from_host(c).sync(), 1).to_host().sync(), np.cumsum(c, 1))
check(ops.cumsum(x[:, :3], 0).to_host().sync(), np.cumsum(a[:, :3], 0))
# sorting: ties, NaN, padding to a power of two
t = rng.integers(-3, 4, (3, 11)).astype(np.float32)
t[1, 4] = t[2, 0] = np.nan
T = api.from_host(t).sync()
check(ops.sort(T).to_host().sync(), np.sort(t, kind="stable"))
check(ops.argsort(T, 0).to_host().sync(), np.argsort(t, 0, kind="stable"))
vals, inds = ops.topk(T, 4).sync()
order = (10 - np.argsort(t[:, ::-1], axis=1, kind="stable"))[:, ::-1][:, :4]
check(inds.to_host().sync(), order)
check(vals.to_host().sync(), np.take_along_axis(t, order, 1))
assert trio_cuda.device(0)._driver._kernels, "the generated kernels did not run their numba code"
print("OK")
"""


@pytest.mark.sim_only
def test_new_ops_kernels_in_numbas_simulator() -> None:
    child_ok(child(PROGRAM, TRIO_CUDA_SIM_OPS_NUMBA="1"))
