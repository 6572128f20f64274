"""The kernel launcher and the library kernels."""

from __future__ import annotations

import enum
import gc
import math

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api
from trio_cuda.kernels import add, saxpy, sleep

from numba import cuda

from ..helpers.devices import ON_CUDA, needs_devices, settle, snapshot


@trio_cuda.kernel
def block_ids(out):  # type: ignore[no-untyped-def]
    i, j = cuda.grid(2)
    out[i, j] = cuda.blockIdx.x * 1000 + cuda.blockIdx.y * 100 + cuda.threadIdx.x * 10 + cuda.threadIdx.y


@trio_cuda.kernel(block=(2,))
def fill_rows(out, v):  # type: ignore[no-untyped-def]
    row = cuda.blockIdx.x
    for j in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[row, j] = v


async def test_grid_is_the_tile_grid_and_block_the_tile() -> None:
    out = await block_ids(api.zeros((4, 6), np.int32).partition((2, 3))).first().to_host()
    i, j = np.indices((4, 6))
    expected = (i // 2) * 1000 + (j // 3) * 100 + (i % 2) * 10 + (j % 3)
    np.testing.assert_array_equal(out, expected)


async def test_fixed_block_shape() -> None:
    out = await fill_rows(api.zeros((3, 5)).partition((1, 5)), np.float32(4.0)).first().to_host()
    np.testing.assert_array_equal(out, np.full((3, 5), 4.0, np.float32))


async def test_output_is_the_tuple_of_arguments() -> None:
    x = await api.ones((4,))
    y = await api.ones((4,))
    out = await add(api.zeros((4,)).partition((2,)), x, y)
    assert isinstance(out, tuple) and len(out) == 3
    assert isinstance(out[0], trio_cuda.Partition) and out[1] is x and out[2] is y


@pytest.mark.parametrize("shape,tile", [((8,), (4,)), ((4, 6), (2, 3)), ((2, 4, 2), (1, 2, 2))])
async def test_add_matches_numpy(shape: tuple[int, ...], tile: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    z = await add(api.empty(shape).partition(tile), api.from_host(a), api.from_host(b)).first().to_host()
    np.testing.assert_allclose(z, a + b, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
async def test_saxpy_matches_numpy(dtype: type) -> None:
    x = np.arange(12, dtype=dtype).reshape(3, 4)
    y = np.ones((3, 4), dtype)
    a = dtype(3)
    out = await saxpy(a, api.from_host(x), api.from_host(y).partition((1, 4))).last().to_host()
    np.testing.assert_array_equal(out, a * x + y)


def test_launcher_checks_arguments_at_construction() -> None:
    dev = trio_cuda.device(0)
    before = dev.statistics()
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        add(api.zeros((4,)), api.ones((4,)))
    with pytest.raises(TypeError, match="argument 1"):
        add(api.zeros((4,)).partition((2,)), "x", api.ones((4,)))
    with pytest.raises(TypeError, match="argument 2"):
        add(api.zeros((4,)).partition((2,)), api.ones((4,)), np.ones(4))
    assert dev.statistics() == before


def test_kernel_decorator_rejects_odd_signatures() -> None:
    with pytest.raises(TypeError, match="positional"):

        @trio_cuda.kernel
        def k(*args):  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(ValueError, match="block"):
        trio_cuda.kernel(block=(0,))(lambda x: None)
    with pytest.raises(TypeError, match="function"):
        trio_cuda.kernel(3)


async def test_launch_errors_before_any_work() -> None:
    dev = trio_cuda.device(0)
    x = await api.ones((4,))
    y = await api.ones((4, 1))
    z = await api.zeros((4,))
    before = dev.statistics()
    with pytest.raises(ValueError, match="no Partition"):
        await add(z, x, x)
    with pytest.raises(ValueError, match="shape"):
        await add(z.partition((2,)), x, y.reshape(2, 2))
    with pytest.raises(TypeError, match="dtype"):
        await add(z.partition((2,)), x, api.ones((4,), np.float64))
    with pytest.raises(ValueError, match="disagree"):
        await saxpy(1.0, z.partition((4,)), x.partition((2,)))
    with pytest.raises(TypeError, match="produced str"):
        await add(z.partition((2,)), trio_cuda.value("x"), x)
    with pytest.raises(ValueError, match="4-D tile grid"):
        await add(api.zeros((1, 1, 1, 2)).partition((1, 1, 1, 1)), api.ones((1, 1, 1, 2)), api.ones((1, 1, 1, 2)))
    after = dev.statistics()
    assert after.launches == before.launches


@trio_cuda.kernel
def _fill_index(z):  # type: ignore[no-untyped-def]
    i, j = cuda.grid(2)
    if i < z.shape[0] and j < z.shape[1]:
        z[i, j] = i * 1000 + j


@trio_cuda.kernel
def _tile_sums(out, x):  # type: ignore[no-untyped-def]
    # One thread per tile does the tile's sum: the tile is the block, its bounds are
    # blockIdx * blockDim, clipped to the shape (the last tile is partial).
    if cuda.threadIdx.x == 0:
        start = cuda.blockIdx.x * cuda.blockDim.x
        stop = min(start + cuda.blockDim.x, x.shape[0])
        s = 0.0
        for k in range(start, stop):
            s += x[k]
        for k in range(start, stop):
            out[k] = s


async def test_ragged_partitions_cover_every_element() -> None:
    # 1000 elements in tiles of 256: the last tile has 232.
    x = await api.arange(1000)
    out, _, _ = await add(api.zeros((1000,)).partition((256,)), x, x)
    np.testing.assert_array_equal(await out.to_host(), 2 * np.arange(1000, dtype=np.float32))
    # 60 x 60 in 16 x 16 tiles, and a tile of 64 x 64 (4096 threads: split into blocks).
    for tile in ((16, 16), (64, 64), (7, 60)):
        (z,) = await _fill_index(api.zeros((60, 60)).partition(tile))
        i, j = np.indices((60, 60))
        np.testing.assert_array_equal(await z.to_host(), (i * 1000 + j).astype(np.float32))


async def test_a_kernel_finds_its_tiles_bounds() -> None:
    data = np.arange(10, dtype=np.float32)
    out, _ = await _tile_sums(api.zeros((10,)).partition((4,)), api.from_host(data))
    expected = np.concatenate([np.full(4, data[0:4].sum()), np.full(4, data[4:8].sum()), np.full(2, data[8:].sum())])
    np.testing.assert_array_equal(await out.to_host(), expected)


async def test_too_large_block_is_a_launch_error() -> None:
    @trio_cuda.kernel(block=(32, 64))
    def wide(z):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < z.shape[0]:
            z[i] = 1.0

    with pytest.raises(trio_cuda.LaunchError, match="wide") as info:
        await wide(api.zeros((2048,)).partition((2048,)))
    assert info.value.device == 0


@needs_devices(2)
async def test_wrong_device_is_rejected() -> None:
    other = await api.ones((4,), device=1)
    with pytest.raises(ValueError, match="device 1"):
        await add(api.zeros((4,)).partition((2,)), other, other)


async def test_rms_norm_matches_numpy() -> None:
    from trio_cuda.kernels import rms_norm

    rng = np.random.default_rng(2)
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal((2, 40)).astype(dtype)
        w = rng.standard_normal(40).astype(dtype)
        out = (
            await rms_norm(api.empty((2, 40), dtype).partition((1, 40)), api.from_host(x), api.from_host(w), 1e-5)
            .first()
            .to_host()
        )
        x64 = x.astype(np.float64)
        ref = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5) * w
        np.testing.assert_allclose(out, ref, rtol=1e-5 if dtype == np.float32 else 1e-12)


async def test_matvec_matches_numpy() -> None:
    from trio_cuda.kernels import matvec

    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 300)).astype(np.float32)  # 300: the four-column steps and a tail
    x = rng.standard_normal(300).astype(np.float32)
    y = await matvec(api.empty((16,)).partition((8,)), api.from_host(a), api.from_host(x)).first().to_host()
    np.testing.assert_allclose(y, a.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)


async def test_decode_kernels_reject_bad_input() -> None:
    from trio_cuda.kernels import matvec, rms_norm

    a = await api.zeros((16, 40))
    x = await api.zeros((40,))
    with pytest.raises(ValueError, match="tiles of 8"):
        await matvec(api.empty((16,)).partition((4,)), a, x)
    with pytest.raises(ValueError, match="shapes do not agree"):
        await matvec(api.empty((16,)).partition((8,)), a, api.zeros((41,)))
    with pytest.raises(TypeError, match="dtype"):
        await matvec(api.empty((16,)).partition((8,)), a, api.zeros((40,), np.float64))
    with pytest.raises(ValueError, match="one row"):
        await rms_norm(api.empty((2, 40)).partition((2, 40)), api.zeros((2, 40)), x, 1e-5)
    with pytest.raises(ValueError, match="eps"):
        await rms_norm(api.empty((2, 40)).partition((1, 40)), api.zeros((2, 40)), x, 0.0)


def test_prepare_validates_and_compiles_ahead() -> None:
    x = api.ones((4,)).sync()
    z = api.zeros((4,)).sync()
    add.prepare(z.partition((2,)), x, x)
    with pytest.raises(ValueError, match="shape"):
        add.prepare(z.partition((2,)), x, api.ones((5,)).sync())
    with pytest.raises(TypeError, match="takes 3"):
        add.prepare(z.partition((2,)), x)
    with pytest.raises(ValueError, match="one device"):
        saxpy.prepare(1.0, 2.0, 3.0)
    out = add(z.partition((2,)), x, x).first().to_host().sync()
    np.testing.assert_array_equal(out, [2, 2, 2, 2])


async def test_prepare_blocks_so_it_is_refused_inside_trio() -> None:
    x = await api.ones((4,))
    with pytest.raises(RuntimeError, match="would block the trio event loop"):
        add.prepare(x.partition((2,)), x, x)
    await trio.to_thread.run_sync(add.prepare, x.partition((2,)), x, x)


def _make_scaler(k: float) -> trio_cuda.Kernel:
    @trio_cuda.kernel
    def scale(out, x):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = k * x[i]

    return scale


async def test_kernels_made_at_run_time_run_their_own_code() -> None:
    # Each factory kernel is dropped after use, so Python reuses its id for the next one;
    # compile caches keyed by id would run a dead kernel's code.
    x = await api.arange(8)
    seen_ids = set()
    for k in [2.0, 3.0, 2.0, 5.0, 7.0, 3.0, 11.0, 13.0] * 3:
        kern = _make_scaler(k)
        seen_ids.add(id(kern))
        out = await kern(api.empty((8,)).partition((8,)), x).first().to_host()
        np.testing.assert_array_equal(out, k * np.arange(8, dtype=np.float32))
        del kern
    if not ON_CUDA:
        # (On CUDA numba's compiler keeps references that delay the reuse; the results above
        # are checked all the same.)
        assert len(seen_ids) < 24, "ids were never reused: the test lost its point"


def test_content_key_covers_code_closures_and_globals() -> None:
    a, b, c = _make_scaler(2.0), _make_scaler(2.0), _make_scaler(3.0)
    assert a.key == b.key and a.key != c.key
    assert a.cacheable

    def with_global(g: float) -> trio_cuda.Kernel:
        namespace: dict[str, object] = {"cuda": cuda, "G": g}
        exec(
            "def k(out, x):\n    i = cuda.grid(1)\n    if i < out.shape[0]:\n        out[i] = G * x[i]\n",
            namespace,
        )
        return trio_cuda.kernel(namespace["k"])  # type: ignore[arg-type]

    assert with_global(1.0).key != with_global(2.0).key
    assert with_global(1.0).key == with_global(1.0).key

    class Opaque:
        pass

    def with_object(o: object) -> trio_cuda.Kernel:
        @trio_cuda.kernel
        def k(out):  # type: ignore[no-untyped-def]
            if o is None:
                out[0] = 1

        return k

    # An object that cannot be described by content: the key holds its identity (and the
    # kernel keeps it alive), and the kernel never goes to the disk cache.
    u1, u2 = with_object(Opaque()), with_object(Opaque())
    assert u1.key != u2.key and not u1.cacheable


def test_kernel_scalars_the_kernel_cannot_represent_are_refused() -> None:
    x = api.ones((4,)).sync()
    y = api.zeros((4,)).sync()
    with pytest.raises(TypeError, match="complex scalar"):
        saxpy(1 + 2j, x, y.partition((4,))).sync()
    with pytest.raises(TypeError, match="complex scalar"):
        saxpy(np.complex64(1), x, y.partition((4,))).sync()
    with pytest.raises(OverflowError, match="64-bit"):
        saxpy(2**70, x, y.partition((4,))).sync()
    np.testing.assert_array_equal(y.to_host().sync(), np.zeros(4))
    # numpy scalars are accepted wherever Python scalars are.
    out = saxpy(np.float32(2), x, y.partition((np.int64(4),))).last().to_host().sync()
    np.testing.assert_array_equal(out, np.full(4, 2.0))


def test_library_kernel_arguments_follow_numpy_scalars() -> None:
    from trio_cuda.kernels import rms_norm

    x = api.ones((2, 8)).sync()
    w = api.ones((8,)).sync()
    out = rms_norm(api.empty((2, 8)).partition((1, 8)), x, w, np.float32(1e-5)).first().to_host().sync()
    np.testing.assert_allclose(out, np.ones((2, 8)), rtol=1e-4)
    for bad in (float("nan"), float("inf"), 0.0, -1e-5):
        with pytest.raises(ValueError, match="eps"):
            rms_norm(api.empty((2, 8)).partition((1, 8)), x, w, bad).sync()
    with pytest.raises(TypeError, match="complex"):
        rms_norm(api.empty((2, 8)).partition((1, 8)), x, w, 1e-5 + 0j).sync()
    with pytest.raises(TypeError, match="argument 3"):
        rms_norm(api.empty((2, 8)).partition((1, 8)), x, w, "1e-5")
    c = api.zeros((1,), np.int32).sync()
    sleep(c.partition((1,)), np.int64(1000)).sync()
    np.testing.assert_array_equal(c.to_host().sync(), [1])


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial.py)
# ======================================================================================
@trio_cuda.kernel(block=(64, 64))  # 4096 threads: more than a block can have
def set_one_too_wide(z):  # type: ignore[no-untyped-def]
    i, j = cuda.grid(2)
    if i < z.shape[0] and j < z.shape[1]:
        z[i, j] = 1.0


@trio_cuda.kernel
def sign_of(z, a):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < z.shape[0]:
        z[i] = math.copysign(1.0, a)


# -- kernels ---------------------------------------------------------------------------
def _make_enum_kernel(c: int) -> trio_cuda.Kernel:
    class Scale(enum.IntEnum):  # a local class: the same qualified name on every call
        VALUE = c

    @trio_cuda.kernel
    def fill(z):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < z.shape[0]:
            z[i] = Scale.VALUE

    return fill


async def test_kernels_reading_a_local_enum_run_their_own_code() -> None:
    # repro_kernel_identity_local_class: the fingerprint hashed classes by module and
    # qualified name only, so every kernel after the first ran the first one's code.
    for c in range(1, 6):
        k = _make_enum_kernel(c)
        out = await k(api.zeros((4,), np.int32).partition((4,))).first().to_host()
        np.testing.assert_array_equal(out, [c] * 4, err_msg=f"the kernel made with {c} ran another kernel's code")
        del k
        gc.collect()


async def test_a_negative_zero_scalar_reaches_the_kernel_as_negative_zero() -> None:
    # repro_kernel_scalar_negative_zero: the prepared-launch cache keyed scalars by
    # (type, value), and -0.0 == 0.0, so a launch with -0.0 reused the parameters of 0.0.
    z = await api.zeros((4,))
    for a, sign in [(0.0, 1.0), (-0.0, -1.0), (0.0, 1.0), (-0.0, -1.0)]:
        out = await sign_of(z.partition((4,)), a).first().to_host()
        np.testing.assert_array_equal(out, [sign] * 4, err_msg=f"the launch with a={a!r} ran with another scalar")
    fresh = await api.zeros((4,))
    np.testing.assert_array_equal(await sign_of(fresh.partition((4,)), -0.0).first().to_host(), [-1.0] * 4)


async def test_a_launch_config_error_late_in_a_dag_means_nothing_of_it_ran(dev: trio_cuda.Device) -> None:
    # repro_launch_error_half_run: a DAG whose kernel has an invalid block (64x64:
    # 4096 threads) must run nothing; the fill of x before the launch had run.
    x = await api.zeros((4,))
    big = await api.zeros((64, 64))
    await trio.to_thread.run_sync(settle)
    before = snapshot(dev)
    dag = trio_cuda.zip(api.memcpy(x, np.full(4, 7.0, np.float32)), set_one_too_wide(big.partition((64, 64))))
    with pytest.raises(trio_cuda.LaunchError, match="threads per block"):
        await dag
    await trio.to_thread.run_sync(settle)
    assert snapshot(dev) == before
    np.testing.assert_array_equal(await x.to_host(), np.zeros(4, np.float32))
    assert not dev.is_faulted
