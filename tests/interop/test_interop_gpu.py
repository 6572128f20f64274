"""Interop on CUDA (issue 11): PyTorch, CuPy and numba share trio-cuda's memory without a
copy in both directions, exports are ordered after a pending write behind a long kernel
(the CUDA Array Interface from a thread: refused in a trio task while it is pending), and
``trio_cuda.external`` runs a PyTorch matmul inside an awaited DAG."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import ON_CUDA, counter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")]

LONG_NS = 50_000_000  # 50 ms of GPU time before the pending write


def _torch():  # type: ignore[no-untyped-def]
    return pytest.importorskip("torch")


def _cupy():  # type: ignore[no-untyped-def]
    return pytest.importorskip("cupy")


async def _pending_write(x: trio_cuda.Tensor, value: float) -> lowlevel.Submitted:
    """Queue ``x += value`` behind a 50 ms kernel on a stream of its own; not awaited."""
    s = trio_cuda.current_device().create_stream()
    c = await counter()
    return await lowlevel.submit(sleep(c, LONG_NS).then(lambda _: ops.add(x, value, out=x)), s)


async def test_torch_round_trips_share_the_memory() -> None:
    torch = _torch()
    t = await api.from_host(np.arange(16, dtype=np.float32).reshape(4, 4))
    tt = torch.from_dlpack(t)
    assert tt.data_ptr() == t.ptr and tt.shape == (4, 4)
    back = api.from_dlpack(tt)  # torch -> trio-cuda: the same memory again
    assert back.ptr == t.ptr and back.shape == (4, 4)
    tt.add_(1.0)  # torch writes it...
    torch.cuda.synchronize()
    np.testing.assert_array_equal(await back.to_host(), np.arange(16).reshape(4, 4) + 1)  # ...trio-cuda sees it
    x = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
    tx = api.asarray(x)
    assert tx.ptr == x.data_ptr()
    assert torch.from_dlpack(tx).data_ptr() == x.data_ptr()
    view = api.asarray(x.t())  # a transposed (strided) view
    assert view.ptr == x.data_ptr() and view.shape == (3, 2)
    np.testing.assert_array_equal(await view.to_host(), np.arange(6).reshape(2, 3).T)


async def test_cupy_round_trips_share_the_memory() -> None:
    cp = _cupy()
    t = await api.from_host(np.arange(12, dtype=np.float32))
    by_cai = cp.asarray(t)  # the CUDA Array Interface
    by_dlpack = cp.from_dlpack(t)
    assert by_cai.data.ptr == t.ptr and by_dlpack.data.ptr == t.ptr
    c = cp.arange(10, dtype=cp.float32)
    tc = api.from_dlpack(c)
    assert tc.ptr == c.data.ptr
    assert api.asarray(c).ptr == c.data.ptr
    await ops.multiply(tc, 3.0, out=tc)  # trio-cuda writes CuPy's memory
    np.testing.assert_array_equal(cp.asnumpy(c), np.arange(10) * 3)


async def test_numba_sees_the_tensor() -> None:
    from numba import cuda

    t = await api.from_host(np.arange(8, dtype=np.float32))
    d = cuda.as_cuda_array(t)
    assert d.__cuda_array_interface__["data"][0] == t.ptr
    np.testing.assert_array_equal(d.copy_to_host(), np.arange(8))
    back = api.asarray(d)  # numba -> trio-cuda through its CUDA Array Interface
    assert back.ptr == t.ptr


async def test_exports_wait_for_a_pending_write_behind_a_long_kernel() -> None:
    torch = _torch()
    x = await api.zeros((1 << 16,))
    pending = await _pending_write(x, 5.0)
    assert not pending.event.query()  # the write is still queued behind the kernel
    y = torch.from_dlpack(x) * 2  # torch's stream must wait for the write (DLPack contract)
    assert (y.cpu() == 10.0).all()
    await pending.wait()

    cp = _cupy()
    z = await api.zeros((1 << 16,))
    pending = await _pending_write(z, 7.0)
    assert not pending.event.query()
    with pytest.raises(BufferError, match=r"await t\.ready\(\)"):  # in a trio task: refused
        z.__cuda_array_interface__  # noqa: B018

    def in_a_thread() -> bool:
        assert z.__cuda_array_interface__["stream"] is not None  # names the writer's stream
        w = cp.asarray(z) * 2  # CuPy waits on that stream
        return bool((cp.asnumpy(w) == 14.0).all())

    assert await trio.to_thread.run_sync(in_a_thread)
    await pending.wait()


async def test_external_runs_a_torch_matmul_inside_an_awaited_dag() -> None:
    torch = _torch()
    rng = np.random.default_rng(3)
    ha, hb = rng.standard_normal((64, 32), np.float32), rng.standard_normal((32, 48), np.float32)
    a, b = await api.from_host(ha), await api.from_host(hb)
    c = await api.zeros((64, 48))
    ta, tb, tc = torch.from_dlpack(a), torch.from_dlpack(b), torch.from_dlpack(c)
    streams = []

    def torch_matmul(stream: trio_cuda.Stream) -> str:
        streams.append(stream)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.__cuda_stream__()[1])):
            torch.matmul(ta, tb, out=tc)
        return "enqueued"

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        # a long kernel, then a write of a, then the torch matmul reading it, in one DAG
        counter_ = await counter()
        dag = sleep(counter_, LONG_NS).then(
            lambda _: ops.multiply(a, 2.0, out=a).then(lambda _: trio_cuda.external(torch_matmul, reads=[a, b], writes=[c]))
        )
        assert await dag == "enqueued"
        assert len(streams) == 1
        await ops.add(c, 1.0, out=c)  # ordered after the matmul's write
        np.testing.assert_allclose(await c.to_host(), (2 * ha) @ hb + 1, rtol=1e-4, atol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
