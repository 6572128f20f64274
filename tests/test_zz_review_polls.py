"""Adversarial review of polls answered from the stream (commit c4f6978)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _device, api, lowlevel, ops
from trio_cuda.kernels import sleep

from .conftest import counter, needs_devices
from .test_adversarial import ready_to_fault, scribble
from .test_stream_polls import fresh_device, wordless_stream  # noqa: F401


@pytest.mark.faults_device
@pytest.mark.sim_only
@needs_devices(2)
@pytest.mark.parametrize("by_stream", [True, False])
async def test_stream_wait_on_another_devices_event_then_failure_does_not_read_done(
    fresh_device: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch, by_stream: bool
) -> None:
    # lowlevel.stream_wait (documented: "an event of any device") enqueues a non-ordering
    # wait straight through the driver; it does not go through Stream.wait_for, so
    # Device._cross_device stays False.
    monkeypatch.setattr(_device, "poll_by_stream", by_stream)
    d0, d1 = fresh_device, trio_cuda.device(1)
    c1, z1 = await ready_to_fault(1)
    with trio_cuda.use_device(1):
        s1 = d1.create_stream()
        await lowlevel.submit(sleep(c1.partition((4,)), 300_000_000), s1)
        e1 = lowlevel.record(s1)
    s0 = wordless_stream(d0)
    y0 = await api.zeros((32,))
    await ops.add(y0, 1.0, out=y0)
    lowlevel.stream_wait(s0, e1)
    assert not d0._cross_device
    failing = await lowlevel.submit(ops.add(y0, 1.0, out=y0), s0)
    good = await lowlevel.submit(api.zeros((8,)), s0)
    with trio_cuda.use_device(1), pytest.raises(trio_cuda.DeviceFault):
        await scribble(z1.partition((32,)))
    assert d1.is_faulted and not d0.is_faulted
    await good.wait()
    ev = failing.event
    assert ev is not None and ev.seq < good.event.seq
    try:
        with pytest.raises(trio_cuda.DeviceFault):
            d0.poll(ev)  # by the stream: True (the failed add reads done)
        with pytest.raises(trio_cuda.DeviceFault):
            await failing.wait()
    finally:
        await trio.to_thread.run_sync(d1.reset)
