"""Replayed GEMMs as captured graphs (CUDA backend, issue 12): from the third call of a
matmul on the same memory and stream (its second direct submission), the backend
launches a captured graph of cuBLASLt's call instead of calling the library.

The behaviour tests (results as the operands change, bias and activation, several
streams, eviction, streams dropped, resets, a capture the driver refuses) run on both
backends; on CUDA they also check that graphs were made and launched. The simulated
device has no graphs: there the same programs must give the same results.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import Tensor, api, ops

from ..helpers.devices import ON_CUDA, settle

RNG = np.random.default_rng(12)


def f32(*shape: int) -> np.ndarray:
    return RNG.uniform(-1, 1, shape).astype(np.float32)


def gemms(dev: trio_cuda.Device) -> Any:
    """The CUDA backend's cuBLASLt state (None on the simulated device)."""
    return getattr(dev._driver, "_gemms", None)


@pytest.fixture(autouse=True)
def _replay_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from no graphs, with the replay on, and as if no other library's
    stream had been wrapped (earlier tests of the session may have: then nothing is
    captured; one test below sets it)."""
    dev = trio_cuda.device(0)
    monkeypatch.setattr(dev, "_foreign_streams", False)
    g = gemms(dev)
    if g is not None:
        from cuda.bindings import driver as cu

        for _, e in list(g.graphs.values()):
            cu.cuGraphExecDestroy(e)
        g.graphs.clear()
        g.refused.clear()
        for name, value in (("replay", True), ("capture_ok", True), ("evictions", 0), ("replays", 0), ("captures", 0)):
            monkeypatch.setattr(g, name, value)


def counts(dev: trio_cuda.Device) -> tuple[int, int]:
    g = gemms(dev)
    return (g.captures, g.replays) if g is not None else (0, 0)


@contextlib.contextmanager
def on(stream: trio_cuda.Stream) -> Iterator[None]:
    """Awaits submit on ``stream`` meanwhile."""
    dev = stream.device
    old = dev.policy
    dev.policy = trio_cuda.SingleStream(stream=stream)
    try:
        yield
    finally:
        dev.policy = old


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class Gemv:
    """``y = w @ ones(k)`` on fresh tensors (``w`` random, ``m x k``): ``await g.run()``
    awaits the matmul and checks ``y`` (the rows' sums)."""

    def __init__(self, hw: np.ndarray, w: Tensor, x: Tensor, y: Tensor) -> None:
        self.hw, self.w, self.x, self.y = hw, w, x, y

    @classmethod
    async def new(cls, m: int, k: int) -> Gemv:
        hw = f32(m, k)
        return cls(hw, await api.from_host(hw), await api.from_host(np.ones(k, np.float32)), await api.zeros((m,)))

    async def run(self, times: int = 1) -> None:
        for _ in range(times):
            await ops.matmul(self.w, self.x, out=self.y)
            close(await self.y.to_host(), self.hw.astype(np.float64).sum(axis=1))


async def test_a_replayed_gemm_reads_the_operands_each_time(dev: trio_cuda.Device) -> None:
    # A graph holds the library's call, not its result: new values in the same memory
    # (written by a kernel, by a copy, by another GEMM) give new results.
    hw = f32(64, 48)
    w, x, y = await api.from_host(hw), await api.zeros((48,)), await api.zeros((64,))
    c0 = counts(dev)
    for i in range(8):
        hx = f32(48)
        await api.memcpy(x, hx)
        await ops.matmul(w, x, out=y)
        close(await y.to_host(), hw.astype(np.float64) @ hx)
        if i % 3 == 2:  # the weights change too, through a kernel writing them
            await ops.multiply(w, -1.0, out=w)
            hw = -hw
    captures, replays = (a - b for a, b in zip(counts(dev), c0, strict=True))
    if ON_CUDA:
        # call 1 builds the recipe, call 2 is its first direct submission (which
        # prepares it), call 3 is captured and launched, calls 4-8 replay the graph
        assert captures == 1 and replays == 6


async def test_the_direct_submission_replays_the_graph_and_calls_a_replaced_matmul(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ops GEMM's direct submission replays its kept graph; a matmul replaced on the
    driver object (fault injection, a tool's wrapper) is called for every submission, and
    still replays."""
    mv = await Gemv.new(40, 24)
    c0 = counts(dev)
    await mv.run(8)
    captures, replays = (a - b for a, b in zip(counts(dev), c0, strict=True))
    if ON_CUDA:
        assert captures == 1 and replays == 6
    calls: list[Any] = []
    real = dev._driver.matmul

    def wrapper(*args: Any) -> Any:
        calls.append(args[1:4])
        return real(*args)

    monkeypatch.setattr(dev._driver, "matmul", wrapper)
    c0 = counts(dev)
    await mv.run(5)
    assert calls == [(mv.w.ptr, mv.x.ptr, mv.y.ptr)] * 5
    if ON_CUDA:
        assert counts(dev)[1] - c0[1] == 5


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
async def test_linear_with_bias_replays_its_epilogue(dev: trio_cuda.Device, activation: str) -> None:
    hx, hw, hb = f32(5, 32), f32(24, 32), f32(24)
    x, w, b, y = await api.from_host(hx), await api.from_host(hw), await api.from_host(hb), await api.zeros((5, 24))
    pre = hx.astype(np.float64) @ hw.T.astype(np.float64) + hb
    want = {
        "none": pre,
        "relu": np.maximum(pre, 0),
        "gelu": 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3))),
    }[activation]
    c0 = counts(dev)
    for _ in range(5):
        await api.memcpy(y, np.full((5, 24), 7.0, np.float32))  # beta is 0: D is overwritten
        await ops.linear(x, w, b, activation=activation, out=y)
        close(await y.to_host(), want)
    if ON_CUDA:
        assert counts(dev)[0] - c0[0] == 1 and counts(dev)[1] - c0[1] == 3


async def test_each_stream_gets_its_own_graph_and_order_holds_across_streams(dev: trio_cuda.Device) -> None:
    # The same GEMM on two streams: one graph per stream (a graph uses the stream's
    # workspace). Operands written on the other stream are waited for.
    s1, s2 = dev.create_stream(), dev.create_stream()
    hw = f32(32, 32)
    w, x, y = await api.from_host(hw), await api.zeros((32,)), await api.zeros((32,))
    c0 = counts(dev)
    for i in range(6):
        hx = f32(32)
        with on(s1 if i % 2 else s2):
            await api.memcpy(x, hx)
        with on(s2 if i % 2 else s1):
            await ops.matmul(w, x, out=y)
        close(await y.to_host(), hw.astype(np.float64) @ hx)
    if ON_CUDA:
        g = gemms(dev)
        assert counts(dev)[0] - c0[0] == 2
        streams = {k[5] for k in g.graphs}
        assert {int(s1.handle), int(s2.handle)} <= streams


async def test_the_least_recently_used_graph_is_evicted(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda._backends import _cublaslt

    monkeypatch.setattr(_cublaslt, "MAX_GRAPHS", 2)
    hws = [f32(16, 12) for _ in range(3)]
    ws = [await api.from_host(h) for h in hws]
    x, y = await api.from_host(np.ones(12, np.float32)), await api.zeros((16,))

    async def use(i: int, times: int = 1) -> None:
        for _ in range(times):
            await ops.matmul(ws[i], x, out=y)
            close(await y.to_host(), hws[i].astype(np.float64).sum(axis=1))

    await use(0, 3)  # captured at its third call
    await use(1, 3)
    await use(0)  # used last: the second GEMM's graph is now the least recently used
    await use(2, 3)  # this capture evicts the second's, not the first's
    if ON_CUDA:
        kept = {k[1] for k in gemms(dev).graphs}
        assert kept == {ws[0].ptr, ws[2].ptr}


async def test_graphs_that_churn_stop_the_captures(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    # Three GEMMs cycling through two slots: every call would capture and evict. Past a
    # grace of 64 evictions, more than one per 8 replays stops new captures (the library
    # makes the calls); results are right throughout.
    from trio_cuda._backends import _cublaslt

    monkeypatch.setattr(_cublaslt, "MAX_GRAPHS", 2)
    g = gemms(dev)  # (its guard and counters restored afterwards by _replay_on)
    hws = [f32(16, 10) for _ in range(3)]
    ws = [await api.from_host(h) for h in hws]
    x, y = await api.from_host(np.ones(10, np.float32)), await api.zeros((16,))
    for _ in range(40):
        for h, w in zip(hws, ws, strict=True):
            await ops.matmul(w, x, out=y)
            close(await y.to_host(), h.astype(np.float64).sum(axis=1))
    if ON_CUDA:
        assert g.capture_ok is False and 64 < g.evictions < 80
        captures = g.captures
        for w in ws:
            await ops.matmul(w, x, out=y)
        assert g.captures == captures


async def test_a_dropped_stream_takes_its_graphs(dev: trio_cuda.Device) -> None:
    async def gemm_on(s: trio_cuda.Stream) -> None:
        with on(s):
            await (await Gemv.new(16, 16)).run(4)

    s = dev.create_stream()
    handle = int(s.handle) if ON_CUDA else None
    await gemm_on(s)
    if ON_CUDA:
        assert any(k[5] == handle for k in gemms(dev).graphs)
    destroyed = dev.statistics().streams_destroyed
    del s  # (and the tensors that noted their accesses on it, with gemm_on's frame)
    await trio.to_thread.run_sync(settle)  # destroys dropped streams
    assert dev.statistics().streams_destroyed > destroyed
    if ON_CUDA:
        assert not any(k[5] == handle for k in gemms(dev).graphs)
    for _ in range(3):  # a new stream may get the same handle: its GEMMs still work
        await gemm_on(dev.create_stream())


def test_after_a_reset_gemms_capture_again(dev: trio_cuda.Device) -> None:
    async def rounds() -> None:
        await (await Gemv.new(16, 16)).run(4)

    trio.run(rounds)
    if ON_CUDA:
        assert gemms(dev).graphs
    dev.reset()
    if ON_CUDA:  # the context's cuBLASLt state and graphs went with it
        g = gemms(dev)
        assert g.graphs == {} and g.captures == 0 and g.capture_stream is None
    trio.run(rounds)
    if ON_CUDA:
        assert counts(dev) == (1, 2)  # the new context's graph, made at the third call


@pytest.mark.gpu
async def test_a_capture_the_driver_refuses_falls_back_to_the_library_call(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cuda

    tries: list[Any] = []

    def refuse(stream: Any, mode: Any) -> tuple[Any]:
        tries.append(stream)
        return (cu.CUresult.CUDA_ERROR_NOT_SUPPORTED,)

    monkeypatch.setattr(_cuda.cu, "cuStreamBeginCapture", refuse)
    # (a shape no other test uses: a GEMM on the same shapes, addresses and stream as an
    # earlier test's would find that test's graph, which computes the same thing)
    mv = await Gemv.new(17, 13)
    c0 = counts(dev)
    await mv.run(5)
    assert len(tries) == 1  # tried once for this GEMM, then never again
    assert counts(dev) == c0


@pytest.mark.gpu
async def test_a_graph_the_driver_will_not_launch_goes_and_the_library_makes_the_call(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cuda

    mv = await Gemv.new(21, 9)
    w, x, y = mv.w, mv.x, mv.y
    await mv.run(3)
    g = gemms(dev)
    key = next(k for k in g.graphs if (k[0].m, k[0].k) == (21, 9) and k[1:4] == (w.ptr, x.ptr, y.ptr))
    launches: list[Any] = []

    def refuse(graph: Any, stream: Any) -> tuple[Any]:
        launches.append(graph)
        return (cu.CUresult.CUDA_ERROR_INVALID_VALUE,)

    monkeypatch.setattr(dev._driver, "_graph_pfn", 0)  # through cuda.bindings, which we can refuse
    monkeypatch.setattr(_cuda.cu, "cuGraphLaunch", refuse)
    await api.memcpy(y, np.zeros(21, np.float32))
    await mv.run(3)  # refused once: the graph goes; this call and the next are the library's
    assert len(launches) == 1
    assert key not in g.graphs and key in g.refused
    assert not dev.is_faulted


@pytest.mark.gpu
async def test_an_exception_inside_a_capture_ends_the_capture(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not an Exception (as KeyboardInterrupt is not): it propagates, and the capture
    # stream does not stay capturing (every later capture would fail, and the context
    # would keep an active capture).
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cublaslt

    class Stop(BaseException):
        pass

    g = gemms(dev)
    real = _cublaslt._Plan.run

    def run(self: Any, a: int, b: int, d: int, bias: int, ws: int, ws_bytes: int, stream: int) -> None:
        cs = g.capture_stream
        if cs is not None and stream == int(cs):
            raise Stop
        real(self, a, b, d, bias, ws, ws_bytes, stream)

    monkeypatch.setattr(_cublaslt._Plan, "run", run)
    mv = await Gemv.new(23, 7)
    await mv.run(2)
    with pytest.raises(Stop):
        await ops.matmul(mv.w, mv.x, out=mv.y)
    err, status = cu.cuStreamIsCapturing(g.capture_stream)
    assert err == cu.CUresult.CUDA_SUCCESS and status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    monkeypatch.setattr(_cublaslt._Plan, "run", real)
    c0 = counts(dev)
    await mv.run(3)  # the next op on the same tensors is captured now, with right results
    assert counts(dev)[0] == c0[0] + 1


@pytest.mark.gpu
async def test_with_the_replay_off_the_library_is_called_each_time(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (Gemms.replay, a test hook)
    monkeypatch.setattr(gemms(dev), "replay", False)
    hw = np.arange(64, dtype=np.float32).reshape(8, 8)
    w, x, y = await api.from_host(hw), await api.ones((8,)), await api.zeros((8,))
    c0 = counts(dev)
    for _ in range(5):
        await ops.matmul(w, x, out=y)
    np.testing.assert_array_equal(await y.to_host(), hw.sum(axis=1))
    assert counts(dev) == c0


async def test_many_tasks_replaying_gemms_on_a_pool(dev: trio_cuda.Device) -> None:
    # 16 tasks, each its own operands, on the default pool of streams: every result is
    # its own, while graphs are captured and replayed concurrently.
    hw = f32(32, 32)
    w = await api.from_host(hw)

    async def task(i: int) -> None:
        x, y = await api.from_host(np.full(32, float(i), np.float32)), await api.zeros((32,))
        for _ in range(10):
            await ops.matmul(w, x, out=y)
            close(await y.to_host(), hw.astype(np.float64).sum(axis=1) * i)

    async with trio.open_nursery() as n:
        for i in range(16):
            n.start_soon(task, i)
    gc.collect()


async def test_after_another_librarys_stream_was_wrapped_gemms_are_not_captured(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process that wrapped another library's stream may run that library in other
    # threads, and its device-wide synchronize would fail during a capture: no captures
    # then, and the same results.
    monkeypatch.setattr(dev, "_foreign_streams", True)
    mv = await Gemv.new(24, 40)
    c0 = counts(dev)
    await mv.run(5)
    assert counts(dev) == c0


@pytest.mark.gpu
def test_graphs_are_destroyed_at_exit() -> None:
    # A child that made GEMM graphs: trio-cuda's exit hook destroys them (and the capture
    # stream) before the interpreter's teardown. The child's own hook, registered first,
    # runs after it (atexit runs the last registered first) and checks.
    code = textwrap.dedent(
        """
        import atexit, os
        state = {}
        def check():
            g = state["gemms"]
            ok = g.graphs == {} and g.capture_stream is None and g.replay is False
            os.write(1, b"closed" if ok else b"left open")
        atexit.register(check)
        import numpy as np, trio, trio_cuda
        from trio_cuda import Tensor, api, ops
        async def main():
            w, x, y = await api.ones((8, 8)), await api.ones((8,)), await api.zeros((8,))
            for _ in range(4):
                await ops.matmul(w, x, out=y)
        trio.run(main)
        g = state["gemms"] = trio_cuda.current_device()._driver._gemms
        assert len(g.graphs) == 1 and g.capture_stream is not None
        """
    )
    env = dict(os.environ, TRIO_CUDA_QUIET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "closed"
    assert r.stderr.strip() == "", r.stderr[-3000:]


WORKSPACE_SHAPES = [(64, 65536, 64), (32, 131072, 32), (128, 16384, 128), (256, 8192, 256)]


@pytest.mark.gpu
async def test_a_graph_using_a_streams_workspace_goes_with_the_stream(dev: trio_cuda.Device) -> None:
    # A GEMM whose plan uses a workspace (split K: long K, small M and N): its graph
    # holds the stream's workspace. The stream is dropped (its workspace freed, its
    # graphs destroyed); a new stream, which may get the same handle, captures anew
    # with its own workspace, and results stay right.
    drv = dev._driver
    shape = None
    for m, k, n in WORKSPACE_SHAPES:
        a, b, y = await api.from_host(f32(m, k)), await api.from_host(f32(k, n)), await api.zeros((m, n))
        await ops.matmul(a, b, out=y)
        desc = ops.matmul(a, b, out=y)._hit.direct.specs[0][1]
        if drv._gemms.plan(desc, False).workspace:
            shape = (m, k, n)
            break
    if shape is None:
        pytest.skip(f"cuBLASLt picks no algorithm with a workspace for {WORKSPACE_SHAPES} here")
    m, k, n = shape
    ha, hb = f32(m, k), f32(k, n)
    want = ha.astype(np.float64) @ hb.astype(np.float64)

    async def gemms_on(s: trio_cuda.Stream) -> int:
        a, b, y = await api.from_host(ha), await api.from_host(hb), await api.zeros((m, n))
        with on(s):
            for _ in range(4):
                await api.memcpy(y, np.zeros((m, n), np.float32))
                await ops.matmul(a, b, out=y)
                np.testing.assert_allclose(await y.to_host(), want, rtol=1e-3, atol=1e-2)
        handle = int(s.handle)
        assert any(key[5] == handle for key in drv._gemms.graphs)
        assert drv._gemms.workspaces.get(handle)
        return handle

    s = dev.create_stream()
    handle = await gemms_on(s)
    del s
    await trio.to_thread.run_sync(settle)
    assert not any(key[5] == handle for key in drv._gemms.graphs) and handle not in drv._gemms.workspaces
    for _ in range(3):
        await gemms_on(dev.create_stream())


def test_the_exit_hook_runs_each_drivers_under_the_runtime_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda import _guard, _registry

    seen: list[tuple[int, bool]] = []
    for d in trio_cuda.devices():
        monkeypatch.setattr(d._driver, "at_exit", lambda d=d: seen.append((d.ordinal, _guard.LOCK._is_owned())))  # type: ignore[attr-defined]
    _registry._at_exit()
    assert seen == [(d.ordinal, True) for d in trio_cuda.devices()]
    # Held by another thread (a submission that never ends): skipped after a second.
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _guard.LOCK:
            held.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait()
        seen.clear()
        _registry._at_exit()
        assert seen == []
    finally:
        release.set()
        t.join()
