"""CUDA graphs: capture, take_output, update, launch, the scope form, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda.kernels import add, saxpy

from .conftest import started

N = 8


async def setup() -> tuple[trio_cuda.Tensor, trio_cuda.Tensor, trio_cuda.Tensor]:
    x = await api.arange(N)
    y = await api.zeros((N,))
    z = await api.zeros((N,))
    return x, y, z


def two_step(x: trio_cuda.Tensor, y: trio_cuda.Tensor, z: trio_cuda.Tensor) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
    return saxpy(2.0, x, y.partition((4,))).then(lambda _: add(z.partition((4,)), x, y)).first().unpartition()


async def test_capture_runs_nothing_then_replays(dev: trio_cuda.Device) -> None:
    x, y, z = await setup()
    launches = dev.statistics().launches
    graph = two_step(x, y, z).graph()
    assert isinstance(graph, trio_cuda.CudaGraph) and graph.nodes >= 2
    np.testing.assert_array_equal(await z.to_host(), np.zeros(N))  # nothing ran
    out = graph.take_output()
    assert out is z
    with pytest.raises(RuntimeError, match="once"):
        graph.take_output()
    before = dev.statistics().graph_launches
    assert await graph.launch() is z
    assert dev.statistics().graph_launches == before + 1
    assert dev.statistics().launches == launches  # one graph launch, no kernel launches
    xs = np.arange(N, dtype=np.float32)
    np.testing.assert_array_equal(await z.to_host(), 3 * xs)
    await graph.launch()  # y accumulates: y = 4x, z = 5x
    np.testing.assert_array_equal(await z.to_host(), 5 * xs)


async def test_graph_matches_eager_execution() -> None:
    x, y, z = await setup()
    await two_step(x, y, z)
    eager = await z.to_host()
    x2, y2, z2 = await setup()
    g = two_step(x2, y2, z2).graph()
    await g.launch()
    np.testing.assert_array_equal(await z2.to_host(), eager)


async def test_update_rewrites_inputs_without_recapture() -> None:
    x, _y, z = await setup()
    g = (add(z.partition((4,)), x, x)).graph()
    for k in range(3):
        g.update(api.memcpy(x, np.full(N, float(k), np.float32)))
        await g.launch()
        np.testing.assert_array_equal(await z.to_host(), np.full(N, 2.0 * k))
    with pytest.raises(TypeError):
        g.update("memcpy")  # type: ignore[arg-type]


def test_launch_sync_and_sync_on(dev: trio_cuda.Device) -> None:
    x = api.arange(N).sync()
    z = api.zeros((N,)).sync()
    g = add(z.partition((4,)), x, x).graph()
    g.launch().sync()
    np.testing.assert_array_equal(z.to_host().sync(), 2 * np.arange(N))
    s = dev.create_stream()
    g.update(api.memcpy(x, np.ones(N, np.float32)))
    g.launch().sync_on(s)
    np.testing.assert_array_equal(z.to_host().sync(), np.full(N, 2.0))


async def test_graph_launch_orders_after_pending_work_on_other_streams(dev: trio_cuda.Device) -> None:
    x, _y, z = await setup()
    g = add(z.partition((4,)), x, x).graph()
    a, b = trio_cuda.SingleStream(dev), trio_cuda.SingleStream(dev)
    # A slow write of x on stream a, then the graph on stream b: the graph must see it.
    from trio_cuda.kernels import sleep

    slow_write = sleep(api.zeros((1,), np.int32).partition((1,)), 200_000_000).then(
        lambda _: api.memcpy(x, np.full(N, 7.0, np.float32))
    )
    async with trio.open_nursery() as n:
        await n.start(started, slow_write, a)
        await g.launch().schedule(b)
    np.testing.assert_array_equal(await z.to_host(), np.full(N, 14.0))


async def test_zip_branches_inside_a_capture() -> None:
    x = await api.arange(N)
    y1, y2 = await api.zeros((N,)), await api.zeros((N,))
    both = trio_cuda.zip(saxpy(1.0, x, y1.partition((4,))), saxpy(3.0, x, y2.partition((4,))))
    out = await api.zeros((N,))
    g = both.then(lambda _: add(out.partition((4,)), y1, y2)).graph()
    await g.launch()
    np.testing.assert_array_equal(await out.to_host(), 4 * np.arange(N))


async def test_scope_form_records_imperatively() -> None:
    x, y, z = await setup()
    with trio_cuda.capture_graph() as scope:
        first = scope.record(saxpy(1.0, x, y.partition((4,))))
        scope.record(add(z.partition((4,)), y, y))
    assert first[1] is x
    g = scope.graph
    assert g is not None and g.nodes >= 2
    np.testing.assert_array_equal(await z.to_host(), np.zeros(N))
    await g.launch()
    np.testing.assert_array_equal(await z.to_host(), 2 * np.arange(N))


async def test_refusals_inside_a_capture(dev: trio_cuda.Device) -> None:
    x, _y, z = await setup()
    with pytest.raises(trio_cuda.GraphCaptureError, match="allocat"):
        api.zeros((4,)).graph()
    with pytest.raises(trio_cuda.GraphCaptureError, match="host"):
        x.to_host().graph()
    with pytest.raises(trio_cuda.GraphCaptureError, match="allocat"):
        add(api.empty((N,)).partition((4,)), x, x).graph()
    # The failed captures left nothing behind: no stream is capturing, nothing ran.
    np.testing.assert_array_equal(await z.to_host(), np.zeros(N))
    np.testing.assert_array_equal(await api.full((2,), 3.0).to_host(), [3, 3])


async def test_capture_is_scoped_to_its_streams_and_buffers(dev: trio_cuda.Device) -> None:
    x, _y, z = await setup()
    other = await api.arange(N)
    with trio_cuda.capture_graph() as scope:
        scope.record(add(z.partition((4,)), x, x))
        # Unrelated work on the device keeps running during the capture.
        np.testing.assert_array_equal(await api.full((2,), 3.0).to_host(), [3, 3])
        np.testing.assert_array_equal(await api.dup(other).to_host(), np.arange(N, dtype=np.float32))
        # Work that touches a buffer the open capture recorded is refused, before it runs.
        writes_before = dev.statistics().copies
        with pytest.raises(trio_cuda.GraphCaptureError, match="graph capture that is still open"):
            await z.to_host()
        with pytest.raises(trio_cuda.GraphCaptureError, match="graph capture that is still open"):
            await api.memcpy(x, np.ones(N, np.float32))
        assert dev.statistics().copies == writes_before
        # So is work on the capturing stream.
        with pytest.raises(trio_cuda.GraphCaptureError, match="recording a graph capture"):
            await api.ones((2,)).schedule(trio_cuda.SingleStream(stream=scope.stream))
        # And a second capture of the same buffers.
        with pytest.raises(trio_cuda.GraphCaptureError, match="still open"):
            add(z.partition((4,)), x, x).graph()
    assert scope.graph is not None
    # After the scope, everything is usable again; nothing of the capture ran.
    np.testing.assert_array_equal(await z.to_host(), np.zeros(N))
    await scope.graph.launch()
    np.testing.assert_array_equal(await z.to_host(), 2 * np.arange(N))


async def test_executing_inside_a_capture_callback_is_nested(dev: trio_cuda.Device) -> None:
    x, _y, z = await setup()

    def cb(_: object) -> object:
        return api.ones((1,)).sync()

    with pytest.raises(trio_cuda.NestedExecutionError):
        add(z.partition((4,)), x, x).then(cb).graph()
    # Nothing is left capturing: the same buffers can be captured and used again.
    g = add(z.partition((4,)), x, x).graph()
    await g.launch()
    np.testing.assert_array_equal(await z.to_host(), 2 * np.arange(N))


async def test_graph_keeps_its_buffers_alive() -> None:
    import gc

    x, y, z = await setup()
    g = add(z.partition((4,)), x, x).first().unpartition().graph()
    out = g.take_output()
    del x, y, z
    gc.collect()
    await api.zeros((64,))  # flushes deferred frees: the graph's buffers must survive
    await g.launch()
    np.testing.assert_array_equal(await out.to_host(), 2 * np.arange(N))
