"""CUDA graphs: capture, take_output, update, launch, the scope form, and the refusals."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, saxpy, sleep

from ..helpers.devices import settle, started

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


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial.py, test_adversarial2.py)
# ======================================================================================
T = TypeVar("T")
MB = 1 << 20


def in_thread(fn: Callable[[], T]) -> T:
    """Run plain blocking code in another thread (not nested in this one's capture)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=30)


# -- graph captures --------------------------------------------------------------------
async def test_another_tasks_read_during_a_capture_waits_for_pre_capture_work(dev: trio_cuda.Device) -> None:
    # repro_capture_swallows_other_task: while a capture scope on stream cs is open,
    # another task reads c, whose pending writer is work enqueued on cs before the
    # capture. The read must wait for that work and complete, not join the capture.
    cs = dev.create_stream()
    x, y = await api.ones((8,)), await api.ones((8,))
    z1, z2 = await api.zeros((8,)), await api.zeros((8,))
    await add(z1.partition((8,)), x, y)  # compiled outside the capture
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)  # c = 1
    await lowlevel.submit(sleep(c.partition((1,)), 300_000_000), cs)  # c = 2, still running
    outcome: dict[str, Any] = {}

    async def reader() -> None:
        with trio.move_on_after(5) as timer:
            outcome["value"] = await c.to_host()  # c is not recorded by the capture
        outcome["timed_out"] = timer.cancelled_caught

    with trio_cuda.capture_graph(cs) as scope:
        scope.record(trio_cuda.zip(add(z1.partition((8,)), x, y), add(z2.partition((8,)), x, y)))
        async with trio.open_nursery() as n:
            n.start_soon(reader)
    assert not outcome["timed_out"], "the read of c was swallowed by the capture: it never completed"
    np.testing.assert_array_equal(outcome["value"], [2])
    assert scope.graph is not None and scope.graph.nodes == 2


async def test_another_tasks_work_during_a_capture_is_not_swallowed_by_a_recycled_event(dev: trio_cuda.Device) -> None:
    # repro_capture_recycled_event_handle: events recorded inside an open capture die
    # during it; their handles went back to the pool still registered as capture events.
    # Another task's submission took one for its completion event: a stream waiting for
    # it joined the capture and its read-back was recorded into the graph, never run.
    x = await api.ones((8,))
    zs = [await api.zeros((8,)) for _ in range(3)]
    await add(zs[0].partition((8,)), x, x)
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)  # c = 1
    outcome: dict[str, Any] = {}

    async def other() -> None:  # ordinary work of another task, nothing to do with the capture
        with trio.move_on_after(5) as timer:
            await lowlevel.submit(sleep(c.partition((1,)), 100_000_000))
            outcome["value"] = await c.to_host()
        outcome["timed_out"] = timer.cancelled_caught

    with trio_cuda.capture_graph() as scope:
        scope.record(trio_cuda.zip(add(zs[0].partition((8,)), x, x), add(zs[1].partition((8,)), x, x)))
        scope.record(trio_cuda.zip(add(zs[2].partition((8,)), x, x), trio_cuda.value(1)))
        gc.collect()  # the capture's fork events die: their handles are recycled now
        async with trio.open_nursery() as n:
            n.start_soon(other)
    assert not outcome["timed_out"], "another task's work was swallowed by the capture"
    np.testing.assert_array_equal(outcome["value"], [2])
    assert scope.graph is not None and scope.graph.nodes == 3


@pytest.mark.sim_only
async def test_a_free_during_a_capture_runs_on_the_device_not_in_the_graph(dev: trio_cuda.Device) -> None:
    # repro_capture_swallows_free: c, last written by pre-capture work on stream cs, is
    # dropped while a capture on cs is open, and another submission flushes its free. The
    # free must run on the device (after c's write), not become a node of the graph (the
    # memory was never released and each replay freed it again).
    await trio.to_thread.run_sync(settle)
    cs = dev.create_stream()
    x, y = await api.ones((8,)), await api.ones((8,))
    z1, z2 = await api.zeros((8,)), await api.zeros((8,))
    await add(z1.partition((8,)), x, y)
    c = await api.zeros((4 * MB // 4,), np.int32)
    await sleep(c.partition((1024,)), 1000)
    await lowlevel.submit(sleep(c.partition((1024,)), 300_000_000), cs)  # pre-capture work on cs
    free_before = dev.mem_info()[0]
    with trio_cuda.capture_graph(cs) as scope:
        scope.record(trio_cuda.zip(add(z1.partition((8,)), x, y), add(z2.partition((8,)), x, y)))
        del c
        gc.collect()
        await api.zeros((1,))  # another submission: flushes the deferred free of c
    g = scope.graph
    assert g is not None and g.nodes == 2, "work that was not recorded was swallowed into the graph"
    await trio.to_thread.run_sync(settle)  # the pre-capture kernel ends, then the free runs
    assert dev.mem_info()[0] - free_before >= 4 * MB, "the free of c never ran on the device"
    with trio.fail_after(10):
        await g.launch()
        await g.launch()
    assert not dev.is_faulted


def test_stream_synchronize_of_a_capturing_stream_does_not_hang(dev: trio_cuda.Device) -> None:
    # repro_capture_stream_synchronize_hangs: Stream.synchronize() from another thread
    # recorded an event inside the open capture (which never completes) and blocked.
    cs = dev.create_stream()
    x, y, z = api.ones((8,)).sync(), api.ones((8,)).sync(), api.zeros((8,)).sync()
    add(z.partition((8,)), x, y).sync()
    outcome: list[object] = []

    def other() -> None:
        try:
            cs.synchronize()
            outcome.append("returned")
        except trio_cuda.GraphCaptureError as err:  # refusing is fine too
            outcome.append(err)

    with trio_cuda.capture_graph(cs) as scope:
        scope.record(add(z.partition((8,)), x, y))
        th = threading.Thread(target=other, daemon=True)
        th.start()
        th.join(5)
        hung = th.is_alive()
    th.join(5)
    assert not hung, "Stream.synchronize() of the capturing stream blocked"
    assert len(outcome) == 1, outcome
    assert scope.graph is not None and scope.graph.nodes == 1


async def test_device_synchronize_during_a_capture_waits_for_pre_capture_work(dev: trio_cuda.Device) -> None:
    # repro_synchronize_skips_capturing_stream: Device.synchronize() skipped streams in
    # capture mode, so it returned while work enqueued on the capturing stream before the
    # capture still ran.
    cs = dev.create_stream()
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)  # c = 1
    x, z = await api.ones((8,)), await api.zeros((8,))
    await add(z.partition((8,)), x, x)
    pre = await lowlevel.submit(sleep(c.partition((1,)), 500_000_000), cs)  # c = 2 when done
    assert pre.event is not None
    with trio_cuda.capture_graph(cs) as scope:
        scope.record(add(z.partition((8,)), x, x))
        with trio.fail_after(10):
            await trio.to_thread.run_sync(dev.synchronize)
        assert pre.event.query(), "Device.synchronize() returned before pre-capture work on the capturing stream completed"
    assert scope.graph is not None
    np.testing.assert_array_equal(await c.to_host(), [2])


@pytest.mark.faults_device
def test_record_after_a_reset_during_an_open_capture_is_refused_and_runs_nothing(dev: trio_cuda.Device) -> None:
    # repro_reset_during_capture_scope: after a reset (from another thread) the capturing
    # stream was rebound to a fresh driver stream not in capture mode, so record() ran the
    # kernel for real; the scope's exit then rolled the output's writer back, and the next
    # read of it was not ordered after the kernel (torn data).
    n = 4096
    x = api.ones((n,)).sync()
    z = api.zeros((n,)).sync()
    add(z.partition((256,)), x, x).sync()  # compiled before the capture
    refused: list[BaseException] = []
    try:
        with trio_cuda.capture_graph() as scope:
            scope.record(add(z.partition((256,)), x, x))
            in_thread(dev.reset)
            x2, z2 = in_thread(lambda: (api.ones((n,)).sync(), api.zeros((n,)).sync()))
            launches = dev.statistics().launches
            try:
                scope.record(add(z2.partition((256,)), x2, x2))
            except (trio_cuda.DeviceReset, trio_cuda.GraphCaptureError) as err:
                refused.append(err)
    except trio_cuda.DeviceError:
        pass  # closing a capture that the reset ended may say so
    assert len(refused) == 1, "record() after the reset was accepted"
    assert dev.statistics().launches == launches
    np.testing.assert_array_equal(z2.to_host().sync(), np.zeros(n, np.float32))  # not torn
    settle()  # anything that was enqueued has run now
    np.testing.assert_array_equal(z2.to_host().sync(), np.zeros(n, np.float32))  # nothing ran
    np.testing.assert_array_equal(api.full((2,), 3.0).to_host().sync(), [3, 3])


SEC = 1_000_000_000


# -- graphs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["graph()", "scope"])
def test_shared_op_captured_into_a_graph_is_not_done(form: str) -> None:
    # repro_shared_op_captured_is_done: the capture left the shared op Done at a point
    # inside the capture: a later consumer read data the kernel never wrote.
    x = api.full((8,), 1.0).sync()
    y = api.full((8,), 2.0).sync()
    z = api.zeros((8,)).sync()
    add.prepare(z.partition((8,)), x, y)
    sh = add(z.partition((8,)), x, y).shared()
    if form == "graph()":
        graph = sh.graph()
    else:
        with trio_cuda.capture_graph() as scope:
            scope.record(sh)
        assert scope.graph is not None
        graph = scope.graph
    with pytest.raises(trio_cuda.GraphCaptureError, match="captured into a graph"):
        sh.first().unpartition().to_host().sync()
    np.testing.assert_array_equal(z.to_host().sync(), [0.0] * 8)  # nothing ran
    graph.launch().sync()
    np.testing.assert_array_equal(z.to_host().sync(), [3.0] * 8)


async def test_capture_does_not_query_its_own_events(dev: trio_cuda.Device) -> None:
    # repro_cuda_capture_retire_corrupts_copy (CUDA): retiring a capturing stream queried
    # an event recorded inside the capture; the driver refused (and invalidated the
    # capture), the refusal was taken for "done", and the pinned buffer of a pending
    # copy went to another copy before its DMA ran.
    s = dev.create_stream()
    c = await api.zeros((1,), np.int64)
    n = 1 << 20
    t = await api.zeros((n,), np.float32)
    x = await api.full((16,), 1.0)
    z1, z2 = await api.zeros((16,)), await api.zeros((16,))
    await sleep(c.partition((1,)), 1000)
    await add(z1.partition((16,)), x, x)
    await api.from_host(np.zeros(n, np.float32))  # staging pinned
    await lowlevel.submit(sleep(c.partition((1,)), SEC // 2), s)
    await lowlevel.submit(api.memcpy(t, np.full(n, 1.0, np.float32)), s)  # pending behind it
    with trio_cuda.capture_graph(s) as scope:
        scope.record(trio_cuda.zip(add(z1.partition((16,)), x, x), add(z2.partition((16,)), x, x)))
        scope.record(add(z1.partition((16,)), x, x))
    assert scope.graph is not None
    other = dev.create_stream()
    await (await lowlevel.submit(api.from_host(np.full(n, 2.0, np.float32)), other)).wait()  # wants a pinned buffer
    await trio.to_thread.run_sync(dev.synchronize)
    r = await t.to_host()
    assert (r == 1.0).all(), r[:4]
