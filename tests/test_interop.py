"""Zero-copy export: DLPack (numpy on the simulated device; PyTorch and CuPy on CUDA)
and the CUDA Array Interface, ordered after pending writes, memory kept alive."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _interop, api, lowlevel, ops

from .conftest import ON_CUDA


@pytest.mark.sim_only
async def test_numpy_reads_the_simulated_devices_memory_without_a_copy() -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = await api.from_host(a)
    view = np.from_dlpack(t)
    np.testing.assert_array_equal(view, a)
    await ops.add(t, 1.0, out=t)  # the device writes: the view sees it (same memory)
    np.testing.assert_array_equal(view, a + 1)
    np.testing.assert_array_equal(np.from_dlpack(t.T[1:, ::2]), (a + 1).T[1:, ::2])  # strided views
    assert t.__dlpack_device__() == (1, 0)
    with pytest.raises(AttributeError, match="simulated"):
        t.__cuda_array_interface__  # noqa: B018
    with pytest.raises(BufferError, match="stream"):
        t.__dlpack__(stream=1)


@pytest.mark.sim_only
async def test_the_export_waits_for_the_pending_write_and_keeps_the_memory() -> None:
    x = await api.zeros((1 << 14,))
    from trio_cuda.kernels import sleep

    from .conftest import counter

    await sleep(counter(), 1000)
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    await lowlevel.submit(sleep(counter(), 50_000_000).then(lambda _, t=x: ops.add(t, 5.0, out=t)), s)  # pending
    view = np.from_dlpack(x)  # waits for the write
    assert (view == 5).all()
    alive = len(_interop._alive)
    del x
    gc.collect()
    assert (view == 5).all()  # the tensor is gone, the memory is not
    del view
    gc.collect()
    assert len(_interop._alive) < alive  # released with the last consumer


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA and PyTorch")
async def test_torch_and_the_cuda_array_interface_share_the_memory() -> None:
    torch = pytest.importorskip("torch")
    t = await api.from_host(np.arange(8, dtype=np.float32))
    tt = torch.from_dlpack(t)
    assert tt.data_ptr() == t.ptr and tt.device.type == "cuda"
    assert (tt.cpu().numpy() == np.arange(8)).all()
    cai = t.__cuda_array_interface__
    assert cai["data"][0] == t.ptr and cai["version"] == 3 and cai["shape"] == (8,)


@pytest.mark.sim_only
async def test_a_numpy_array_is_adopted_without_a_copy_and_let_go_after_use() -> None:
    import weakref

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = api.from_dlpack(a)
    assert t.shape == (3, 4) and t.dtype == np.float32
    np.testing.assert_array_equal(await (t * 2).to_host(), np.arange(12).reshape(3, 4) * 2)
    await ops.add(t, 1.0, out=t)  # the device writes the array's own memory
    np.testing.assert_array_equal(a, np.arange(12).reshape(3, 4) + 1)
    v = api.asarray(a[:, ::-2])  # a strided, reversed view
    np.testing.assert_array_equal(await v.to_host(), a[:, ::-2])
    assert api.asarray(t) is t
    owner = weakref.ref(a)
    del a, v
    gc.collect()
    assert owner() is not None  # the tensor keeps the array alive
    del t
    gc.collect()
    dev = trio_cuda.current_device()
    await api.zeros((1,))  # the next submission queues the release after the accesses
    await trio.to_thread.run_sync(dev.synchronize)  # completes them and retires the release
    gc.collect()
    assert owner() is None


@pytest.mark.sim_only
async def test_adoption_refuses_what_it_cannot_take() -> None:
    with pytest.raises(TypeError, match="__dlpack__"):
        api.from_dlpack([1, 2, 3])
    with pytest.raises(TypeError, match="not supported"):
        api.from_dlpack(np.zeros(3, np.complex64))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA and PyTorch")
async def test_a_torch_tensor_is_adopted_and_ordered_after_its_stream() -> None:
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.full((1 << 20,), 2.0, device="cuda")
        torch.cuda._sleep(10_000_000)  # a long kernel on the producer's stream
        x.mul_(3.0)
        # (DLPack orders the consumer after the producer's current stream: s here; after
        # the block PyTorch's current stream is its default one, which s does not order)
        t = api.from_dlpack(x)
    assert t.ptr == x.data_ptr()
    got = await (t + 1).to_host()  # ordered after the producer's work on its stream
    assert (got == 7.0).all()


# -- found by an adversarial review -------------------------------------------------------------
@pytest.mark.sim_only
async def test_adopted_memory_outlives_a_reset_while_a_kernel_still_writes_it() -> None:
    """A reset while a kernel writes adopted memory: the simulated stream thread finishes
    the kernel after the reset returns, so the owner must still be alive then."""
    import weakref

    from trio_cuda.kernels import sleep

    dev = trio_cuda.current_device()
    big = np.zeros(1 << 22, np.int32)  # large enough to be its own mapping
    alive = weakref.ref(big)
    t = api.from_dlpack(big[:1])
    del big
    await sleep(t.partition((1,)), 1000)  # loaded
    started = await lowlevel.submit(sleep(t.partition((1,)), 300_000_000))
    del t, started
    gc.collect()
    await trio.to_thread.run_sync(dev.reset)
    await api.zeros((1,))  # housekeeping runs the release
    gc.collect()
    assert alive() is not None  # the running kernel's view keeps the owner
    await trio.to_thread.run_sync(dev.synchronize)


async def test_empty_tensors_export_and_tensors_stay_on_their_device() -> None:
    empty = await api.zeros((3, 0))
    if not ON_CUDA:
        assert np.from_dlpack(empty).shape == (3, 0)
    if trio_cuda.device_count() > 1:
        with pytest.raises(ValueError, match=r"api\.dup"):
            api.asarray(empty, device=1)
