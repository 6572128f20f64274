"""The generated kernels of the training ops (optimizer steps, cross-entropy, dropout) run in
numba's CUDA simulator against their numpy twins: the kernel source (unrolled element
loops and their tails, 0-d tensor reads, bfloat16 bits, block reductions, Philox) is
checked without a GPU. Small shapes: the simulator is slow."""

from __future__ import annotations

import pytest

from ..helpers.faults import child, child_ok

PROGRAM = """
import numpy as np
import ml_dtypes
import trio_cuda
from trio_cuda import api, ops

BF = ml_dtypes.bfloat16
rng = np.random.default_rng(5)



def adamw_ref(p, g, m, v, lr, step, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - lr / (1 - b1**step) * m / (np.sqrt(v) / np.sqrt(1 - b2**step) + eps), m, v


for dt, tol in ((np.float32, 2e-5), (BF, 1e-2)):
    a = rng.standard_normal(1100).astype(dt)
    g = rng.standard_normal(1100).astype(dt)
    p, gt = api.from_host(a).sync(), api.from_host(g).sync()
    m, v = api.zeros((1100,), np.float32).sync(), api.zeros((1100,), np.float32).sync()
    lr = api.from_host(np.array(0.01, np.float32)).sync()
    step = api.from_host(np.array(2, np.int32)).sync()
    ops.adamw_step([p], [gt], [m], [v], lr=lr, step=step).sync()
    want, wm, wv = adamw_ref(a.astype(np.float64), g.astype(np.float64), 0.0, 0.0, float(np.float32(0.01)), 2)
    np.testing.assert_allclose(p.to_host().sync().astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(m.to_host().sync(), wm, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(v.to_host().sync(), wv, rtol=1e-4, atol=1e-8)

a = rng.standard_normal(300).astype(np.float32)
g = rng.standard_normal(300).astype(np.float32)
p, gt, buf = api.from_host(a).sync(), api.from_host(g).sync(), api.zeros((300,)).sync()
ops.sgd_step([p], [gt], [buf], lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True).sync()
gg = g.astype(np.float64) + 0.1 * a
np.testing.assert_allclose(p.to_host().sync(), a - 0.1 * (gg + 0.9 * gg), rtol=1e-5, atol=1e-6)

for dt, tol in ((np.float32, 1e-5), (BF, 2e-2)):
    x = (rng.standard_normal((3, 1030)) * 2).astype(dt)
    lab = np.array([4, -100, 1029])
    X, L = api.from_host(x).sync(), api.from_host(lab).sync()
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(1, keepdims=True))
    lse = np.log(e.sum(1)) + x64.max(1)
    rows = lse - x64[np.arange(3), np.maximum(lab, 0)]
    got = ops.cross_entropy(X, L, ignore_index=-100).to_host().sync()
    np.testing.assert_allclose(float(got), rows[[0, 2]].mean(), rtol=tol)
    each = ops.cross_entropy(X, L, ignore_index=-100, reduction="none").to_host().sync().astype(np.float64)
    np.testing.assert_allclose(each[[0, 2]], rows[[0, 2]], rtol=tol)
    assert each[1] == 0
    sm = e / e.sum(1, keepdims=True)
    sm[0, 4] -= 1
    sm[2, 1029] -= 1
    sm = sm / 2
    sm[1] = 0
    gr = ops.cross_entropy_grad(X, L, ignore_index=-100).to_host().sync().astype(np.float64)
    np.testing.assert_allclose(gr, sm, rtol=tol, atol=tol * 0.5)

xs = api.from_host(np.ones(300, np.float32)).sync()
seed = api.from_host(np.array(9, np.int64)).sync()
d = ops.dropout(xs, 0.25, seed, offset=3).to_host().sync()
u = ops.uniform((300,), seed=9, offset=3).to_host().sync()
np.testing.assert_array_equal(d, np.where(u >= np.float32(0.25), np.float32(1 / 0.75), 0).astype(np.float32))
assert trio_cuda.device(0)._driver._kernels, "the generated kernels did not run their numba code"
print("OK")
"""


@pytest.mark.sim_only
def test_training_kernels_in_numbas_simulator() -> None:
    child_ok(child(PROGRAM, TRIO_CUDA_SIM_OPS_NUMBA="1"))


MULTI = """
import numpy as np
import ml_dtypes
import trio_cuda
from trio_cuda import api, ops
from trio_cuda._ops import _optim

# small blocks and launches: several tensors a launch, several blocks and passes a tensor,
# unrolled passes, partial passes and whole passes past the end (the simulator is slow)
_optim.BLOCK, _optim.UNROLL, _optim.CHUNKS, _optim.TENSORS_PER_LAUNCH = 8, 2, 2, 3
BF = ml_dtypes.bfloat16
rng = np.random.default_rng(6)
sizes = [0, 1, 31, 32, 33, 100, 5]
dts = [(np.float32, np.float32), (BF, np.float32), (np.float32, np.float32)] * 3


def adamw_ref(p, g, lr, step, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    m, v = (1 - b1) * g, (1 - b2) * g * g
    return p * (1 - lr * wd) - lr / (1 - b1**step) * m / (np.sqrt(v) / np.sqrt(1 - b2**step) + eps), m, v


P = [rng.standard_normal(n).astype(dts[i][0]) for i, n in enumerate(sizes)]
G = [rng.standard_normal(n).astype(dts[i][0]) for i, n in enumerate(sizes)]
ps = [api.from_host(a).sync() for a in P]
gs = [api.from_host(g).sync() for g in G]
ms = [api.zeros((n,), dts[i][1]).sync() for i, n in enumerate(sizes)]
vs = [api.zeros((n,), dts[i][1]).sync() for i, n in enumerate(sizes)]
lr = api.from_host(np.array(0.01, np.float32)).sync()
step = api.from_host(np.array(3, np.int64)).sync()
ops.adamw_step(ps, gs, ms, vs, lr=lr, step=step).sync()
for i in range(len(sizes)):
    tol = 1e-2 if dts[i][0] is BF else 2e-5
    want, wm, wv = adamw_ref(P[i].astype(np.float64), G[i].astype(np.float64), float(np.float32(0.01)), 3)
    np.testing.assert_allclose(ps[i].to_host().sync().astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(ms[i].to_host().sync(), wm, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(vs[i].to_host().sync(), wv, rtol=1e-4, atol=1e-8)

f = [rng.standard_normal(n).astype(np.float32) for n in sizes]
h = [rng.standard_normal(n).astype(np.float32) for n in sizes]
qs = [api.from_host(a).sync() for a in f]
hs = [api.from_host(a).sync() for a in h]
bufs = [api.zeros((n,)).sync() for n in sizes]
ops.sgd_step(qs, hs, bufs, lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True).sync()
for a, g, q, b in zip(f, h, qs, bufs):
    gg = g.astype(np.float64) + 0.1 * a
    np.testing.assert_allclose(q.to_host().sync(), a - 0.1 * (gg + 0.9 * gg), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.to_host().sync(), gg, rtol=1e-5, atol=1e-6)
assert trio_cuda.device(0)._driver._kernels, "the generated kernels did not run their numba code"
print("OK")
"""


@pytest.mark.sim_only
def test_multi_tensor_optimizer_launches_in_numbas_simulator() -> None:
    child_ok(child(MULTI, TRIO_CUDA_SIM_OPS_NUMBA="1"))
