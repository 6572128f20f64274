"""Completion words: the device writes a ticket into host memory after a submission's
work, and awaits read it instead of asking the driver. A word must never say done
early: not before the work, not after a failure, not for a reused word, not across a
reset."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _notifier, api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import counter, words_only

# The simulated device has completion words unless TRIO_CUDA_COMPLETION_WORDS=0; CUDA only
# with TRIO_CUDA_COMPLETION_WORDS=1 (they cost more than they save there: see
# trio_cuda/_backends/_cuda.py).
pytestmark = words_only


async def test_awaited_work_is_seen_done_through_its_word() -> None:
    dev = trio_cuda.current_device()
    assert dev._flags is not None
    x = await api.zeros((256,))
    s = dev.create_stream()
    done = await lowlevel.submit(ops.add(x, 2.0, out=x), s)
    ev = done.event
    assert ev is not None and ev.flag == s._flag >= 0
    await done.wait()
    assert dev.reached(ev)
    assert dev._flags[ev.flag] >= ev.ticket
    np.testing.assert_array_equal(await x.to_host(), np.full(256, 2.0, np.float32))


async def test_a_word_says_pending_until_the_work_is_done() -> None:
    dev = trio_cuda.current_device()
    c = await counter()
    s = dev.create_stream()
    pending = await lowlevel.submit(sleep(c, 300_000_000), s)  # 0.3 s: still running when checked
    ev = pending.event
    assert ev is not None
    assert not dev.reached(ev)
    later = await lowlevel.submit(sleep(c, 1000), s)  # a later ticket on the same word
    assert later.event is not None and later.event.ticket > ev.ticket
    await later.wait()
    assert dev.reached(ev) and dev.reached(later.event)  # in stream order
    np.testing.assert_array_equal(await c.to_host(), [2])


async def test_tickets_grow_across_streams_and_words_are_taken_back() -> None:
    dev = trio_cuda.current_device()
    x = await api.zeros((64,))
    y = await api.zeros((64,))
    s1 = dev.create_stream()
    first = await lowlevel.submit(ops.add(y, 1.0, out=y), s1)  # y remembers s1 as its writer
    word = s1._flag
    await first.wait()
    assert first.event is not None
    t1 = first.event.ticket
    np.testing.assert_array_equal(await y.to_host(), np.ones(64, np.float32))
    del s1, first, y
    gc.collect()
    await api.zeros((1,))  # housekeeping destroys the dropped stream...
    await trio.to_thread.run_sync(dev.synchronize)  # ...its last work completes...
    await api.zeros((1,))  # ...and the next housekeeping takes its word back
    assert word in dev._flag_free
    s2 = dev.create_stream()
    assert s2._flag == word  # the word is reused...
    second = await lowlevel.submit(ops.add(x, 1.0, out=x), s2)
    assert second.event is not None and second.event.ticket > t1  # ...with later tickets
    await second.wait()
    np.testing.assert_array_equal(await x.to_host(), np.ones(64, np.float32))


async def test_streams_beyond_the_words_ask_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    await trio.to_thread.run_sync(dev.synchronize)
    await api.zeros((1,))  # words of streams dropped earlier are back: none comes back below
    monkeypatch.setattr(dev, "_flag_free", [])
    s = dev.create_stream()
    assert s._flag == -1
    x = await api.zeros((64,))
    done = await lowlevel.submit(ops.add(x, 5.0, out=x), s)
    assert done.event is not None and done.event.flag == -1
    assert not dev.reached(done.event)
    await done.wait()
    assert done.event.done
    np.testing.assert_array_equal(await x.to_host(), np.full(64, 5.0, np.float32))


async def test_a_reset_makes_old_words_say_nothing() -> None:
    dev = trio_cuda.current_device()
    c = await counter()
    s = dev.create_stream()
    pending = await lowlevel.submit(sleep(c, 200_000_000), s)
    ev = pending.event
    assert ev is not None and not dev.reached(ev)
    await trio.to_thread.run_sync(dev.reset)
    assert not dev.reached(ev)  # its generation is over, whatever the word holds
    with pytest.raises(trio_cuda.DeviceReset):
        await pending.wait()
    y = await api.zeros((8,))  # the stream and its word work after the reset
    after = await lowlevel.submit(ops.add(y, 1.0, out=y), s)
    assert after.event is not None and after.event.ticket > ev.ticket
    await after.wait()
    assert dev.reached(after.event)
    np.testing.assert_array_equal(await y.to_host(), np.ones(8, np.float32))


@pytest.mark.sim_only
async def test_a_failed_submission_never_writes_its_word() -> None:
    dev = trio_cuda.current_device()

    @trio_cuda.kernel(sim=lambda x: x[100])  # an illegal access on the simulated device
    def bad(x):  # type: ignore[no-untyped-def]
        pass

    x = await api.zeros((4,))
    s = dev.create_stream()
    failing = await lowlevel.submit(bad(x.partition((4,))), s)
    ev = failing.event
    assert ev is not None
    with pytest.raises(trio_cuda.DeviceFault):
        await failing.wait()
    assert dev._flags is not None and dev._flags[ev.flag] < ev.ticket
    assert not dev.reached(ev)
    await trio.to_thread.run_sync(dev.reset)


async def test_the_spin_path_waits_correctly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_notifier, "_spin_ns", 2_000_000)  # 2 ms: every wait spins
    x = await api.zeros((32,))
    for _ in range(20):
        await ops.add(x, 1.0, out=x)
    np.testing.assert_array_equal(await x.to_host(), np.full(32, 20.0, np.float32))
    c = await counter()
    await sleep(c, 20_000_000)  # longer than the spin: back to the scheduler, then done
    np.testing.assert_array_equal(await c.to_host(), [1])
