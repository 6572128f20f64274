"""Completion: an event never reads "done" before the work it stands for is done, across
dropped and reused streams, failures, resets and captures (regressions found by an
adversarial review)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _notifier, api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.data import f32
from ..helpers.devices import counter, needs_devices
from ..helpers.faults import scribble


async def test_an_event_of_a_dropped_stream_is_not_done_while_its_work_runs() -> None:
    dev = trio_cuda.current_device()
    x = await api.zeros((8,))
    await ops.add(x, 1.0, out=x)  # loaded now: on CUDA, loading a module waits for running kernels
    xs = [await api.zeros((8,)) for _ in range(8)]  # allocated now, before memory is freed behind the sleep
    c = await counter()
    # Nine streams made and dropped before the sleep: on CUDA, making a stream can wait for
    # the work running on the device while the driver grows its stream resources; the
    # streams made after the drop below reuse what these leave.
    warm = [dev.create_stream() for _ in range(9)]
    del warm
    gc.collect()
    await ops.add(x, 0.0, out=x)  # (the housekeeping destroys them)
    s1 = dev.create_stream()
    pending = await lowlevel.submit(sleep(c, 2_000_000_000), s1)  # about 2 s of device time
    ev = pending.event
    assert ev is not None
    del pending, c
    # drop the stream (its pending work still runs); submissions that allocate nothing
    # run the housekeeping, which keeps it until that work is done
    del s1
    for _ in range(3):
        gc.collect()
        await ops.add(x, 0.0, out=x)
    streams = [dev.create_stream() for _ in range(8)]
    # Independent work on each new stream, completing while the sleep runs.
    # Measured on an H200: the first stream created after the drop can share the dropped
    # stream's hardware queue, so its work waits for the sleep; the others run at once.
    # The check needs one of them done (fewer hardware queues, fewer done).
    subs = [await lowlevel.submit(ops.add(xs[i], 1.0, out=xs[i]), s2) for i, s2 in enumerate(streams)]
    finished: list[int] = []
    enough = trio.Event()

    async def waiter(i: int, sub: Any) -> None:
        await sub.wait()
        finished.append(i)
        enough.set()  # one new stream's later work done is what the check needs

    async with trio.open_nursery() as nursery:
        for i, sub in enumerate(subs):
            nursery.start_soon(waiter, i, sub)
        with trio.fail_after(1.5):
            await enough.wait()
        nursery.cancel_scope.cancel()  # the rest: their work goes on
    assert finished  # later work on other streams completed
    assert not dev._driver.query(ev.handle), "test setup: the sleep should still run"
    try:
        assert not dev.poll(ev), "the old stream's event reads done while its work still runs"
    finally:
        await trio.to_thread.run_sync(dev.synchronize)
    assert dev.poll(ev)


@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
async def test_a_failed_submission_does_not_read_done_after_a_later_success_on_its_stream() -> None:
    d0 = trio_cuda.device(0)
    t1 = await api.zeros((32,), device=1)
    with trio_cuda.use_device(1):
        await sleep(counter(), 1000)
        bad = sleep(counter(), 100_000_000).then(lambda _: scribble(t1.partition((32,))))
        pending1 = await lowlevel.submit(bad)
    s0 = d0.create_stream()
    y0 = await api.zeros((32,))
    # on device 0: a copy that waits for device 1's writer (fails), then a good op
    failing = await lowlevel.submit(api.dup(t1, device=0), s0)
    good = await lowlevel.submit(ops.add(y0, 1.0, out=y0), s0)
    await good.wait()
    ev = failing.event
    assert ev is not None
    with pytest.raises(trio_cuda.DeviceFault):
        d0._driver.query(ev.handle)  # the driver: this submission failed
    assert not d0.is_faulted
    with pytest.raises(trio_cuda.DeviceFault):
        d0.poll(ev)  # the first submission failed: its event must carry the fault
    with pytest.raises(trio_cuda.DeviceFault):
        await failing.wait()
    with pytest.raises(trio_cuda.DeviceFault):
        await pending1.wait()
    await trio.to_thread.run_sync(trio_cuda.device(1).reset)


async def test_events_never_read_done_before_their_work_over_many_streams() -> None:
    dev = trio_cuda.current_device()
    for _rnd in range(4):
        streams = [dev.create_stream() for _ in range(20)]
        evs = []
        c = await counter()
        for i, s in enumerate(streams):
            p = await lowlevel.submit(sleep(c, 1000 if i % 2 else 40_000_000), s)
            evs.append(p.event)
        del streams, s, p
        gc.collect()
        await api.zeros((1,))
        # new streams (reusing the dropped ones' event handles); their quick work completes
        fresh_streams = [dev.create_stream() for _ in range(20)]
        y = await api.zeros((4,))
        for s in fresh_streams:
            await (await lowlevel.submit(ops.add(y, 1.0, out=y), s)).wait()
        for ev in evs:
            truth = dev._driver.query(ev.handle)
            if dev.poll(ev):
                assert dev._driver.query(ev.handle) or truth, "done read before the work finished"
        await trio.to_thread.run_sync(dev.synchronize)
        del fresh_streams, s


@pytest.mark.faults_device
async def test_reset_in_another_thread_during_waits() -> None:
    dev = trio_cuda.current_device()
    c = await counter()
    s = dev.create_stream()
    evs = []
    for _ in range(5):
        evs.append((await lowlevel.submit(sleep(c, 500_000_000), s)).event)
    outcomes: list[str] = []

    async def waiter(ev) -> None:  # type: ignore[no-untyped-def]
        try:
            from trio_cuda._notifier import wait_event

            await wait_event(ev)
            outcomes.append("done")
        except trio_cuda.DeviceReset:
            outcomes.append("reset")

    async with trio.open_nursery() as n:
        for ev in evs:
            n.start_soon(waiter, ev)
        await trio.lowlevel.checkpoint()
        await trio.to_thread.run_sync(dev.reset)
    # The device was reset while the sleeps ran: nothing after the reset may say done
    # unless its work had really completed before it (the first 0.5 s sleep at most).
    assert outcomes.count("done") <= 1, outcomes
    y = await api.zeros((4,))
    await (await lowlevel.submit(ops.add(y, 1.0, out=y), s)).wait()
    for ev in evs:
        if not ev.done:  # (seen done before the reset: it stays done)
            with pytest.raises(trio_cuda.DeviceReset):
                dev.poll(ev)  # of the generation before the reset


async def test_a_graph_launch_waits_for_its_work(dev: trio_cuda.Device) -> None:
    c = await counter()
    x = await api.zeros((8,))
    g = sleep(c, 30_000_000).then(lambda _: ops.add(x, 1.0, out=x)).graph()
    for k in range(3):
        await g.launch()  # not done before the sleep and the add
        np.testing.assert_array_equal(await x.to_host(), np.full(8, k + 1.0, np.float32))


async def test_multi_step_recipes_strided_inputs_and_outputs_of_gemms() -> None:
    hx, hw, hb = f32(6, 4), f32(5, 4), f32(5)
    x, w, b = await api.from_host(hx), await api.from_host(hw), await api.from_host(hb)
    big = await api.zeros((6, 10))
    bigm = await api.zeros((10, 6))
    for _ in range(4):
        # a non-contiguous x (copied first) and a strided out= (computed, then copied)
        await ops.linear(x[::-1], w, b, activation="relu", out=big[:, ::2])
        want = np.maximum(hx[::-1] @ hw.T + hb, 0)
        np.testing.assert_allclose((await big.to_host())[:, ::2], want, rtol=1e-5, atol=1e-5)
        await ops.matmul(w, x.T, out=bigm[::2, :])
        np.testing.assert_allclose((await bigm.to_host())[::2, :], hw @ hx.T, rtol=1e-5, atol=1e-5)
        r = await ops.linear(x.T.T, w)
        np.testing.assert_allclose(await r.to_host(), hx @ hw.T, rtol=1e-5, atol=1e-5)


async def test_zero_size_tensors_replay() -> None:
    e = await api.zeros((0,))
    e2 = await api.zeros((3, 0))
    for _ in range(3):
        r = await ops.add(e, 1.0)
        assert r.shape == (0,)
        s = await ops.sum(e2, axis=1)
        np.testing.assert_array_equal(await s.to_host(), np.zeros(3, np.float32))
        s0 = await ops.sum(e2, axis=0)
        assert s0.shape == (0,)


async def test_the_spin_path_waits_correctly(monkeypatch: pytest.MonkeyPatch) -> None:
    # After a pending poll an await polls on without yielding (20 us on CUDA, none on the
    # simulated device): such waits are correct and count as spins. The simulated
    # device's kernels finish on a thread that needs the GIL, which a spinning task gives
    # up only at the interpreter's switch interval (5 ms): hence spins of 0.2 s here,
    # with kernels of 2 ms, pending at the first poll (and first: the wait has learned
    # nothing of this kernel to be long).
    monkeypatch.setattr(_notifier, "_spin_ns", 200_000_000)
    monkeypatch.setattr(_notifier, "_budget_ns", 400_000_000)
    c = await counter()
    before = lowlevel.notifier_statistics()
    for _ in range(3):
        await sleep(c, 2_000_000)
    after = lowlevel.notifier_statistics()
    assert after.spins - before.spins >= 2  # (one may find its kernel done at once on a loaded host)
    x = await api.zeros((32,))
    for _ in range(20):
        await ops.add(x, 1.0, out=x)
    np.testing.assert_array_equal(await x.to_host(), np.full(32, 20.0, np.float32))
    monkeypatch.setattr(_notifier, "_spin_ns", 2_000_000)
    await sleep(c, 20_000_000)  # longer than the spin: back to the scheduler, then done
    monkeypatch.setattr(_notifier, "_spin_ns", 0)
    spins = lowlevel.notifier_statistics().spins
    for _ in range(3):
        await sleep(c, 2_000_000)
    assert lowlevel.notifier_statistics().spins == spins  # no spin time: no spins
    np.testing.assert_array_equal(await c.to_host(), [7])
