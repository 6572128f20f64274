"""The ops' recipe cache (``ops.cache_statistics()`` counts it): a repeated op on the
same tensors skips its checks and build, and must still compute the right thing, raise
the same errors, forget what a reset or a freed buffer invalidates, and stay bounded."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, lowlevel, ops
from trio_cuda._ops import _core
from trio_cuda.kernels import sleep

from ..helpers.data import f32
from ..helpers.devices import counter, needs_devices


def stats() -> tuple[int, int]:
    s = ops.cache_statistics()
    return s.hits, s.misses


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


async def test_the_second_call_on_the_same_tensors_replays_and_is_right() -> None:
    hx, hy, hw, hm = f32(1, 64), f32(1, 64), f32(64), f32(64, 64)
    x, y, w, m = [await api.from_host(a) for a in (hx, hy, hw, hm)]
    out, q = await api.zeros((1, 64)), await api.zeros((64,))
    x1 = x.reshape(64)
    makers = [
        (lambda: ops.add(x, y, out=out), lambda: hx + hy),
        (lambda: ops.rms_norm(x, w, 1e-6, out=out), lambda: rms_norm_ref(hx, hw, 1e-6)),
        (lambda: ops.matmul(m, x1, out=q), lambda: hm @ hx[0]),
        (lambda: ops.softmax(x), lambda: np.exp(hx) / np.exp(hx).sum(-1, keepdims=True)),  # allocates
    ]
    for make, want in makers:
        h0, m0 = stats()
        for i in range(4):  # the first builds, the second replays, the third on the prepared launch
            r = await make()
            np.testing.assert_allclose(await r.to_host(), np.asarray(want()).reshape(r.shape), rtol=1e-5, atol=1e-5)
            h, m_ = stats()
            assert (h - h0, m_ - m0) == (i, 1), (make, i)
    # with out=, the result is out= itself, as without the cache
    assert await ops.add(x, y, out=out) is out


async def test_ops_with_op_inputs_replay_too() -> None:
    hx, hy = f32(8), f32(8)
    x, y = await api.from_host(hx), await api.from_host(hy)
    out = await api.zeros((8,))
    for _ in range(3):
        await ops.add(ops.multiply(x, 2.0, out=out), y, out=out)
        np.testing.assert_allclose(await out.to_host(), 2 * hx + hy, rtol=1e-6)
    h0, _ = stats()
    await ops.add(ops.multiply(x, 2.0, out=out), y, out=out)
    assert stats()[0] == h0 + 2


@pytest.mark.sim_only  # steers the simulated allocator to reuse an address
async def test_a_new_buffer_at_a_freed_address_is_not_confused_with_the_old(dev: trio_cuda.Device) -> None:
    drv = dev._driver
    out = await api.zeros((16,))
    a = await api.from_host(np.ones(16, np.float32))
    for _ in range(3):
        await ops.multiply(a, 3.0, out=out)
    np.testing.assert_array_equal(await out.to_host(), np.full(16, 3.0))
    ptr = a.ptr
    buf = weakref.ref(a._buffer)
    del a
    gc.collect()
    assert buf() is None, "the cache keeps the buffer alive"
    await api.zeros((1,))  # enqueues the deferred free
    await trio.to_thread.run_sync(dev.synchronize)
    assert drv._alloc_at(ptr) is None
    saved = drv._next
    drv._next = ptr  # the next allocation lands where a was
    try:
        b = await api.from_host(np.full(16, 5.0, np.float32))
    finally:
        drv._next = saved
    assert b.ptr == ptr
    _, m0 = stats()
    for _ in range(3):
        await ops.multiply(b, 3.0, out=out)
        np.testing.assert_array_equal(await out.to_host(), np.full(16, 15.0))
    assert stats()[1] == m0 + 1  # b's memory is new: built once, not taken for a's


async def test_views_of_one_buffer_with_other_strides_or_offsets_are_distinct() -> None:
    hx = f32(6, 8)
    x = await api.from_host(hx)
    views = [
        (x, hx),
        (x[:, ::2], hx[:, ::2]),
        (x[:, 1::2], hx[:, 1::2]),
        (x[1:4], hx[1:4]),
        (x[2:5], hx[2:5]),
        (x.T, hx.T),
        (x[::-1], hx[::-1]),
        (x.untracked(), hx),
    ]
    for _ in range(3):
        for v, want in views:
            np.testing.assert_array_equal(await ops.negative(v).to_host(), -want)
            np.testing.assert_allclose(await ops.sum(v, axis=0).to_host(), want.sum(axis=0), rtol=1e-5, atol=1e-5)


async def test_another_scalar_dtype_or_out_misses() -> None:
    hx = f32(8)
    x = await api.from_host(hx)
    x64 = await api.from_host(hx.astype(np.float64))
    o1, o2 = await api.zeros((8,)), await api.zeros((8,))
    cases = [
        (lambda: ops.multiply(x, 2.0, out=o1), o1, hx * 2),
        (lambda: ops.multiply(x, 3.0, out=o1), o1, hx * 3),
        (lambda: ops.multiply(x, -0.0, out=o1), o1, hx * -0.0),
        (lambda: ops.multiply(x, 0.0, out=o1), o1, hx * 0.0),
        (lambda: ops.multiply(x, 2, out=o1), o1, hx * 2),
        (lambda: ops.multiply(x, np.float64(2.0), out=o1), o1, hx * np.float64(2.0)),
        (lambda: ops.multiply(x, 2.0, out=o2), o2, hx * 2),
        (lambda: ops.multiply(x, 2.0), None, hx * 2),
        (lambda: ops.multiply(x64, 2.0), None, hx.astype(np.float64) * 2),
        (lambda: ops.rms_norm(x, None, 1e-6), None, rms_norm_ref(hx, np.float32(1), 1e-6)),
        (lambda: ops.rms_norm(x, None, 0.5), None, rms_norm_ref(hx, np.float32(1), 0.5)),
    ]
    for rep in range(2):
        _, m0 = stats()
        for make, out, want in cases:
            r = await make()
            got = await r.to_host()
            if out is not None:
                assert r is out
            else:
                assert got.dtype == np.asarray(want).dtype
            np.testing.assert_allclose(got, want, rtol=1e-5)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
        # every case is its own entry: built once on the first round, replayed on the second
        assert stats()[1] == m0 + (len(cases) if rep == 0 else 0)


@pytest.mark.faults_device
async def test_after_a_reset_ops_work_and_rebuild(dev: trio_cuda.Device) -> None:
    hx = f32(16)
    x = await api.from_host(hx)
    out = await api.zeros((16,))
    for _ in range(3):
        await ops.add(x, x, out=out)
    made = ops.add(x, x, out=out)  # found a recipe; awaited after the reset
    await trio.to_thread.run_sync(dev.reset)
    for op in (made, ops.add(x, x, out=out)):
        with pytest.raises(ValueError, match="reset"):
            await op
    x = await api.from_host(hx)
    out = await api.zeros((16,))
    _, m0 = stats()
    for _ in range(3):
        np.testing.assert_allclose(await ops.add(x, x, out=out).to_host(), 2 * hx)
        np.testing.assert_allclose(await ops.rms_norm(x, None, 1e-6).to_host(), rms_norm_ref(hx, np.float32(1), 1e-6), rtol=1e-5)
    assert stats()[1] == m0 + 2


async def test_bad_input_raises_the_same_after_a_good_call() -> None:
    a = await api.from_host(f32(4, 8))
    b = await api.from_host(f32(8))
    q = await api.zeros((4,))
    bad_q = await api.zeros((5,))
    a64 = await api.from_host(f32(4, 8).astype(np.float64))
    for _ in range(3):
        await ops.matmul(a, b, out=q)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"out= has shape \(5,\)"):
            ops.matmul(a, b, out=bad_q)
        with pytest.raises(TypeError, match="dtypes"):
            ops.matmul(a64, b)
        with pytest.raises(ValueError, match="do not align"):
            ops.matmul(b, a)
        # an op input: checked when the submission is planned, before any work
        launches = trio_cuda.device(0).statistics().launches
        with pytest.raises(ValueError, match=r"ops.add: out= has shape \(5,\), the result has shape \(4,\)"):
            await ops.add(ops.matmul(a, b), 1.0, out=bad_q)
        assert trio_cuda.device(0).statistics().launches == launches
    await ops.matmul(a, b, out=q)  # still fine


async def test_the_cache_is_bounded_and_holds_no_memory(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> None:
    monkeypatch.setattr(_core, "_CACHE_SIZE", 8)
    x = await api.from_host(f32(8))
    for i in range(40):
        await ops.add(x, float(i))
        s = ops.cache_statistics()
        assert s.max_entries == 8 and s.entries <= 8
    assert s.entries == 8  # full, and no fuller
    np.testing.assert_allclose(await ops.add(x, 1.5).to_host(), await x.to_host() + np.float32(1.5))
    # the recipes keep no tensor's memory alive
    bufs = []
    for _ in range(5):
        t = await api.zeros((256,))
        for _ in range(2):
            await ops.add(t, t, out=t)
        bufs.append(weakref.ref(t._buffer))
    del t
    gc.collect()
    assert all(b() is None for b in bufs)


async def test_replayed_ops_capture_into_graphs(dev: trio_cuda.Device) -> None:
    hx = f32(8)
    x = await api.from_host(hx)
    out = await api.zeros((8,))
    for _ in range(3):
        await ops.add(x, 1.0, out=out)
    h0, _ = stats()
    graph = ops.add(x, 1.0, out=out).then(lambda o: ops.multiply(o, 2.0, out=o)).graph()
    assert stats()[0] >= h0 + 1
    np.testing.assert_array_equal(await out.to_host(), hx + 1)  # nothing ran
    await ops.multiply(x, 0.0, out=out)
    await graph.launch()
    np.testing.assert_allclose(await out.to_host(), (hx + 1) * 2, rtol=1e-6)
    with pytest.raises(trio_cuda.GraphCaptureError):
        ops.add(x, 1.0).graph()  # allocates: refused inside a capture, also when replayed


async def test_the_constructors_key_is_the_recipe_key() -> None:
    # TensorOp's constructor keys the common call (allocated tensors, None, plain scalars)
    # at once; planning keys a call whose operand is another op's output. The two keys must
    # agree, or recipes would be missed or, worse, shared: a call the constructor keyed
    # records a recipe that the same call with an op operand replays, and calls that differ
    # in any argument record recipes of their own.
    x, y, g = await api.ones((4, 8)), await api.zeros((4, 8)), await api.ones((8,))
    v = x[1:3]  # a view: its descriptor is made on first use
    xt = x.transpose()
    cases: list[tuple[trio_cuda.Tensor, Callable[[Any], trio_cuda.DeviceOp[Any]]]] = [
        (x, lambda a: ops.add(a, y)),
        (x, lambda a: ops.add(a, 2.0, out=y)),
        (x, lambda a: ops.add(a, 2, out=y)),
        (x, lambda a: ops.add(a, True)),
        (v, lambda a: ops.multiply(a, np.float32(3.0))),  # a numpy scalar: the general way
        (x, lambda a: ops.rms_norm(a, g, 1e-5, out=y)),
        (x, lambda a: ops.rms_norm(a, None, 1e-5)),
        (x, lambda a: ops.matmul(a, xt)),
        (x, lambda a: ops.linear(a, x, None)),
        (x, lambda a: ops.sum(a, axis=1)),
    ]
    for t in (x, v):  # an op whose output is ``t`` itself, its recipe recorded
        await ops.add(t, 0.0, out=t)
    for i, (t, make) in enumerate(cases):
        h0, m0 = stats()
        await make(t)  # keyed by the constructor
        h1, m1 = stats()
        assert (h1 - h0, m1 - m0) == (0, 1), f"case {i} found another case's recipe"
        await make(ops.add(t, 0.0, out=t))  # keyed when planned
        h2, m2 = stats()
        assert (h2 - h1, m2 - m1) == (2, 0), f"case {i} with an op operand missed its recipe"


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial3.py)
# ======================================================================================
def softmax_ref(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def rms_ref(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    r = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (r * (1 if w is None else w)).astype(np.float32)


# ======================================================================================
# 1. the recipe cache
# ======================================================================================
async def test_allocating_ops_return_distinct_results_that_keep_their_values() -> None:
    hx, hy, hm = f32(4, 8), f32(4, 8), f32(8, 8)
    hw = f32(8)
    x, y, m, w = [await api.from_host(a) for a in (hx, hy, hm, hw)]
    hb = hx > 0
    b = await api.from_host(hb)
    makers = [
        ("add", lambda: ops.add(x, y), lambda: hx + hy),
        ("multiply-scalar", lambda: ops.multiply(x, 3.0), lambda: hx * np.float32(3.0)),
        ("matmul", lambda: ops.matmul(x, m), lambda: hx @ hm),
        ("linear", lambda: ops.linear(x, m), lambda: hx @ hm.T),
        ("softmax0", lambda: ops.softmax(x, axis=0), lambda: softmax_ref(hx, 0)),
        ("softmax1", lambda: ops.softmax(x, axis=1), lambda: softmax_ref(hx, 1)),
        ("sum0", lambda: ops.sum(x, axis=0), lambda: hx.sum(axis=0)),
        ("sum1", lambda: ops.sum(x, axis=1), lambda: hx.sum(axis=1)),
        ("sumall", lambda: ops.sum(x), lambda: hx.sum()),
        ("rms", lambda: ops.rms_norm(x, w, 1e-5), lambda: rms_ref(hx, hw, 1e-5)),
        ("where", lambda: ops.where(b, x, y), lambda: np.where(hb, hx, hy)),
        ("astype", lambda: ops.astype(x, np.float64), lambda: hx.astype(np.float64)),
        ("concat", lambda: ops.concatenate([x, y], axis=1), lambda: np.concatenate([hx, hy], axis=1)),
        ("stack", lambda: ops.stack([x, y], axis=0), lambda: np.stack([hx, hy])),
    ]
    for name, make, want in makers:
        results = []
        for _ in range(4):  # build, replay, prepared, prepared
            results.append(await make())
        ptrs = {r.ptr for r in results}
        assert len(ptrs) == len(results), f"{name}: results alias each other"
        for r in results:
            np.testing.assert_allclose(await r.to_host(), want(), rtol=1e-5, atol=1e-5, err_msg=name)
        # the first result must not have been overwritten by a later call's work
        await ops.negative(results[-1], out=results[-1]) if results[-1].dtype != np.bool_ else None
        np.testing.assert_allclose(await results[0].to_host(), want(), rtol=1e-5, atol=1e-5, err_msg=name)


async def test_lazy_dags_with_allocating_inner_ops_stay_right() -> None:
    hx, hy = f32(16), f32(16)
    x, y = await api.from_host(hx), await api.from_host(hy)
    outs = []
    for i in range(5):
        r = await ops.add(ops.multiply(x, 2.0), y)
        outs.append(r)
        np.testing.assert_allclose(await r.to_host(), 2 * hx + hy, rtol=1e-6)
        # the inner result's memory changes every time: a replay must not read a stale one
        r2 = await ops.add(ops.multiply(ops.add(x, float(i)), 2.0), ops.negative(y))
        np.testing.assert_allclose(await r2.to_host(), 2 * (hx + np.float32(i)) - hy, rtol=1e-5)
    assert len({o.ptr for o in outs}) == len(outs)


async def test_dag_with_out_reused_as_inner_and_outer_target() -> None:
    hx, hy = f32(16), f32(16)
    x, y = await api.from_host(hx), await api.from_host(hy)
    out = await api.zeros((16,))
    want = np.zeros(16, np.float32)
    for i in range(6):
        # out is written by the inner op and both read and written by the outer op
        await ops.add(ops.multiply(x, float(i % 2 + 1), out=out), out, out=out)
        want = (hx * np.float32(i % 2 + 1)) * 2
        np.testing.assert_allclose(await out.to_host(), want, rtol=1e-6)
        await ops.subtract(ops.add(out, y, out=out), ops.multiply(y, 1.0), out=out)
        np.testing.assert_allclose(await out.to_host(), want, rtol=1e-5, atol=1e-6)


async def test_out_aliasing_the_input_exactly_accumulates() -> None:
    x = await api.from_host(np.ones(8, np.float32))
    for i in range(1, 8):
        await ops.add(x, x, out=x)
        np.testing.assert_array_equal(await x.to_host(), np.full(8, 2.0**i, np.float32))
    s = await api.from_host(f32(4, 8))
    for _ in range(3):
        h = await s.to_host()
        await ops.softmax(s, axis=1, out=s)
        np.testing.assert_allclose(await s.to_host(), softmax_ref(h, 1), rtol=1e-5, atol=1e-6)


async def test_out_overlapping_a_shifted_input_is_like_numpy_every_time() -> None:
    h = np.arange(16, dtype=np.float32)
    x = await api.from_host(h)
    for _ in range(4):
        await ops.add(x[:-1], 1.0, out=x[1:])  # overlapping: numpy computes into a temporary
        h[1:] = h[:-1] + 1
        np.testing.assert_array_equal(await x.to_host(), h)
        await ops.multiply(x[::2], x[1::2], out=x[1::2])
        h[1::2] = h[::2] * h[1::2]
        np.testing.assert_array_equal(await x.to_host(), h)
        await ops.negative(x[::-1], out=x)  # reversed view of itself
        h[:] = -h[::-1].copy()
        np.testing.assert_array_equal(await x.to_host(), h)


async def test_views_transposes_reshapes_and_broadcasts_are_keyed_apart() -> None:
    hx = f32(4, 6)
    x = await api.from_host(hx)
    row = await api.from_host(f32(6))
    col = await api.from_host(f32(4, 1))
    hr, hc = await row.to_host(), await col.to_host()
    cases = [
        (lambda: ops.add(x, row), lambda: hx + hr),
        (lambda: ops.add(x, col), lambda: hx + hc),
        (lambda: ops.add(x.T, col.reshape(4)), lambda: hx.T + hc.reshape(4)),
        (lambda: ops.add(x.reshape(6, 4), row[:4]), lambda: hx.reshape(6, 4) + hr[:4]),
        (lambda: ops.add(x.reshape(24)[::3], 1.0), lambda: hx.reshape(24)[::3] + 1),
        (lambda: ops.add(x.reshape(24)[1::3], 1.0), lambda: hx.reshape(24)[1::3] + 1),
        (lambda: ops.add(x[:, ::-2], row[::2]), lambda: hx[:, ::-2] + hr[::2]),
        (lambda: ops.add(x[None], col), lambda: hx[None] + hc),
        (lambda: ops.matmul(x.T, x), lambda: hx.T @ hx),
        (lambda: ops.matmul(x, x.T), lambda: hx @ hx.T),
        (lambda: ops.matmul(x[:, :4].T, x[:, :4]), lambda: hx[:, :4].T @ hx[:, :4]),
        (lambda: ops.softmax(x.T, axis=0), lambda: softmax_ref(hx.T, 0)),
        (lambda: ops.softmax(x.T, axis=-1), lambda: softmax_ref(hx.T, 1)),
        (lambda: ops.sum(x.T, axis=0), lambda: hx.T.sum(axis=0)),
        (lambda: ops.sum(x, axis=(0, 1)), lambda: hx.sum()),
    ]
    for rep in range(3):
        for i, (make, want) in enumerate(cases):
            np.testing.assert_allclose(await make().to_host(), want(), rtol=1e-5, atol=1e-5, err_msg=f"{rep}/{i}")


async def test_a_reduction_with_keepdims_and_axis_variants() -> None:
    hx = f32(3, 4, 5)
    x = await api.from_host(hx)
    for _ in range(3):
        for axis in (0, 1, 2, -1, (0, 2), (1, 2), None):
            for keep in (False, True):
                np.testing.assert_allclose(
                    await ops.sum(x, axis=axis, keepdims=keep).to_host(),
                    hx.sum(axis=axis, keepdims=keep),
                    rtol=1e-5,
                    atol=1e-5,
                )


async def test_scalars_negative_zero_nan_numpy_and_bool_are_keyed_by_value_and_type() -> None:
    hx = f32(8)
    hx[0] = 0.0
    x = await api.from_host(hx)
    xi = await api.from_host(np.arange(8, dtype=np.int32))
    nan = float("nan")
    scalars = [
        0.0,
        -0.0,
        nan,
        float("nan"),
        np.float32(2.5),
        np.float64(2.5),
        2.5,
        True,
        1,
        False,
        0,
        np.int8(-3),
        np.bool_(True),
    ]
    for _ in range(3):
        for s in scalars:
            got = await ops.multiply(x, s).to_host()
            want = np.multiply(hx, s)
            assert got.dtype == want.dtype, (s, got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
            got_i = await ops.add(xi, s).to_host()
            want_i = np.add(np.arange(8, dtype=np.int32), s)
            assert got_i.dtype == want_i.dtype, (s, got_i.dtype, want_i.dtype)
            np.testing.assert_array_equal(got_i, want_i)


async def test_where_with_scalar_conditions_and_branches() -> None:
    hx, hy = f32(8), f32(8)
    x, y = await api.from_host(hx), await api.from_host(hy)
    for _ in range(3):
        for c in (True, False, 1, 0, 0.0, -0.0, np.bool_(False), np.float32(-0.0)):
            np.testing.assert_array_equal(await ops.where(c, x, y).to_host(), np.where(c, hx, hy))
            np.testing.assert_array_equal(await ops.where(c, x, -0.0).to_host(), np.where(c, hx, np.float32(-0.0)))


async def test_dtype_changes_of_the_same_memory_are_keyed_apart() -> None:
    h = np.abs(f32(8))  # a negative float cast to uint8 is undefined (numpy wraps, GPUs saturate)
    x = await api.from_host(h)
    out64 = await api.zeros((8,), np.float64)
    out16 = await api.zeros((8,), np.float16)
    outi = await api.zeros((8,), np.int32)
    for _ in range(3):
        with pytest.raises(TypeError, match="same_kind"):
            ops.add(x, 1.5, out=outi)
        for o in (out64, out16):
            await ops.add(x, 1.5, out=o)
            np.testing.assert_array_equal(await o.to_host(), (h + np.float32(1.5)).astype(o.dtype))
        for dt in (np.float64, np.float16, np.int32, np.int64, np.bool_, np.uint8):
            np.testing.assert_array_equal(await ops.astype(x, dt).to_host(), h.astype(dt))


@pytest.mark.sim_only
async def test_freed_and_reallocated_at_the_same_address_with_another_layout(dev: trio_cuda.Device) -> None:
    drv = dev._driver
    a = await api.from_host(np.arange(16, dtype=np.float32))
    for _ in range(3):
        r = await ops.softmax(a.reshape(4, 4), axis=1)
        np.testing.assert_allclose(await r.to_host(), softmax_ref(np.arange(16, dtype=np.float32).reshape(4, 4), 1), rtol=1e-5)
        await ops.sum(a.reshape(4, 4), axis=0)
    ptr = a.ptr
    del a, r
    gc.collect()
    await api.zeros((1,))
    await trio.to_thread.run_sync(dev.synchronize)
    assert drv._alloc_at(ptr) is None
    saved = drv._next
    drv._next = ptr
    try:
        hb = f32(16)
        b = await api.from_host(hb)
    finally:
        drv._next = saved
    assert b.ptr == ptr
    for _ in range(3):
        np.testing.assert_allclose(
            await ops.softmax(b.reshape(4, 4), axis=1).to_host(), softmax_ref(hb.reshape(4, 4), 1), rtol=1e-5
        )
        np.testing.assert_allclose(
            await ops.sum(b.reshape(4, 4), axis=0).to_host(), hb.reshape(4, 4).sum(0), rtol=1e-5, atol=1e-5
        )


@pytest.mark.faults_device
async def test_after_a_reset_new_tensors_at_old_addresses_compute_right(dev: trio_cuda.Device) -> None:
    hx = f32(32)
    x = await api.from_host(hx)
    out = await api.zeros((32,))
    for _ in range(3):
        await ops.multiply(x, 2.0, out=out)
        await ops.softmax(x)
    old = (x.ptr, out.ptr)
    await trio.to_thread.run_sync(dev.reset)
    hy = f32(32)
    y = await api.from_host(hy)
    out2 = await api.zeros((32,))
    for _ in range(3):
        np.testing.assert_allclose(await ops.multiply(y, 2.0, out=out2).to_host(), hy * 2)
        np.testing.assert_allclose(await ops.softmax(y).to_host(), softmax_ref(hy, 0), rtol=1e-5)
    # old tensors still refuse
    with pytest.raises(ValueError, match="reset"):
        await ops.multiply(x, 2.0, out=out)
    del old


async def test_graph_capture_of_a_cached_op_replays_on_changed_inputs(dev: trio_cuda.Device) -> None:
    hx = f32(16)
    x = await api.from_host(hx)
    y = await api.zeros((16,))
    s = await api.zeros(())
    for _ in range(3):  # fully warm: recipe with prepared launch
        await ops.multiply(x, 3.0, out=y)
        await ops.sum(y, out=s)
    graph = ops.multiply(x, 3.0, out=y).then(lambda o: ops.sum(o, out=s)).graph()
    for _ in range(3):
        hn = f32(16)
        await ops.add(await api.from_host(hn), 0.0, out=x)  # new inputs in the same memory
        await graph.launch()
        np.testing.assert_allclose(await y.to_host(), hn * 3, rtol=1e-6)
        np.testing.assert_allclose(await s.to_host(), (hn * 3).sum(), rtol=1e-4, atol=1e-4)
        # the cached op outside the graph, between replays, still right
        await ops.multiply(x, 3.0, out=y)
        np.testing.assert_allclose(await y.to_host(), hn * 3, rtol=1e-6)


async def test_recipe_first_recorded_inside_a_capture_then_used_outside(dev: trio_cuda.Device) -> None:
    hx = f32(16)
    x = await api.from_host(hx)
    y = await api.zeros((16,))
    graph = ops.multiply(x, 7.0, out=y).graph()  # the first build of this key: in a capture
    np.testing.assert_array_equal(await y.to_host(), np.zeros(16, np.float32))
    for _ in range(3):
        await ops.multiply(x, 7.0, out=y)
        np.testing.assert_allclose(await y.to_host(), hx * 7, rtol=1e-6)
        await ops.multiply(y, 0.0, out=y)
    await graph.launch()
    np.testing.assert_allclose(await y.to_host(), hx * 7, rtol=1e-6)


async def test_cached_op_on_another_stream_waits_for_the_writer() -> None:
    dev = trio_cuda.current_device()
    s1, s2 = dev.create_stream(), dev.create_stream()
    hx = f32(64)
    x = await api.from_host(hx)
    y = await api.zeros((64,))
    for _ in range(3):  # warm: recipe, prepared launch
        await lowlevel.submit(ops.add(x, 1.0, out=y), s2)
    await trio.to_thread.run_sync(dev.synchronize)
    for k in range(3):
        c = await counter()
        # s1: a slow op, then x *= 2
        slow = await lowlevel.submit(sleep(c, 30_000_000).then(lambda _: ops.multiply(x, 2.0, out=x)), s1)
        # s2: the cached y = x + 1 must wait for s1's write of x
        after = await lowlevel.submit(ops.add(x, 1.0, out=y), s2)
        await after.wait()
        await slow.wait()
        np.testing.assert_allclose(await y.to_host(), hx * 2.0 ** (k + 1) + 1, rtol=1e-6)


async def test_cached_op_via_await_waits_for_a_slow_writer_on_another_stream() -> None:
    dev = trio_cuda.current_device()
    s1 = dev.create_stream()
    hx = f32(64)
    x = await api.from_host(hx)
    y = await api.zeros((64,))
    for _ in range(6):  # warm over the policy's streams
        await ops.add(x, 1.0, out=y)
    for k in range(3):
        c = await counter()
        slow = await lowlevel.submit(sleep(c, 30_000_000).then(lambda _: ops.multiply(x, 2.0, out=x)), s1)
        await ops.add(x, 1.0, out=y)  # the fast path (TensorOp._submit_now)
        np.testing.assert_allclose(await y.to_host(), hx * 2.0 ** (k + 1) + 1, rtol=1e-6)
        await slow.wait()


async def test_cached_op_reading_then_writer_on_another_stream_waits_for_the_reader() -> None:
    # write-after-read: the slow reader on s1 must see the old value
    dev = trio_cuda.current_device()
    s1, s2 = dev.create_stream(), dev.create_stream()
    hx = f32(64)
    x = await api.from_host(hx)
    y = await api.zeros((64,))
    for _ in range(3):
        await lowlevel.submit(ops.multiply(x, 1.0, out=x), s2)
    c = await counter()
    reader = await lowlevel.submit(sleep(c, 30_000_000).then(lambda _: ops.add(x, 0.0, out=y)), s1)
    writer = await lowlevel.submit(ops.multiply(x, 1.0, out=x), s2)
    await writer.wait()
    writer2 = await lowlevel.submit(ops.add(x, 5.0, out=x), s2)
    await writer2.wait()
    await reader.wait()
    np.testing.assert_allclose(await y.to_host(), hx, rtol=1e-6)
    np.testing.assert_allclose(await x.to_host(), hx + 5, rtol=1e-6)


@needs_devices(2)
async def test_the_same_op_on_two_devices() -> None:
    hx = f32(16)
    x0 = await api.from_host(hx)
    with trio_cuda.use_device(1):
        x1 = await api.from_host(hx * 10)
        o1 = await api.zeros((16,))
    o0 = await api.zeros((16,))
    for _ in range(3):
        np.testing.assert_allclose(await ops.add(x0, 1.0, out=o0).to_host(), hx + 1)
        with trio_cuda.use_device(1):
            np.testing.assert_allclose(await ops.add(x1, 1.0, out=o1).to_host(), hx * 10 + 1, rtol=1e-6)
            r = await ops.softmax(x1)
            assert r.device.ordinal == 1
            np.testing.assert_allclose(await r.to_host(), softmax_ref(hx * 10, 0), rtol=1e-5, atol=1e-7)
        # device 1's tensors awaited from device 0's context
        np.testing.assert_allclose(await ops.add(x1, 1.0, out=o1).to_host(), hx * 10 + 1, rtol=1e-6)
        r = await ops.softmax(x1)
        assert r.device.ordinal == 1
        # a stream of the wrong device: the same error every time
        s0 = trio_cuda.device(0).create_stream()
        done = await lowlevel.submit(ops.add(x1, 2.0, out=o1), s0)
        await done.wait()
        np.testing.assert_allclose(await o1.to_host(), hx * 10 + 2, rtol=1e-6)


def test_threads_calling_the_same_cached_op_with_sync() -> None:
    hx, hy = f32(128), f32(128)

    async def setup():  # type: ignore[no-untyped-def]
        return await api.from_host(hx), await api.from_host(hy), [await api.zeros((128,)) for _ in range(8)]

    x, y, outs = trio.run(setup)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for j in range(60):
                ops.add(x, y, out=outs[i]).sync()
                r = ops.multiply(x, float(i)).sync()
                got = r.to_host().sync()
                if not np.array_equal(got, hx * np.float32(i)):
                    raise AssertionError(f"thread {i} iteration {j}: wrong multiply")
                got = ops.softmax(y).sync().to_host().sync()
                np.testing.assert_allclose(got, softmax_ref(hy, 0), rtol=1e-5, atol=1e-7)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for o in outs:
        np.testing.assert_array_equal(o.to_host().sync(), hx + hy)


async def test_concurrent_tasks_on_the_same_ops() -> None:
    hx = f32(64)
    x = await api.from_host(hx)
    results: dict[int, list[np.ndarray]] = {}

    async def task(i: int) -> None:
        acc = await api.zeros((64,))
        got = []
        for _j in range(20):
            await ops.add(acc, x, out=acc)
            r = await ops.multiply(acc, 0.5)
            got.append(await r.to_host())
        results[i] = got

    async with trio.open_nursery() as n:
        for i in range(6):
            n.start_soon(task, i)
    for i, got in results.items():
        for j, g in enumerate(got):
            np.testing.assert_allclose(g, hx * (j + 1) * 0.5, rtol=1e-5, err_msg=f"task {i} step {j}")


async def test_eviction_under_many_distinct_calls_keeps_results_right() -> None:
    hx = f32(8)
    x = await api.from_host(hx)
    out = await api.zeros((8,))
    for _rnd in range(2):
        for i in range(1100):
            if i % 97 == 0:
                np.testing.assert_allclose(await ops.add(x, float(i), out=out).to_host(), hx + np.float32(i), rtol=1e-6)
            else:
                ops.add(x, float(i), out=out)  # constructed only: keyed lookups, no work
                await ops.add(x, float(i), out=out)
        s = ops.cache_statistics()
        assert s.entries <= s.max_entries
        # the oldest were evicted: these rebuild, and are right
        for i in (0, 1, 2, 1099):
            np.testing.assert_allclose(await ops.add(x, float(i), out=out).to_host(), hx + np.float32(i), rtol=1e-6)


async def test_gc_of_tensors_with_cached_recipes_then_reuse_of_memory(dev: trio_cuda.Device) -> None:
    for k in range(30):
        hx = np.full(64, float(k), np.float32)
        x = await api.from_host(hx)
        y = await ops.add(x, 1.0)
        y2 = await ops.add(x, 1.0)
        z = await ops.softmax(y)
        z2 = await ops.softmax(y2)
        np.testing.assert_allclose(await y.to_host(), hx + 1)
        np.testing.assert_allclose(await z2.to_host(), np.full(64, 1 / 64, np.float32), rtol=1e-5)
        np.testing.assert_allclose(await z.to_host(), np.full(64, 1 / 64, np.float32), rtol=1e-5)
        del x, y, y2, z, z2
        gc.collect()


async def test_output_fed_back_as_input_of_the_same_op() -> None:
    hx = np.ones(8, np.float32)
    r = await api.from_host(hx)
    first = r
    for i in range(1, 10):
        r = await ops.add(r, r)
        np.testing.assert_array_equal(await r.to_host(), np.full(8, 2.0**i, np.float32))
    np.testing.assert_array_equal(await first.to_host(), hx)
    m = await api.from_host(np.eye(4, dtype=np.float32) * 2)
    p = m
    for i in range(1, 5):
        p = await ops.matmul(p, m)
        np.testing.assert_array_equal(await p.to_host(), np.eye(4, dtype=np.float32) * 2.0 ** (i + 1))


async def test_bad_calls_after_good_ones_raise_the_same() -> None:
    x = await api.from_host(f32(4, 8))
    bad_out = await api.zeros((4, 7))
    for _ in range(3):
        await ops.softmax(x, axis=1)
        await ops.sum(x, axis=1)
    for _ in range(3):
        with pytest.raises((ValueError, IndexError, np.exceptions.AxisError)):  # type: ignore[attr-defined]
            await ops.softmax(x, axis=2)
        with pytest.raises(ValueError):
            await ops.softmax(x, axis=1, out=bad_out)
        with pytest.raises(ValueError):
            await ops.add(ops.sum(x, axis=1), 1.0, out=bad_out)
        # a good op input whose value is cached, outer bad: error before anything runs
        with pytest.raises(ValueError):
            await ops.add(ops.softmax(x, axis=1), x[:, :3])


async def test_a_cached_op_object_awaited_twice_is_refused_like_an_uncached_one() -> None:
    x = await api.from_host(f32(8))
    out = await api.zeros((8,))
    for _ in range(3):
        await ops.add(x, 1.0, out=out)
    op = ops.add(x, 1.0, out=out)
    await op
    with pytest.raises(Exception) as hit_err:
        await op
    fresh_op = ops.add(x, 123.0, out=out)  # a new key: no recipe
    await fresh_op
    with pytest.raises(Exception) as miss_err:
        await fresh_op
    assert type(hit_err.value) is type(miss_err.value)


async def test_untracked_views_and_tracked_views_order_the_same() -> None:
    hx = f32(32)
    x = await api.from_host(hx)
    y = await api.zeros((32,))
    for _ in range(3):
        await ops.add(x.untracked(), 1.0, out=y)
        await ops.add(x, 1.0, out=y)
    np.testing.assert_allclose(await y.to_host(), hx + 1)


async def test_shared_cached_op_used_twice_in_one_dag() -> None:
    hx = f32(8)
    x = await api.from_host(hx)
    out = await api.zeros((8,))
    for _ in range(3):
        sh = ops.multiply(x, 2.0).shared()
        r = await ops.add(sh, sh, out=out)
        np.testing.assert_allclose(await r.to_host(), hx * 4, rtol=1e-6)
