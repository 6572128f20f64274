"""A device's reset, and its end in a forked child (see :meth:`Device.reset`).

The reset first bumps the generation under the runtime lock, so every event, buffer,
graph and waiter of the old generation knows it is stale; wakes every waiter (blocking
and trio) so each raises :class:`DeviceReset`; waits for host reads of pinned memory in
progress and for other devices' copies that read this device's memory; and only then
resets the driver, under the device's slow lock, not the runtime lock: other devices
keep working meanwhile.
"""

from __future__ import annotations

from typing import Any

from ._errors import DeviceError, DeviceUnavailable
from ._guard import LOCK, check_blocking_allowed, check_not_forked

__all__ = ["orphan", "reset"]


def reset(dev: Any) -> None:
    """:meth:`Device.reset` of ``dev`` (plain code only; blocks)."""
    check_blocking_allowed("Device.reset()")
    with LOCK:
        if dev._resetting:
            check_not_forked()
            raise DeviceUnavailable("a reset of this device is already in progress", device=dev.ordinal)
        dev._resetting = True
        dev.generation += 1
        dev._event_pool.clear()
        # Filled lock-free by finalizers (any thread): their work goes with the reset.
        dev._dead_streams.clear()
        dev._dead_graphs.clear()
        # Their driver streams go with the reset (the context's streams all do).
        dev._lingering = []
        dev._bytes_in_use = 0
        wakers = list(dev._blocking)
        callbacks = list(dev._reset_callbacks)
        readers, dev._peer_readers = dev._peer_readers, []
    try:
        for w in wakers:
            w.post()
        for cb in callbacks:
            cb(dev)
        with dev._host_cond:  # host reads of the old generation's pinned memory
            while dev._host_readers:
                dev._host_cond.wait()
        for ev in readers:
            # Copies queued on other devices that read this device's memory: they run
            # before it is released (else the other device reads released memory).
            try:
                ev.device.wait_blocking(ev)
            except DeviceError:
                pass  # that device failed or was reset: its copy will not read
        with dev._slow_lock:
            dev._driver.reset()
    finally:
        with LOCK:
            dev._resetting = False


def orphan(dev: Any) -> None:
    """In a forked child (see _guard): ``dev`` refuses new work for good, as if a reset
    began that never ends, and everything of the parent's generation is stale. The checks
    that refuse work during a reset then raise ForkedProcessError; nothing reaches the
    driver (or waits for a stream thread), housekeeping and the exit hook skip the device,
    and finalizers only queue. Called without LOCK: the child has one thread."""
    dev._resetting = True
    dev.generation += 1
