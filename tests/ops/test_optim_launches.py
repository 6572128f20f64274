"""The optimizer steps' multi-tensor launches: one kernel over up to
``TENSORS_PER_LAUNCH`` parameters of one dtype signature, each block finding its tensor.
Mixed sizes (empty, one element, around a block's and a pass's width, many blocks), more
tensors than one launch holds and mixed dtypes give PyTorch's formula and the same bits
as one call per tensor; a step's launches are counted by the device's statistics; a
captured step over several launches replays with a changed lr tensor."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, ops
from trio_cuda._ops import _optim

from ..helpers.optim import adamw_ref, sgd_ref

RNG = np.random.default_rng(36)
BF16 = np.dtype(ml_dtypes.bfloat16)
SIZES = [0, 1, 1023, 1024, 1025, 70000, 3, 2049]
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BF16: 1e-2}
SGD = [(0.0, 0.0, 0.0, False), (0.0, 0.0, 0.1, False), (0.9, 0.0, 0.01, False), (0.9, 0.0, 0.0, True), (0.5, 0.3, 0.1, False)]


def launches() -> int:
    return trio_cuda.device(0).statistics().launches


def close(got: np.ndarray, want: np.ndarray, dt: Any) -> None:
    tol = TOL[np.dtype(dt)]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


async def upload(arrays: list[np.ndarray], dtypes: list[Any]) -> list[trio_cuda.Tensor]:
    return [await api.from_host(a.astype(dt)) for a, dt in zip(arrays, dtypes, strict=True)]


async def read(ts: list[trio_cuda.Tensor]) -> list[np.ndarray]:
    return [await t.to_host() for t in ts]


def per_launch(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    monkeypatch.setattr(_optim, "TENSORS_PER_LAUNCH", k)


async def test_adamw_over_mixed_sizes_is_pytorchs_formula_and_the_per_tensor_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    per_launch(monkeypatch, 3)  # 7 non-empty tensors: 3 launches
    P = [RNG.standard_normal(n).astype(np.float32) for n in SIZES]
    G = [RNG.standard_normal(n).astype(np.float32) for n in SIZES]
    f32 = [np.float32] * len(SIZES)
    ps, gs = await upload(P, f32), await upload(G, f32)
    ms, vs = [await api.zeros((n,)) for n in SIZES], [await api.zeros((n,)) for n in SIZES]
    # the same step, one call per tensor (each a launch of its own)
    qs = await upload(P, f32)
    qm, qv = [await api.zeros((n,)) for n in SIZES], [await api.zeros((n,)) for n in SIZES]
    lr = await api.from_host(np.array(1e-2, np.float32))
    step = await api.from_host(np.array(1, np.int64))
    want = [(p.astype(np.float64), np.zeros(p.shape), np.zeros(p.shape)) for p in P]
    for n, rate in ((1, 1e-2), (2, 4e-2)):
        await api.memcpy(lr, np.array(rate, np.float32))
        await api.memcpy(step, np.array(n, np.int64))
        before = launches()
        assert await ops.adamw_step(ps, gs, ms, vs, lr=lr, step=step, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1) == tuple(ps)
        assert launches() - before == 3
        for i in range(len(SIZES)):
            await ops.adamw_step(
                [qs[i]], [gs[i]], [qm[i]], [qv[i]], lr=lr, step=step, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1
            )
        r = float(np.float32(rate))
        want = [
            adamw_ref(p, g.astype(np.float64), m, v, r, n, 0.8, 0.99, 1e-6, 0.1) for (p, m, v), g in zip(want, G, strict=True)
        ]
        got = await read(ps + ms + vs)
        for a, b in zip(got, await read(qs + qm + qv), strict=True):
            assert a.tobytes() == b.tobytes()
        for i, (p, m, v) in enumerate(want):
            close(got[i], p, np.float32)
            close(got[len(SIZES) + i], m, np.float32)
            close(got[2 * len(SIZES) + i], v, np.float32)
        want = [(got[i].astype(np.float64), m, v) for i, (_, m, v) in enumerate(want)]


@pytest.mark.parametrize("momentum,dampening,wd,nesterov", SGD)
async def test_sgd_over_mixed_sizes_is_pytorchs_formula_and_the_per_tensor_steps(
    monkeypatch: pytest.MonkeyPatch, momentum: float, dampening: float, wd: float, nesterov: bool
) -> None:
    per_launch(monkeypatch, 4)  # 7 non-empty tensors: 2 launches
    P = [RNG.standard_normal(n).astype(np.float32) for n in SIZES]
    G = [RNG.standard_normal(n).astype(np.float32) for n in SIZES]
    f32 = [np.float32] * len(SIZES)
    ps, qs, gs = await upload(P, f32), await upload(P, f32), await upload(G, f32)
    bufs = [await api.zeros((n,)) for n in SIZES] if momentum else None
    qbufs = [await api.zeros((n,)) for n in SIZES] if momentum else None
    lr = await api.from_host(np.array(0.05, np.float32))
    hyper = {"momentum": momentum, "dampening": dampening, "weight_decay": wd, "nesterov": nesterov}
    want = [(p.astype(np.float64), np.zeros(p.shape)) for p in P]
    for _ in range(2):
        before = launches()
        await ops.sgd_step(ps, gs, bufs, lr=lr, **hyper)
        assert launches() - before == 2
        for i in range(len(SIZES)):
            await ops.sgd_step([qs[i]], [gs[i]], [qbufs[i]] if qbufs else None, lr=lr, **hyper)
        want = [
            sgd_ref(p, g.astype(np.float64), b, float(np.float32(0.05)), momentum, dampening, wd, nesterov)
            for (p, b), g in zip(want, G, strict=True)
        ]
    got, ref = await read(ps + (bufs or [])), await read(qs + (qbufs or []))
    for a, b in zip(got, ref, strict=True):
        assert a.tobytes() == b.tobytes()
    for i, (p, b) in enumerate(want):
        close(got[i], p, np.float32)
        if bufs:
            close(got[len(SIZES) + i], b, np.float32)


async def test_mixed_dtypes_take_a_launch_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters of several dtypes (half types with float32 or their own states, float64)
    in one call: each signature's tensors share launches, each gets its own formula."""
    per_launch(monkeypatch, 2)
    kinds = [(np.float32, np.float32), (BF16, np.float32), (np.float16, np.float32), (np.float64, np.float64), (BF16, BF16)]
    spec = [(kinds[i % len(kinds)], n) for i, n in enumerate([1025, 3, 70000, 1, 1024, 5, 0, 1023, 2000, 7, 4, 9])]
    P = [RNG.standard_normal(n).astype(pd).astype(np.float64) for (pd, _), n in spec]
    G = [RNG.standard_normal(n).astype(pd).astype(np.float64) for (pd, _), n in spec]
    ps = await upload(P, [pd for (pd, _), _ in spec])
    gs = await upload(G, [pd for (pd, _), _ in spec])
    ms = [await api.zeros((n,), sd) for (_, sd), n in spec]
    vs = [await api.zeros((n,), sd) for (_, sd), n in spec]
    before = launches()
    await ops.adamw_step(ps, gs, ms, vs, lr=3e-3, step=4, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.05)
    nonempty: dict[Any, int] = {}
    for (pd, sd), n in spec:
        if n:
            nonempty[(np.dtype(pd), np.dtype(sd))] = nonempty.get((np.dtype(pd), np.dtype(sd)), 0) + 1
    assert launches() - before == sum(math.ceil(c / 2) for c in nonempty.values())
    for i, ((pd, sd), _) in enumerate(spec):
        rate = 3e-3 if pd == np.float64 else float(np.float32(3e-3))  # (the compute type's lr)
        p, m, v = adamw_ref(P[i], G[i], 0.0, 0.0, rate, 4, 0.9, 0.95, 1e-7, 0.05)
        close(await ps[i].to_host(), p, pd)
        close(await ms[i].to_host(), m, sd)
        close(await vs[i].to_host(), v, sd)


async def test_a_launch_takes_as_many_tensors_as_its_parameters_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for 100 tensors a launch, a step takes as many as keep the kernel's parameters
    under MAX_PARAM_BYTES (CUDA's limit is 4096 bytes)."""
    per_launch(monkeypatch, 100)
    k = _optim.tensors_per_launch(4, 2, 6)  # adamw: 4 arrays a tensor; lr and step tensors, 4 numbers
    assert 1 < k < 100
    assert _optim.param_bytes(4, k, 2, 6) <= _optim.MAX_PARAM_BYTES < _optim.param_bytes(4, k + 1, 2, 6)
    assert _optim.MAX_PARAM_BYTES < 4096
    n = 2 * k + 1
    ps = [await api.from_host(np.full(3, i, np.float32)) for i in range(n)]
    gs = [await api.from_host(np.ones(3, np.float32)) for _ in range(n)]
    ms, vs = [await api.zeros((3,)) for _ in range(n)], [await api.zeros((3,)) for _ in range(n)]
    lr = await api.from_host(np.array(0.5, np.float32))
    step = await api.from_host(np.array(1, np.int32))
    before = launches()
    await ops.adamw_step(ps, gs, ms, vs, lr=lr, step=step, weight_decay=0.0)
    assert launches() - before == 3
    # each tensor got its own update: p - lr * m_hat / (sqrt(v_hat) + eps) with m_hat = v_hat = 1
    for i, p in enumerate(ps):
        np.testing.assert_allclose(await p.to_host(), np.full(3, i - 0.5 / (1 + 1e-8)), rtol=1e-6)


async def test_a_captured_multi_launch_step_replays_with_a_changed_lr(monkeypatch: pytest.MonkeyPatch) -> None:
    per_launch(monkeypatch, 3)
    P = [RNG.standard_normal(n).astype(np.float32) for n in SIZES]
    G = [RNG.standard_normal(n).astype(np.float32) for n in SIZES]
    f32 = [np.float32] * len(SIZES)
    ps, gs = await upload(P, f32), await upload(G, f32)
    ms, vs = [await api.zeros((n,)) for n in SIZES], [await api.zeros((n,)) for n in SIZES]
    lr = await api.from_host(np.array(0.1, np.float32))
    count = await api.from_host(np.array(0, np.int64))
    graph = ops.add(count, 1, out=count).then(lambda c: ops.adamw_step(ps, gs, ms, vs, lr=lr, step=c, weight_decay=0.05)).graph()
    np.testing.assert_array_equal(await ps[5].to_host(), P[5])  # captured: nothing ran
    dev = trio_cuda.device(0)
    before = dev.statistics()
    want = [(p.astype(np.float64), np.zeros(p.shape), np.zeros(p.shape)) for p in P]
    for n, rate in ((1, 0.1), (2, 0.02)):
        await api.memcpy(lr, np.array(rate, np.float32))
        await graph.launch()
        r = float(np.float32(rate))
        want = [
            adamw_ref(p, g.astype(np.float64), m, v, r, n, 0.9, 0.999, 1e-8, 0.05) for (p, m, v), g in zip(want, G, strict=True)
        ]
    after = dev.statistics()
    assert after.graph_launches - before.graph_launches == 2
    assert await count.item() == 2
    for i, (p, m, v) in enumerate(want):
        close(await ps[i].to_host(), p, np.float32)
        close(await ms[i].to_host(), m, np.float32)
        close(await vs[i].to_host(), v, np.float32)
