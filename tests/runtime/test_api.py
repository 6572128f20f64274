"""Tensor constructors, copies, dup, partitions and reshapes."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api

from ..helpers.devices import needs_devices

REQUIRED = [np.float16, np.float32, np.float64, np.int32, np.int64]
OTHERS = [np.bool_, np.int8, np.uint8, np.uint16, np.uint32, np.uint64, np.int16, np.complex64, np.complex128]
SHAPES = [(), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2)]


@pytest.mark.parametrize("dtype", REQUIRED + OTHERS)
async def test_constructors_every_dtype(dtype: type) -> None:
    shape = (3, 4)
    np.testing.assert_array_equal(await api.zeros(shape, dtype).to_host(), np.zeros(shape, dtype))
    np.testing.assert_array_equal(await api.ones(shape, dtype).to_host(), np.ones(shape, dtype))
    fill = True if dtype is np.bool_ else 3
    np.testing.assert_array_equal(await api.full(shape, fill, dtype).to_host(), np.full(shape, fill, dtype))
    if dtype is not np.bool_:
        np.testing.assert_array_equal(await api.arange(12, dtype=dtype).to_host(), np.arange(12, dtype=dtype))
    rng = np.random.default_rng(1)
    host = (rng.standard_normal(shape) * 50).astype(dtype)
    back = await api.from_host(host).to_host()
    assert back.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back, host)
    t = await api.empty(shape, dtype)
    assert (t.shape, t.dtype) == (shape, np.dtype(dtype))


@pytest.mark.parametrize("shape", SHAPES)
async def test_any_rank(shape: tuple[int, ...]) -> None:
    host = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    t = await api.from_host(host)
    assert t.shape == shape and t.ndim == len(shape) and t.size == host.size
    np.testing.assert_array_equal(await t.to_host(), host)
    np.testing.assert_array_equal(await api.full(shape, -2.5, np.float64).to_host(), np.full(shape, -2.5))


async def test_full_values_needing_wide_patterns() -> None:
    for dtype, v in [(np.float64, 1.5), (np.int64, -(2**40) + 3), (np.complex128, 1 + 2j), (np.float16, 0.1)]:
        np.testing.assert_array_equal(await api.full((7,), v, dtype).to_host(), np.full(7, v, dtype))


async def test_zero_size_tensors() -> None:
    t = await api.zeros((0, 3))
    assert t.size == 0 and t.nbytes == 0
    assert (await t.to_host()).shape == (0, 3)


async def test_from_host_snapshots_at_submission() -> None:
    host = np.arange(4, dtype=np.int64)
    op = api.from_host(host)
    host[:] = 7  # before submission: the copy sees this
    t = await op
    host[:] = -1  # after submission: the copy does not
    np.testing.assert_array_equal(await t.to_host(), [7, 7, 7, 7])


def test_bad_constructor_arguments_fail_before_any_work() -> None:
    dev = trio_cuda.device(0)
    before = dev.statistics()
    with pytest.raises(ValueError, match="negative"):
        api.zeros((2, -1))
    with pytest.raises(TypeError, match="ints"):
        api.ones((2.5, 3))
    with pytest.raises(TypeError, match="unsupported dtype"):
        api.zeros((2,), np.dtype("U3"))
    with pytest.raises(TypeError, match="not a dtype"):
        api.zeros((2,), "float33")
    with pytest.raises(TypeError, match="numpy array"):
        api.from_host({"a": 1})
    with pytest.raises(TypeError, match="unsupported dtype"):
        api.from_host(np.array(["a"]))
    with pytest.raises(ValueError, match="step"):
        api.arange(0, 4, 0)
    with pytest.raises(ValueError, match="cannot fill"):
        api.full((2,), "x", np.float32)
    with pytest.raises(ValueError, match="no device 99"):
        api.zeros((2,), device=99)
    assert dev.statistics() == before


async def test_memcpy_device_to_device() -> None:
    src = await api.arange(6, dtype=np.int32)
    dst = await api.zeros((6,), np.int32)
    out = await api.memcpy(dst, src)
    assert out is dst
    np.testing.assert_array_equal(await dst.to_host(), np.arange(6))


async def test_memcpy_host_to_device_and_back() -> None:
    dst = await api.zeros((2, 3), np.float64)
    data = np.arange(6, dtype=np.float64).reshape(2, 3)
    await api.memcpy(dst, data)
    out = np.empty((2, 3), np.float64)
    res = await api.memcpy(out, dst)
    assert res is out
    np.testing.assert_array_equal(out, data)


async def test_memcpy_accepts_ops_and_partitions() -> None:
    out = await api.memcpy(api.zeros((4,)).partition((2,)), api.arange(4)).to_host()
    np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32))


async def test_memcpy_mismatch_is_rejected_before_any_work() -> None:
    dev = trio_cuda.device(0)
    a = await api.zeros((4,), np.float32)
    b = await api.zeros((5,), np.float32)
    c = await api.zeros((4,), np.float64)
    before = dev.statistics()
    with pytest.raises(ValueError, match="shape mismatch"):
        api.memcpy(a, b)
    with pytest.raises(TypeError, match="dtype mismatch"):
        api.memcpy(a, c)
    with pytest.raises(TypeError, match="dtype mismatch"):
        api.memcpy(a, np.zeros(4, np.float64))
    with pytest.raises(TypeError, match="two host arrays"):
        api.memcpy(np.zeros(2), np.zeros(2))
    with pytest.raises(TypeError, match="Tensor, a numpy array"):
        api.memcpy(a, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        api.memcpy(ro, a)
    assert dev.statistics() == before
    # An op whose output only turns out wrong at run time fails before its own copy.
    with pytest.raises(ValueError, match="shape mismatch"):
        await api.memcpy(a, api.zeros((3,)))


async def test_dup_same_device() -> None:
    t = await api.arange(5)
    d = await api.dup(t)
    assert d is not t and d.ptr != t.ptr and d.device is t.device
    np.testing.assert_array_equal(await d.to_host(), np.arange(5, dtype=np.float32))
    with pytest.raises(TypeError):
        api.dup(np.zeros(3))


@needs_devices(2)
async def test_dup_to_another_device() -> None:
    t = await api.arange(5)
    d = await api.dup(t, device=1)
    assert d.device is trio_cuda.device(1)
    np.testing.assert_array_equal(await d.to_host(), np.arange(5, dtype=np.float32))
    back = await api.dup(api.dup(t, device=1), device=0)
    assert back.device is trio_cuda.device(0)
    np.testing.assert_array_equal(await back.to_host(), np.arange(5, dtype=np.float32))


async def test_partition_and_unpartition() -> None:
    t = await api.arange(24).reshape(4, 6)
    p = t.partition((2, 3))
    assert isinstance(p, trio_cuda.Partition)
    assert p.grid == (2, 2) and p.tile_shape == (2, 3) and p.shape == (4, 6)
    assert p.unpartition() is t
    np.testing.assert_array_equal(await p.to_host(), np.arange(24, dtype=np.float32).reshape(4, 6))
    p2 = await api.arange(24).reshape(4, 6).partition((4, 1))
    assert p2.grid == (1, 6)
    np.testing.assert_array_equal(await trio_cuda.value(p2).unpartition().to_host(), np.arange(24).reshape(4, 6))


async def test_bad_partitions() -> None:
    t = await api.zeros((4, 6))
    assert t.partition((3, 4)).grid == (2, 2)  # ragged: edge tiles are partial
    with pytest.raises(ValueError, match="dims"):
        t.partition((2,))
    with pytest.raises(ValueError, match="positive"):
        t.partition((0, 3))
    assert (await api.zeros((5,)).partition((2,))).grid == (3,)
    # one dimension (its own path): ragged, exact, larger than the tensor, zero, empty
    v = await api.zeros((7,))
    assert [v.partition(n).grid for n in (2, 7, 1, 9)] == [(4,), (1,), (7,), (1,)]
    assert (await api.zeros((0,))).partition((3,)).grid == (0,)
    with pytest.raises(ValueError, match="positive"):
        v.partition((0,))
    with pytest.raises(ValueError, match="dims"):
        v.partition((1, 1))
    assert not hasattr(trio_cuda.value(3), "partition")  # known to be no tensor
    with pytest.raises(TypeError, match="tensor or partition"):  # known only once planned
        await trio_cuda.value(3).map(lambda v: v).partition((1,))


async def test_reshape() -> None:
    t = await api.arange(12)
    r = t.reshape(3, -1)
    assert r.shape == (3, 4) and r.ptr == t.ptr
    assert t.reshape((2, 6)).shape == (2, 6)
    with pytest.raises(ValueError, match="cannot reshape"):
        t.reshape(5, -1)
    with pytest.raises(ValueError, match="cannot reshape"):
        t.reshape(5, 2)
    with pytest.raises(ValueError, match="one dimension"):
        t.reshape(-1, -1)
    np.testing.assert_array_equal(await api.arange(6).reshape(2, 3).to_host(), np.arange(6).reshape(2, 3))


def test_direct_construction_is_refused() -> None:
    with pytest.raises(TypeError, match="api"):
        trio_cuda.Tensor()
    with pytest.raises(TypeError, match="partition"):
        trio_cuda.Partition()
    with pytest.raises(TypeError, match="create_stream"):
        trio_cuda.Stream()
    with pytest.raises(TypeError, match="device"):
        trio_cuda.Device()


async def test_staging_memory_is_recycled_across_streams(dev: trio_cuda.Device) -> None:
    # Copies on many short-lived streams must not pin new host memory for ever: their
    # staging buffers return to the pool once the copies are done.
    await api.ones((1,)).to_host()  # the first copy pins the device's initial staging set
    before = dev.statistics()
    for i in range(100):
        policy = trio_cuda.SingleStream(dev)
        np.testing.assert_array_equal(await api.full((4,), float(i)).to_host().schedule(policy), np.full(4, float(i)))
        await api.from_host(np.full(4, float(i), np.float32)).schedule(policy)
    after = dev.statistics()
    assert after.staging_pins - before.staging_pins < 10, "new pinned allocations for 200 small copies"
    assert after.staging_bytes <= before.staging_bytes + (1 << 20)


async def test_an_op_given_to_start_soon_says_how_to_run_it_in_a_nursery() -> None:
    op = api.full((4,), 2.0)
    hint = r"not a function \(nor an async function\).*nursery\.start_soon\(run, op\) with 'async def run\(op\): return await op'"
    async with trio.open_nursery() as nursery:
        with pytest.raises(TypeError, match=hint):
            nursery.start_soon(op)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=hint):
            await nursery.start(op)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=hint):
            nursery.start_soon(op.schedule())  # type: ignore[arg-type]

        async def run(op: trio_cuda.DeviceOp[trio_cuda.Tensor]) -> None:
            assert (await op.to_host() == 2.0).all()

        nursery.start_soon(run, op)  # the op was not consumed by the refused calls
    with pytest.raises(TypeError, match="then\\(\\) needs a callable"):
        api.zeros((2,)).then(api.zeros((2,)))
    with pytest.raises(TypeError, match="map\\(\\) needs a callable"):
        api.zeros((2,)).map(api.zeros((2,)))
