"""ops.sgd_step and ops.adamw_step against PyTorch's formulas (numpy, float64), in place
over lists of tensors; learning rate and step count from 0-d tensors, so a captured step
replays with new values; bad input refused before any work."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, ops

from ..helpers.optim import adamw_ref, sgd_ref

RNG = np.random.default_rng(35)
SHAPES = [(7, 5), (1300,), (3,), (2, 2, 4)]  # past 1024 elements: the unrolled path and its tail
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BF16: 1e-2}


def close(got: np.ndarray, want: np.ndarray, dt: np.dtype[Any]) -> None:
    tol = TOL[np.dtype(dt)]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


async def tensors(arrays: list[np.ndarray], dtype: Any) -> list[trio_cuda.Tensor]:
    return [await api.from_host(a.astype(dtype)) for a in arrays]


@pytest.mark.parametrize(
    "dtype,state", [(np.float32, np.float32), (np.float64, np.float64), (np.float16, np.float32), (BF16, BF16)]
)
async def test_adamw_steps_follow_pytorchs_formula(dtype: Any, state: Any) -> None:
    dt = np.dtype(dtype)
    P = [RNG.standard_normal(s).astype(dt).astype(np.float64) for s in SHAPES]
    G = [RNG.standard_normal(s).astype(dt).astype(np.float64) for s in SHAPES]
    ps, gs = await tensors(P, dt), await tensors(G, dt)
    ms = [await api.zeros(s, state) for s in SHAPES]
    vs = [await api.zeros(s, state) for s in SHAPES]
    lr = await api.from_host(np.array(1e-2, np.float32))
    M = [np.zeros(s) for s in SHAPES]
    V = [np.zeros(s) for s in SHAPES]
    for step, rate in ((1, 1e-2), (2, 3e-2)):
        await api.memcpy(lr, np.array(rate, np.float32))
        out = await ops.adamw_step(ps, gs, ms, vs, lr=lr, step=step, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
        assert out == tuple(ps)  # in place: the op's output is the parameters
        for i in range(len(SHAPES)):
            P[i], M[i], V[i] = adamw_ref(P[i], G[i], M[i], V[i], float(np.float32(rate)), step, 0.8, 0.99, 1e-6, 0.1)
        for i in range(len(SHAPES)):
            close(await ps[i].to_host(), P[i], dt)
            close(await ms[i].to_host(), M[i], np.dtype(state))
            close(await vs[i].to_host(), V[i], np.dtype(state))
            # the half types round once, from the float32 result, to nearest even
            P[i] = (await ps[i].to_host()).astype(np.float64)
            M[i] = (await ms[i].to_host()).astype(np.float64)
            V[i] = (await vs[i].to_host()).astype(np.float64)


@pytest.mark.parametrize(
    "momentum,dampening,wd,nesterov",
    [(0.0, 0.0, 0.0, False), (0.9, 0.0, 0.01, False), (0.9, 0.0, 0.0, True), (0.5, 0.3, 0.1, False)],
)
async def test_sgd_steps_follow_pytorchs_formula(momentum: float, dampening: float, wd: float, nesterov: bool) -> None:
    P = [RNG.standard_normal(s).astype(np.float32).astype(np.float64) for s in SHAPES]
    G = [RNG.standard_normal(s).astype(np.float32).astype(np.float64) for s in SHAPES]
    ps, gs = await tensors(P, np.float32), await tensors(G, np.float32)
    bufs = [await api.zeros(s) for s in SHAPES] if momentum else None
    B = [np.zeros(s) for s in SHAPES]
    for _ in range(3):
        await ops.sgd_step(ps, gs, bufs, lr=0.1, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov)
        for i in range(len(SHAPES)):
            P[i], B[i] = sgd_ref(P[i], G[i], B[i], float(np.float32(0.1)), momentum, dampening, wd, nesterov)
    for i in range(len(SHAPES)):
        close(await ps[i].to_host(), P[i], np.dtype(np.float32))
        if bufs is not None:
            close(await bufs[i].to_host(), B[i], np.dtype(np.float32))


async def test_a_captured_training_step_replays_with_a_changed_lr_tensor() -> None:
    """lr and step live in 0-d tensors: one capture, replayed three times, the lr changed
    between replays by a copy into its tensor, the step counted by the step itself."""
    P = [RNG.standard_normal(s).astype(np.float32) for s in SHAPES]
    G = [RNG.standard_normal(s).astype(np.float32) for s in SHAPES]
    ps, gs = await tensors(P, np.float32), await tensors(G, np.float32)
    ms = [await api.zeros(s) for s in SHAPES]
    vs = [await api.zeros(s) for s in SHAPES]
    lr = await api.from_host(np.array(0.1, np.float32))
    count = await api.from_host(np.array(0, np.int64))
    step = ops.add(count, 1, out=count).then(lambda c: ops.adamw_step(ps, gs, ms, vs, lr=lr, step=c, weight_decay=0.05))
    graph = step.graph()  # captured: nothing ran
    assert await count.item() == 0
    np.testing.assert_array_equal(await ps[0].to_host(), P[0])
    want = [p.astype(np.float64) for p in P]
    M = [np.zeros(s) for s in SHAPES]
    V = [np.zeros(s) for s in SHAPES]
    for n, rate in ((1, 0.1), (2, 0.1), (3, 0.025)):
        if rate != 0.1:
            await api.memcpy(lr, np.array(rate, np.float32))
        await graph.launch()
        for i in range(len(SHAPES)):
            want[i], M[i], V[i] = adamw_ref(want[i], G[i], M[i], V[i], float(np.float32(rate)), n, 0.9, 0.999, 1e-8, 0.05)
    assert await count.item() == 3
    for i in range(len(SHAPES)):
        close(await ps[i].to_host(), want[i], np.dtype(np.float32))


async def test_sgd_with_a_python_lr_and_an_lr_tensor_agree() -> None:
    a = RNG.standard_normal((40,)).astype(np.float32)
    g = RNG.standard_normal((40,)).astype(np.float32)
    p1, p2, gt = await api.from_host(a), await api.from_host(a), await api.from_host(g)
    await ops.sgd_step([p1], [gt], lr=0.5)
    await ops.sgd_step([p2], [gt], lr=await api.from_host(np.array(0.5, np.float64)))
    np.testing.assert_array_equal(await p1.to_host(), await p2.to_host())
    np.testing.assert_array_equal(await p1.to_host(), a - np.float32(0.5) * g)


async def test_an_empty_parameter_list_is_a_no_op() -> None:
    assert await ops.adamw_step([], [], [], [], lr=1e-3, step=1) == ()


async def test_bad_input_is_refused_before_any_work() -> None:
    p = await api.zeros((4, 3))
    g = await api.zeros((4, 3))
    m, v = await api.zeros((4, 3)), await api.zeros((4, 3))
    lr = 1e-3
    with pytest.raises(ValueError, match="2 grads for 1 params"):
        ops.adamw_step([p], [g, g], [m], [v], lr=lr, step=1)
    with pytest.raises(ValueError, match=r"grad 0 has shape \(3, 4\)"):
        ops.adamw_step([p], [g.T], [m], [v], lr=lr, step=1)
    with pytest.raises(ValueError, match="exp_avg 0 and exp_avg_sq 0 share memory"):
        ops.adamw_step([p], [g], [m], [m], lr=lr, step=1)
    with pytest.raises(ValueError, match="param 0 and param 1 share memory"):
        ops.sgd_step([p, p], [g, g], lr=lr)
    with pytest.raises(ValueError, match="not C-contiguous"):
        ops.sgd_step([p[:, ::2]], [g[:, ::2]], lr=lr)
    with pytest.raises(ValueError, match=r"betas\[1\] must be finite and in \[0.0, 1.0\)"):
        ops.adamw_step([p], [g], [m], [v], lr=lr, step=1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="step must be finite"):
        ops.adamw_step([p], [g], [m], [v], lr=lr, step=0)
    with pytest.raises(ValueError, match=r"lr must be a number or a one-element \(0-d\) tensor, not of shape \(4, 3\)"):
        ops.adamw_step([p], [g], [m], [v], lr=p, step=1)
    with pytest.raises(TypeError, match="exp_avg 0 has dtype float64"):
        ops.adamw_step([p], [g], [await api.zeros((4, 3), np.float64)], [v], lr=lr, step=1)
    with pytest.raises(TypeError, match="param 0 has dtype int32"):
        ops.sgd_step([await api.zeros((4,), np.int32)], [await api.zeros((4,), np.int32)], lr=lr)
    with pytest.raises(ValueError, match="needs momentum_buffers"):
        ops.sgd_step([p], [g], lr=lr, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov needs a momentum"):
        ops.sgd_step([p], [g], [m], lr=lr, nesterov=True)
    with pytest.raises(TypeError, match="params must be a list or tuple"):
        ops.sgd_step(p, [g], lr=lr)
    assert (await p.to_host() == 0).all()
