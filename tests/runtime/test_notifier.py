"""Completion wake-ups: fast path, slow path (one helper thread), batching, idleness."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _notifier, api, lowlevel
from trio_cuda._forecast import Forecast
from trio_cuda.kernels import sleep

from ..helpers.devices import counter, started


async def test_long_waits_park_on_the_helper_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Work of a duration not learned yet: polled for the budget, then parked.
    monkeypatch.setattr(_notifier, "_forecast", Forecast())
    c = await counter()
    before = lowlevel.notifier_statistics()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_await, sleep(c, 200_000_000))
        # Wait until the task has parked (the helper thread then holds it), not a guess.
        while lowlevel.notifier_statistics().parked == 0:
            await trio.sleep(0.001)
        assert lowlevel.notifier_statistics().parked == 1
    after = lowlevel.notifier_statistics()
    assert after.slow_path == before.slow_path + 1
    assert after.parked == 0
    np.testing.assert_array_equal(await c.to_host(), [1])


async def test_no_thread_per_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_notifier, "_budget_ns", 0)  # every wait parks on the helper thread
    dev = trio_cuda.current_device()
    old = dev.policy
    # A pool at its full size (the simulated device runs a thread per stream).
    dev.policy = pool = trio_cuda.StreamPoolByLoad(dev, num_streams=16, max_streams=16)
    try:
        await _no_thread_per_wait(pool)
    finally:
        dev.policy = old


async def _no_thread_per_wait(pool: trio_cuda.StreamPoolByLoad) -> None:
    for s in pool.streams:  # start every pool stream
        await (await lowlevel.submit(sleep(counter(), 1000), s)).wait()
    await sleep(counter(), 1_000_000)  # and park once, so the helper thread exists
    threads_before = threading.active_count()
    parked_peak = 0
    thread_peak = threads_before
    samples = 0
    longest_gap = 0.0  # (a loop blocked while the waits were parked would hide them)

    async def watch() -> None:
        nonlocal parked_peak, thread_peak, samples, longest_gap
        last = time.perf_counter()
        while True:
            thread_peak = max(thread_peak, threading.active_count())
            parked_peak = max(parked_peak, lowlevel.notifier_statistics().parked)
            samples += 1
            await trio.sleep(0.005)
            now = time.perf_counter()
            longest_gap, last = max(longest_gap, now - last), now

    before = lowlevel.notifier_statistics()
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        async with trio.open_nursery() as waiters:
            for _ in range(40):
                waiters.start_soon(_await, sleep(counter(), 100_000_000))
        nursery.cancel_scope.cancel()
    took = time.perf_counter() - t0
    after = lowlevel.notifier_statistics()
    assert parked_peak >= 10, (
        f"only {parked_peak} waits parked at once: the test lost its point ({before} -> {after}; "
        f"{took:.3f} s, {samples} samples, the longest gap between them {longest_gap * 1000:.1f} ms)"
    )
    # 40 concurrent parked waits, no new thread (the pool's streams and the helper exist).
    assert thread_peak == threads_before


async def test_wakeups_are_batched(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    # Eight waits queued behind one long op on the same stream complete together and are
    # woken in fewer trio callbacks than waits: each callback serves a batch. (Durations
    # not learned yet: the waits park; learned ones would sleep on timers instead.)
    monkeypatch.setattr(_notifier, "_forecast", Forecast())
    policy = trio_cuda.SingleStream(dev)
    slow_before = lowlevel.notifier_statistics().slow_path
    batches_before = lowlevel.notifier_statistics().batches
    async with trio.open_nursery() as nursery:
        await nursery.start(started, sleep(counter(), 200_000_000), policy)
        for i in range(1, 9):
            await nursery.start(started, api.full((1,), i), policy)
    stats = lowlevel.notifier_statistics()
    parked = stats.slow_path - slow_before
    batches = stats.batches - batches_before
    assert parked == 9, f"{parked} of 9 waits parked"
    assert 1 <= batches < 9, f"{batches} batches for 9 parked waits"


async def _await(op: object) -> None:
    await op  # type: ignore[misc]


def _cpu_of_thread(name: str) -> float:
    for t in threading.enumerate():
        if t.name == name and t.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    raise AssertionError(f"no thread {name}")


async def test_idle_runtime_uses_no_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a duration not learned yet: the wait parks and is woken by the completion's post;
    # a wait that slept through it on a timer would see that post arrive afterwards)
    monkeypatch.setattr(_notifier, "_forecast", Forecast())
    await sleep(counter(), 50_000_000)  # parks: the helper thread exists and has worked
    assert lowlevel.notifier_statistics().parked == 0
    before = lowlevel.notifier_statistics().wakeups
    helper_cpu = _cpu_of_thread("trio-cuda-notifier")
    process_cpu = time.process_time()
    await trio.sleep(0.5)
    assert lowlevel.notifier_statistics().wakeups == before, "the helper thread woke up while nothing was in flight"
    assert _cpu_of_thread("trio-cuda-notifier") - helper_cpu < 0.002
    # Nothing else of the runtime spins either (stream workers, janitor).
    assert time.process_time() - process_cpu < 0.05


async def test_cancelled_parked_wait_leaves_no_waiter() -> None:
    c = await counter()
    with trio.move_on_after(0.5) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_await, sleep(c, 2_000_000_000))
            while lowlevel.notifier_statistics().parked == 0:
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught
    # The abandoned waiter leaves the helper's list at its next pass (within 20 ms).
    with trio.fail_after(1):
        while lowlevel.notifier_statistics().parked:
            await trio.sleep(0.005)
    np.testing.assert_array_equal(await c.to_host(), [1])


def _run_child(budget_us: str | None) -> str:
    # 30 awaits of a 1 ms kernel (loaded first, outside the count).
    code = textwrap.dedent(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api, lowlevel
        from trio_cuda.kernels import sleep
        async def main():
            c = await api.zeros((1,), np.int32)
            await sleep(c.partition((1,)), 1000)
            before = lowlevel.notifier_statistics()
            for _ in range(30):
                await sleep(c.partition((1,)), 1_000_000)
            s = lowlevel.notifier_statistics()
            print(s.fast_path - before.fast_path, s.slow_path - before.slow_path, s.sleeping.timed - before.sleeping.timed)
        trio.run(main)
        """
    )
    env = dict(os.environ, TRIO_CUDA_QUIET="1")
    env.pop("TRIO_CUDA_POLL_BUDGET_US", None)
    if budget_us is not None:
        env["TRIO_CUDA_POLL_BUDGET_US"] = budget_us
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_poll_budget_chooses_the_path() -> None:
    # A budget that never ends: all polled (the pure polling wait). No budget: every wait
    # that is not complete at its first poll (a 1 ms kernel never is) parks.
    fast, slow, timed = map(int, _run_child("1e12").split())
    assert (fast, slow, timed) == (30, 0, 0)
    fast, slow, timed = map(int, _run_child("0").split())
    assert (fast, slow, timed) == (0, 30, 0)


def test_long_work_is_slept_through_by_default() -> None:
    # The default (adaptive) wait learns that the kernel takes 1 ms and sleeps through
    # most of each later one, waking before its predicted end.
    fast, slow, timed = map(int, _run_child(None).split())
    assert fast + slow == 30
    assert timed >= 20, f"only {timed} of 30 waits slept"


def test_bad_poll_budget_names_the_variable() -> None:
    code = "import trio, trio_cuda; from trio_cuda import api\nasync def m(): await api.ones((1,))\ntrio.run(m)"
    env = dict(os.environ, TRIO_CUDA_POLL_BUDGET_US="fast", TRIO_CUDA_QUIET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "TRIO_CUDA_POLL_BUDGET_US" in r.stderr


def test_armed_event_posts_the_waker_on_completion(dev: trio_cuda.Device) -> None:
    # The backend contract the slow path relies on: arm() posts the waker once the
    # event completes (on CUDA: a host function that is sem_post), not before.
    from trio_cuda._backends import backend
    from trio_cuda._submission import submit_blocking

    waker = backend().new_waker()
    policy = trio_cuda.SingleStream(dev)
    c = counter().schedule(policy).sync()
    sleep(c, 1000).schedule(policy).sync()  # loaded: the next launch starts at once
    t0 = time.perf_counter()
    plan, _ = submit_blocking(sleep(c, 300_000_000), policy.streams[0])
    ev = plan.event
    assert ev is not None and dev.arm(ev, waker)
    assert not waker.wait(0.1), "posted before the work completed"
    assert waker.wait(10.0), "never posted"
    assert time.perf_counter() - t0 >= 0.25
    assert ev.query()
    np.testing.assert_array_equal(api.memcpy(np.zeros(1, np.int32), c).sync(), [2])


# -- the adaptive wait: sleeping through long work -------------------------------------------


async def _await_n(c: trio_cuda.Partition, ns: int, n: int) -> None:
    # (through lowlevel.submit: its wait learns by the ops' names, whatever the kernel's
    # arguments; a direct await learns per launch geometry and scalars)
    for _ in range(n):
        await (await lowlevel.submit(sleep(c, ns))).wait()


async def test_a_prediction_too_long_is_corrected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_notifier, "_forecast", Forecast())
    c = await counter()
    await _await_n(c, 20_000_000, 4)  # learns 20 ms
    s0 = lowlevel.notifier_statistics().sleeping
    await _await_n(c, 2_000_000, 2)  # the same kernel, much shorter: woken by the completion
    s1 = lowlevel.notifier_statistics().sleeping
    assert s1.early > s0.early
    await _await_n(c, 2_000_000, 6)  # learned: woken by the timer, before the end
    s2 = lowlevel.notifier_statistics().sleeping
    # An estimate left near 20 ms (or shrunk only in steps) never fires its timer before
    # a 2 ms kernel ends; half the waits woken by their timer shows it came down to about
    # 2 ms. (How many of the rest end early depends on how the simulated device's kernel
    # times jitter with the host's load: a kernel that ran long raises the estimate.)
    assert s2.timer_wakes - s1.timer_wakes >= 3, "the estimate did not come down to the work's new length"
    np.testing.assert_array_equal(await c.tensor.to_host(), [12])


async def test_a_timed_sleep_is_cancelled_at_once_and_the_work_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_notifier, "_forecast", Forecast())
    c = await counter()
    await _await_n(c, 50_000_000, 3)  # learns 50 ms: later waits sleep through it
    before = lowlevel.notifier_statistics().sleeping.timed
    with trio.move_on_after(0.01) as scope:
        await _await_n(c, 50_000_000, 1)
    assert scope.cancelled_caught
    # It was sleeping through the work when cancelled (more than once if the host's load
    # made the kernel outlast its prediction: then it sleeps again in shorter steps).
    assert lowlevel.notifier_statistics().sleeping.timed > before
    await _await_n(c, 1000, 1)  # ordered after the abandoned kernel on the counter
    np.testing.assert_array_equal(await c.tensor.to_host(), [5])


@pytest.mark.faults_device
async def test_a_fault_wakes_a_task_sleeping_through_long_work(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    from ..helpers.faults import scribble

    monkeypatch.setattr(_notifier, "_forecast", Forecast())
    target = await api.zeros((32,))
    await trio.to_thread.run_sync(scribble.prepare, target.partition((32,)))
    c = await counter()
    own = trio_cuda.SingleStream(dev)  # the long kernel's stream is not the faulting one
    faulting = trio_cuda.SingleStream(dev)  # (made now: making a stream can wait for running work)
    for _ in range(3):  # learned: the next one sleeps until about 30 ms
        await started(sleep(c, 30_000_000), own)
    before = lowlevel.notifier_statistics().sleeping.timed

    async def long_wait(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with pytest.raises(trio_cuda.DeviceFault):
            await started(sleep(c, 3_000_000_000), own, task_status=task_status)

    start = time.perf_counter()
    async with trio.open_nursery() as n:
        await n.start(long_wait)
        with pytest.raises(trio_cuda.DeviceFault):
            await scribble(target.partition((32,))).schedule(faulting)
    assert lowlevel.notifier_statistics().sleeping.timed > before
    assert time.perf_counter() - start < 2.0, "the sleeping waiter was not woken by the fault"


async def test_long_work_is_slept_through_where_there_is_no_timerfd(monkeypatch: pytest.MonkeyPatch) -> None:
    # Outside Linux the task parks on the notifier with a deadline (its timers): the same
    # learning and wake-ups, counted the same way.
    monkeypatch.setattr(_notifier, "_forecast", Forecast())
    monkeypatch.setattr(_notifier, "_timers", lambda: False)
    c = await counter()
    await _await_n(c, 10_000_000, 3)  # learns 10 ms
    before = lowlevel.notifier_statistics()
    await _await_n(c, 10_000_000, 8)
    after = lowlevel.notifier_statistics()
    assert after.sleeping.timed - before.sleeping.timed >= 6
    assert after.sleeping.timer_wakes - before.sleeping.timer_wakes >= 4
    assert after.parked == 0
    np.testing.assert_array_equal(await c.tensor.to_host(), [11])
