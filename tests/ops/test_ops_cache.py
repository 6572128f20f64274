"""The ops' recipe cache (trio_cuda._ops._core): a repeated op on the same tensors skips
its checks and build, and must still compute the right thing, raise the same errors,
forget what a reset or a freed buffer invalidates, and stay bounded."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, ops
from trio_cuda._ops import _core

RNG = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return RNG.uniform(-2, 2, shape).astype(np.float32)


def stats() -> tuple[int, int]:
    s = _core.cache_statistics()
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
        assert _core.cache_statistics().entries <= 8
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
    # at once, and the key must be _op_key's, or recipes would be missed or, worse, shared.
    x, y, g = await api.ones((4, 8)), await api.zeros((4, 8)), await api.ones((8,))
    v = x[1:3]  # a view: its descriptor is made on first use
    cases = [
        ops.add(x, y),
        ops.add(x, 2.0, out=y),
        ops.add(x, 2, out=y),
        ops.add(x, True),
        ops.multiply(v, np.float32(3.0)),  # a numpy scalar: the general way
        ops.rms_norm(x, g, 1e-5, out=y),
        ops.rms_norm(x, None, 1e-5),
        ops.matmul(x, x.transpose()),
        ops.linear(x, x, None),
        ops.sum(x, axis=1),
    ]
    for op in cases:
        assert op._key is not None, op
        assert op._key == _core._op_key(op, op._args), op
    # and calls that differ in any argument get different keys
    keys = {op._key for op in cases}
    assert len(keys) == len(cases)
