"""Replayed GEMMs as captured graphs (CUDA backend, issue 12): from the second direct
submission of a recipe's GEMM on the same memory and stream, the backend launches a
captured graph of cuBLASLt's call instead of calling the library.

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
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, ops

from .conftest import ON_CUDA, settle

RNG = np.random.default_rng(12)


def f32(*shape: int) -> np.ndarray:
    return RNG.uniform(-1, 1, shape).astype(np.float32)


def gemms(dev: trio_cuda.Device) -> Any:
    """The CUDA backend's cuBLASLt state (None on the simulated device)."""
    return getattr(dev._driver, "_gemms", None)


@pytest.fixture(autouse=True)
def _replay_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On, whatever TRIO_CUDA_GEMM_GRAPHS says (a test below checks what it does), also
    after a reset and in child processes."""
    monkeypatch.delenv("TRIO_CUDA_GEMM_GRAPHS", raising=False)
    g = gemms(trio_cuda.device(0))
    if g is not None:
        monkeypatch.setattr(g, "replay", True)


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


async def test_old_graphs_are_evicted_past_the_bound(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda._backends import _cublaslt

    monkeypatch.setattr(_cublaslt, "MAX_GRAPHS", 2)
    hws = [f32(16, 16) for _ in range(3)]
    ws = [await api.from_host(h) for h in hws]
    x, y = await api.from_host(np.ones(16, np.float32)), await api.zeros((16,))
    for _ in range(4):
        for h, w in zip(hws, ws, strict=True):
            await ops.matmul(w, x, out=y)
            close(await y.to_host(), h.astype(np.float64).sum(axis=1))
    if ON_CUDA:
        assert len(gemms(dev).graphs) == 2  # three GEMMs cycled through two slots


async def test_a_dropped_stream_takes_its_graphs(dev: trio_cuda.Device) -> None:
    hw = f32(16, 16)

    async def gemm_on(s: trio_cuda.Stream) -> None:
        w, x, y = await api.from_host(hw), await api.from_host(np.ones(16, np.float32)), await api.zeros((16,))
        with on(s):
            for _ in range(4):
                await ops.matmul(w, x, out=y)
        close(await y.to_host(), hw.astype(np.float64).sum(axis=1))

    s = dev.create_stream()
    handle = int(s.handle) if ON_CUDA else None
    await gemm_on(s)
    if ON_CUDA:
        assert any(k[5] == handle for k in gemms(dev).graphs)
    del s  # (and the tensors that noted their accesses on it, with gemm_on's frame)
    await trio.to_thread.run_sync(settle)  # destroys dropped streams
    assert not (dev._dead_streams or dev._lingering)
    if ON_CUDA:
        assert not any(k[5] == handle for k in gemms(dev).graphs)
    for _ in range(3):  # a new stream may get the same handle: its GEMMs still work
        await gemm_on(dev.create_stream())


def test_after_a_reset_gemms_capture_again(dev: trio_cuda.Device) -> None:
    hw = f32(16, 16)

    async def rounds() -> None:
        w, x, y = await api.from_host(hw), await api.from_host(np.ones(16, np.float32)), await api.zeros((16,))
        for _ in range(4):
            await ops.matmul(w, x, out=y)
            close(await y.to_host(), hw.astype(np.float64).sum(axis=1))

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
    hw = f32(17, 13)
    w, x, y = await api.from_host(hw), await api.from_host(np.ones(13, np.float32)), await api.zeros((17,))
    c0 = counts(dev)
    for _ in range(5):
        await ops.matmul(w, x, out=y)
        close(await y.to_host(), hw.astype(np.float64).sum(axis=1))
    assert len(tries) == 1  # tried once for this GEMM, then never again
    assert counts(dev) == c0


@pytest.mark.gpu
async def test_a_graph_launch_error_is_the_launch_error_of_the_op(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import driver as cu

    hw = f32(16, 16)
    w, x, y = await api.from_host(hw), await api.from_host(np.ones(16, np.float32)), await api.zeros((16,))
    for _ in range(3):
        await ops.matmul(w, x, out=y)
    drv = dev._driver
    monkeypatch.setattr(drv, "_graph_pfn", 0)  # through cuda.bindings, which we can refuse
    from trio_cuda._backends import _cuda

    monkeypatch.setattr(_cuda.cu, "cuGraphLaunch", lambda g, s: (cu.CUresult.CUDA_ERROR_INVALID_VALUE,))
    assert dev._driver._gemms.graphs  # (its graph was made at the third call)
    with pytest.raises(trio_cuda.LaunchError, match="cuGraphLaunch") as info:
        await ops.matmul(w, x, out=y)
    assert "matmul" in str(info.value.op)
    monkeypatch.undo()
    await ops.matmul(w, x, out=y)  # the device is fine: the next replay works
    close(await y.to_host(), hw.astype(np.float64).sum(axis=1))


@pytest.mark.gpu
def test_trio_cuda_gemm_graphs_0_calls_the_library_each_time() -> None:
    code = textwrap.dedent(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api, ops
        async def main():
            hw = np.arange(64, dtype=np.float32).reshape(8, 8)
            w, x, y = await api.from_host(hw), await api.ones((8,)), await api.zeros((8,))
            for _ in range(5):
                await ops.matmul(w, x, out=y)
            np.testing.assert_array_equal(await y.to_host(), hw.sum(axis=1))
            g = trio_cuda.current_device()._driver._gemms
            print("graphs", g.captures, g.replays)
        trio.run(main)
        """
    )
    for value, expect in (("0", "graphs 0 0"), ("", "graphs 1 3")):
        env = dict(os.environ, TRIO_CUDA_GEMM_GRAPHS=value)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert expect in r.stdout, r.stdout


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


async def test_after_another_librarys_stream_was_wrapped_gemms_still_replay(
    dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once another library's stream was wrapped, the runtime cannot know whether a
    # stream of its own joined that library's capture: the backend asks the driver, and
    # a stream that does not capture still replays its GEMMs as graphs.
    monkeypatch.setattr(dev, "_foreign_streams", True)
    hw = f32(24, 40)
    w, x, y = await api.from_host(hw), await api.from_host(np.ones(40, np.float32)), await api.zeros((24,))
    c0 = counts(dev)
    for _ in range(5):
        await ops.matmul(w, x, out=y)
        close(await y.to_host(), hw.astype(np.float64).sum(axis=1))
    if ON_CUDA:
        assert counts(dev)[1] - c0[1] == 3


@pytest.mark.gpu
def test_graphs_are_destroyed_at_exit() -> None:
    # A child that made GEMM graphs: the exit hook destroys them (and the capture
    # stream) before the interpreter's teardown, which then reports nothing.
    code = textwrap.dedent(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api, ops
        from trio_cuda._backends import _cuda
        async def main():
            w, x, y = await api.ones((8, 8)), await api.ones((8,)), await api.zeros((8,))
            for _ in range(4):
                await ops.matmul(w, x, out=y)
        trio.run(main)
        g = trio_cuda.current_device()._driver._gemms
        assert len(g.graphs) == 1 and g.capture_stream is not None
        _cuda._drop_gemm_graphs()
        assert g.graphs == {} and g.capture_stream is None
        print("closed")
        """
    )
    env = dict(os.environ, TRIO_CUDA_QUIET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "closed" in r.stdout, r.stderr[-3000:]
    assert r.stderr.strip() == "", r.stderr[-3000:]
