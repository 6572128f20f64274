"""Zero-copy export: DLPack (numpy on the simulated device; PyTorch and CuPy on CUDA)
and the CUDA Array Interface, ordered after pending writes, memory kept alive."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _interop, api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import ON_CUDA, counter


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


async def _pending_add(x: trio_cuda.Tensor, value: float, ns: int = 200_000_000) -> lowlevel.Submitted:
    """Queue ``x += value`` behind a kernel of ``ns`` on a stream of its own; not awaited."""
    await sleep(counter(), 1000)  # loaded: the long one is queued at once
    s = trio_cuda.current_device().create_stream()
    return await lowlevel.submit(sleep(counter(), ns).then(lambda _, t=x: ops.add(t, value, out=t)), s)


@pytest.mark.sim_only
async def test_the_export_waits_for_the_pending_write_in_a_thread_and_keeps_the_memory() -> None:
    x = await api.zeros((1 << 14,))
    pending = await _pending_add(x, 5.0, 50_000_000)
    # A worker thread waits for the write (the view is checked there: the thread may
    # keep what it returned alive until its next job).
    assert await trio.to_thread.run_sync(lambda t=x: bool((np.from_dlpack(t) == 5).all()))
    assert pending.event is not None and pending.event.query()
    view = np.from_dlpack(x)  # nothing pending now: fine in a trio task
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


# -- exports never block the trio loop; adopted memory is aligned ---------------------------------
@pytest.mark.sim_only
async def test_an_export_in_a_trio_task_refuses_while_a_write_is_pending_and_ready_waits() -> None:
    # On the simulated device the host reads the memory itself, so the export needs the
    # write to be over: in a trio task it refuses (waiting would stall the whole loop)
    # and names the awaitable way to wait.
    x = await api.zeros((1 << 14,))
    pending = await _pending_add(x, 5.0)
    with pytest.raises(BufferError, match=r"pending write.*await t\.ready\(\)"):
        np.from_dlpack(x)
    with pytest.raises(BufferError, match=r"await t\.ready\(\)"):
        x.__dlpack__()
    assert pending.event is not None and not pending.event.query()  # refused, not waited
    with trio.testing.assert_checkpoints():
        await x.ready()
    assert pending.event.query()
    np.testing.assert_array_equal(np.from_dlpack(x), np.full(1 << 14, 5.0, np.float32))
    with trio.testing.assert_checkpoints():
        await x.ready()  # nothing pending: still a checkpoint
    np.testing.assert_array_equal(np.from_dlpack(x[::2]), np.full(1 << 13, 5.0, np.float32))


async def test_ready_is_cancellable_and_the_write_goes_on() -> None:
    x = await api.zeros((1 << 10,))
    with trio.CancelScope() as scope:
        scope.cancel()
        await x.ready()  # cancelled before it looks
    assert scope.cancelled_caught
    pending = await _pending_add(x, 3.0)
    with trio.move_on_after(0.02) as scope:
        await x.ready()
    assert scope.cancelled_caught
    assert pending.event is not None and not pending.event.query()
    await x.ready()
    assert pending.event.query()
    np.testing.assert_array_equal(await x.to_host(), np.full(1 << 10, 3.0, np.float32))


async def test_ready_and_exports_of_a_tensor_without_memory_say_why() -> None:
    # A tensor of an op that did not run (its submission failed at an external call
    # before it): ready() refuses it as any op taking it does, and an export says the
    # same; neither tells the caller to await something that will never come.
    kept: list[trio_cuda.Tensor] = []

    def refuse(stream: object) -> None:
        raise TypeError("the library refuses its arguments")

    late = api.zeros((4,)).map(lambda z: (kept.append(z), z)[1])
    with pytest.raises(trio_cuda.ExternalCallError):
        await trio_cuda.zip(trio_cuda.external(refuse), late)
    (orphan,) = kept
    with pytest.raises(ValueError, match="did not run"):
        await orphan.ready()
    with pytest.raises(BufferError, match="did not run"):
        orphan.__dlpack__()


async def test_ready_of_a_tensor_from_before_a_reset_refuses_it_as_ops_do() -> None:
    dev = trio_cuda.current_device()
    x = await api.full((4,), 1.0)
    await trio.to_thread.run_sync(dev.reset)
    with pytest.raises(ValueError, match="was reset"):
        await x.ready()
    with pytest.raises(ValueError, match="was reset"):
        await x.to_host()


@pytest.mark.sim_only
async def test_a_misaligned_array_is_refused_before_any_work() -> None:
    dev = trio_cuda.current_device()
    raw = np.zeros(65, np.uint8)
    misaligned = raw[1:].view(np.float32)  # numpy exports it; the address is odd

    class Producer:  # another library's CPU array, with an element-misaligned address
        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

        def __dlpack__(self, **kwargs: object) -> object:
            return misaligned.__dlpack__()

    before = dev.statistics()
    for obj in (misaligned, Producer()):
        with pytest.raises(ValueError, match=r"not aligned to its dtype float32 \(4 bytes\)"):
            api.from_dlpack(obj)
        with pytest.raises(ValueError, match="not aligned"):
            api.asarray(obj)
    after = dev.statistics()
    assert (after.submissions, after.allocations, after.copies) == (before.submissions, before.allocations, before.copies)
    assert api.from_dlpack(raw[1:]).shape == (64,)  # bytes are aligned to their size
    assert api.from_dlpack(raw[1:1].view(np.float32)).shape == (0,)  # no element to misalign


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
async def test_a_misaligned_cuda_array_interface_is_refused() -> None:
    t = await api.zeros((64,), np.uint8)

    class Foreign:  # another library's device array
        def __init__(self, **cai: object) -> None:
            self.__cuda_array_interface__ = {"typestr": "<f4", "version": 3, **cai}

    with pytest.raises(ValueError, match="not aligned to its dtype float32"):
        api.asarray(Foreign(shape=(15,), data=(t.ptr + 2, False)))
    with pytest.raises(ValueError, match="multiples"):
        api.asarray(Foreign(shape=(8,), data=(t.ptr, False), strides=(6,)))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
async def test_cuda_exports_in_a_trio_task_order_streams_or_refuse() -> None:
    # DLPack with a consumer's stream: that stream waits on the device, the host does
    # not, so it works in a trio task. The CUDA Array Interface leaves the wait to the
    # consumer (numba's waits on the host): refused in a trio task while the write is
    # pending, fine from a thread.
    x = await api.zeros((1 << 16,))
    pending = await _pending_add(x, 5.0)
    dev = trio_cuda.current_device()
    consumer = dev.create_stream()
    capsule = x.__dlpack__(stream=int(consumer.__cuda_stream__()[1]))
    assert pending.event is not None and not pending.event.query()
    del capsule
    with pytest.raises(BufferError, match=r"await t\.ready\(\)"):
        x.__cuda_array_interface__  # noqa: B018
    cai = await trio.to_thread.run_sync(lambda: x.__cuda_array_interface__)
    assert cai["stream"] is not None  # names the writer's stream
    await x.ready()
    assert x.__cuda_array_interface__["stream"] is None
