"""trio_cuda.external: a foreign stream-aware call as an op, ordered like any op; the
stream protocol of trio_cuda.Stream."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import ON_CUDA, counter, needs_devices


async def test_fn_gets_the_ops_stream_once_and_its_result_is_the_output() -> None:
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    x = await api.zeros((16,))
    calls: list[object] = []

    def fn(stream: trio_cuda.Stream) -> str:
        calls.append(stream)
        return "enqueued"

    pending = await lowlevel.submit(trio_cuda.external(fn, writes=[x]), s)
    assert calls == [s]
    assert await pending.wait() == "enqueued"


async def test_writes_order_later_readers_and_reads_wait_for_writers() -> None:
    """A write declared by an external call on one stream: a later reader on another
    stream waits for it (a cross-stream wait is enqueued); a pending write before it on
    another stream is waited for too."""
    dev = trio_cuda.current_device()
    a, b = dev.create_stream(), dev.create_stream()
    x = await api.zeros((1 << 12,))
    w0 = dev.statistics().stream_waits
    first = await lowlevel.submit(ops.add(x, 1.0, out=x), a)  # a pending write on stream a
    ext = await lowlevel.submit(trio_cuda.external(lambda s: None, reads=[x], name="reader"), b)
    w1 = dev.statistics().stream_waits
    assert w1 > w0  # b waits for a's write before the external call's work
    later = await lowlevel.submit(ops.multiply(x, 2.0, out=x), a)  # must wait for b's read
    assert dev.statistics().stream_waits > w1
    for p in (first, ext, later):
        await p.wait()
    np.testing.assert_array_equal(await x.to_host(), np.full(1 << 12, 2.0, np.float32))


async def test_inputs_may_be_ops_and_it_composes_in_a_dag() -> None:
    x = await api.arange(8, dtype=np.float32)
    seen: list[int] = []
    ext = trio_cuda.external(lambda s: seen.append(1) or 7, reads=[x + 1])
    value, y = await trio_cuda.zip(ext, ops.multiply(x, 7.0))
    assert value == 7 and seen == [1]
    np.testing.assert_array_equal(await y.to_host(), np.arange(8) * 7)


async def test_bad_arguments_and_a_failing_call() -> None:
    x = await api.zeros((4,))
    with pytest.raises(TypeError, match="callable"):
        trio_cuda.external(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of tensors"):
        trio_cuda.external(lambda s: None, reads=x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="entries"):
        trio_cuda.external(lambda s: None, writes=[np.zeros(3)])

    def broken(stream: object) -> None:
        raise RuntimeError("the library refused")

    with pytest.raises(trio_cuda.ExternalCallError, match="refused") as info:
        await trio_cuda.external(broken, writes=[x])
    assert isinstance(info.value.__cause__, RuntimeError)
    np.testing.assert_array_equal(await (x + 1).to_host(), [1, 1, 1, 1])  # the device works


@needs_devices(2)
async def test_tensors_of_two_devices_are_refused() -> None:
    x, y = await api.zeros((4,)), await api.zeros((4,), device=1)
    with pytest.raises(ValueError, match="devices"):
        trio_cuda.external(lambda s: None, reads=[x], writes=[y])


async def test_the_stream_protocol() -> None:
    s = trio_cuda.current_device().create_stream()
    if ON_CUDA:
        version, handle = s.__cuda_stream__()
        assert version == 0 and handle == int(s.handle) and handle != 0
    else:
        with pytest.raises(TypeError, match="simulated"):
            s.__cuda_stream__()


async def test_an_external_stream_runs_ops_and_is_never_destroyed_here() -> None:
    dev = trio_cuda.current_device()
    if not ON_CUDA:
        with pytest.raises(TypeError, match="CUDA streams"):
            lowlevel.external_stream(12345)
        return
    from cuda.bindings import driver as cu

    err, raw = cu.cuStreamCreate(0)
    assert err == cu.CUresult.CUDA_SUCCESS
    s = lowlevel.external_stream(int(raw))
    assert s.__cuda_stream__() == (0, int(raw))
    x = await api.zeros((64,))
    pending = await lowlevel.submit(ops.add(x, 3.0, out=x), s)
    await pending.wait()
    np.testing.assert_array_equal(await x.to_host(), np.full(64, 3.0, np.float32))
    del s, pending
    import gc

    gc.collect()
    await api.zeros((1,))  # housekeeping ran: the library's stream must still be usable
    assert cu.cuStreamSynchronize(raw)[0] == cu.CUresult.CUDA_SUCCESS
    cu.cuStreamDestroy(raw)
    # x was last written on the library's stream, now destroyed: its free must not use it
    frees = dev.statistics().frees
    del x
    gc.collect()
    y = await ops.add(await api.zeros((8,)), 1.0)  # deferred frees run here
    assert dev.statistics().frees > frees
    np.testing.assert_array_equal(await y.to_host(), np.ones(8, np.float32))
    with pytest.raises(TypeError, match="int"):
        dev.external_stream("0x1")  # type: ignore[arg-type]


# -- a call that raises: what ran before it completes, nothing after it runs ------------------------
def _refuse(stream: object) -> None:
    raise TypeError("the library refused its arguments")


async def _in_use(dev: trio_cuda.Device) -> int:
    """The device's bytes in use once dropped tensors' frees are enqueued (any submission
    enqueues them)."""
    import gc

    gc.collect()
    await api.zeros((0,))
    return dev.statistics().bytes_in_use


async def test_a_call_that_raises_names_what_ran_before_it_and_nothing_after_it_runs() -> None:
    """A DAG of a copy (a zip sibling), a kernel, the call and a kernel after it: the call
    raises; the await raises ExternalCallError (from the library's error) naming the copy
    and the kernel as enqueued and the later kernel as not run. The enqueued work lands,
    the shared op after the call fails with the same error for its other consumer, its
    output is released, and the tensors work afterwards."""
    dev = trio_cuda.current_device()
    n = 1 << 10
    x, y = await api.zeros((n,)), await api.zeros((n,))
    baseline = await _in_use(dev)
    host = np.arange(n, dtype=np.float32)
    before = ops.add(x, 1.0, out=x).shared()  # runs before the call; awaited again below
    after = ops.multiply(y, 3.0).shared()  # after the call (a new tensor): never runs
    call = trio_cuda.external(_refuse, reads=[before], writes=[y], name="lib")
    with pytest.raises(trio_cuda.ExternalCallError, match="refused its arguments") as info:
        with trio.fail_after(10):
            await trio_cuda.zip(api.from_host(host), call, after)
    err = info.value
    assert isinstance(err, trio_cuda.LaunchError) and isinstance(err.__cause__, TypeError)
    assert err.op == "external lib"
    assert err.ran == ("copy host->device", "kernel ops.add")
    assert err.not_run == ("kernel ops.multiply",)
    assert "copy host->device, kernel ops.add; not run: kernel ops.multiply" in str(err)
    with pytest.raises(trio_cuda.ExternalCallError) as again:
        await after  # its other consumer: the same error
    assert (again.value.ran, again.value.not_run, again.value.op) == (err.ran, err.not_run, err.op)
    assert await before is x  # it ran: its other consumer gets its output
    np.testing.assert_array_equal(await x.to_host(), np.ones(n, np.float32))
    np.testing.assert_array_equal(await y.to_host(), np.zeros(n, np.float32))  # the call wrote nothing
    await ops.add(y, 2.0, out=y)
    np.testing.assert_array_equal(await y.to_host(), np.full(n, 2.0, np.float32))
    del info, err, again, before, after, call
    assert await _in_use(dev) == baseline  # the copy's tensor and the unrun op's output are freed


async def test_the_output_of_an_op_after_the_failing_call_refuses_use() -> None:
    y = await api.zeros((64,))
    seen: list[trio_cuda.Tensor] = []
    after = ops.multiply(y, 3.0).then(lambda t: seen.append(t) or t)  # the tensor escapes
    with pytest.raises(trio_cuda.ExternalCallError) as info:
        await trio_cuda.zip(trio_cuda.external(_refuse, writes=[y]), after)
    assert info.value.ran == () and info.value.not_run == ("kernel ops.multiply",)
    with pytest.raises(ValueError, match="did not run"):
        await ops.add(seen[0], 1.0)  # never written: refused, not uninitialized memory
    with pytest.raises(ValueError, match="did not run"):
        await seen[0].to_host()


async def test_a_call_that_raises_under_sync_and_in_a_graph_capture() -> None:
    """sync() raises the same error (from the calling thread, with the work before the
    call enqueued); a capture runs nothing, so nothing ran."""
    x, y = await api.zeros((32,)), await api.zeros((32,))

    def sync() -> trio_cuda.ExternalCallError:
        with pytest.raises(trio_cuda.ExternalCallError) as info:
            trio_cuda.zip(ops.add(x, 1.0, out=x), trio_cuda.external(_refuse, writes=[y]), ops.add(y, 1.0, out=y)).sync()
        return info.value

    err = await trio.to_thread.run_sync(sync)
    assert (err.ran, err.not_run) == (("kernel ops.add",), ("kernel ops.add",))
    np.testing.assert_array_equal(await x.to_host(), np.ones(32, np.float32))
    np.testing.assert_array_equal(await y.to_host(), np.zeros(32, np.float32))
    with pytest.raises(trio_cuda.ExternalCallError, match="inside a graph capture: nothing ran") as info:
        trio_cuda.zip(ops.add(x, 1.0, out=x), trio_cuda.external(_refuse, writes=[y]), ops.add(y, 1.0, out=y)).graph()
    assert info.value.ran == () and info.value.not_run == ("kernel ops.add", "kernel ops.add")
    np.testing.assert_array_equal(await x.to_host(), np.ones(32, np.float32))  # the capture ran nothing
    await ops.add(x, 1.0, out=x)  # the stream and the tensors are usable again
    np.testing.assert_array_equal(await x.to_host(), np.full(32, 2.0, np.float32))


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial4.py)
# ======================================================================================
# ======================================================================================
# 3. frees, foreign streams, words and resets
# ======================================================================================
def _spy_stream_uses(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> list[tuple[str, Any]]:
    """Record (driver call, stream handle) for the calls that name a stream."""
    drv = dev._driver
    uses: list[tuple[str, Any]] = []
    for name, pos in (("free", 1), ("record", 1), ("destroy_stream", 0), ("wait_event", 0), ("alloc", 1)):
        orig = getattr(drv, name)

        def wrapper(*args: Any, _orig: Any = orig, _name: str = name, _pos: int = pos, **kw: Any) -> Any:
            if len(args) > _pos:
                uses.append((_name, args[_pos]))
            return _orig(*args, **kw)

        monkeypatch.setattr(drv, name, wrapper)
    return uses


@pytest.mark.sim_only
async def test_memory_used_only_on_another_librarys_stream_is_freed_on_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    s._foreign = True  # stands in for an external stream (the simulator has none)
    handle = s.handle
    c = await counter()
    await sleep(c, 1000)
    sub = await lowlevel.submit(api.zeros((64,)), s)
    x = await sub.wait()
    await (await lowlevel.submit(sleep(c, 50_000_000).then(lambda _, x=x: ops.add(x, 1.0, out=x)), s)).wait()
    uses = _spy_stream_uses(monkeypatch, dev)
    del x, sub
    gc.collect()
    await api.zeros((1,))  # flushes the free
    frees = [h for name, h in uses if name == "free"]
    assert frees, "the dropped tensor was not freed"
    assert handle not in frees, "memory freed on another library's stream"
    s._foreign = False


@pytest.mark.sim_only
async def test_a_dropped_foreign_stream_with_pending_work_is_never_named_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # After the last reference goes, trio-cuda must not record on, wait on, free on or
    # destroy another library's stream (the library may have destroyed it); the memory it
    # used is freed after its work.
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    s._foreign = True
    handle = s.handle
    c = await counter()
    await sleep(c, 1000)
    x = await (await lowlevel.submit(api.zeros((64,)), s)).wait()
    await lowlevel.submit(sleep(c, 100_000_000).then(lambda _, x=x: ops.add(x, 1.0, out=x)), s)
    uses = _spy_stream_uses(monkeypatch, dev)
    del s
    gc.collect()
    y = await api.zeros((4,))  # housekeeping: the stream lingers (its work is pending)
    np.testing.assert_array_equal(await x.to_host(), np.ones(64, np.float32))  # waits for the add
    del x
    for _ in range(3):
        gc.collect()
        await ops.add(y, 1.0, out=y)
    await trio.to_thread.run_sync(dev.synchronize)
    await api.zeros((1,))
    named = [(name, h) for name, h in uses if h is handle]
    assert not named, f"another library's dropped stream was used: {named}"
