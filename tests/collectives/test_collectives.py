"""trio_cuda.collectives: results against numpy, ordering with other ops, bad input,
captures, faults and resets (NCCL on CUDA, emulated across simulated devices)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, collectives, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import ON_CUDA, counter, needs_devices
from ..helpers.faults import scribble

pytestmark = needs_devices(2)
RNG = np.random.default_rng(11)


def group() -> collectives.Group:
    return collectives.Group(list(range(trio_cuda.device_count())))


async def per_device(arrays: list[np.ndarray]) -> list[trio_cuda.Tensor]:
    return [await api.from_host(a, device=i) for i, a in enumerate(arrays)]


def data(n: int, shape: tuple[int, ...], dtype: type) -> list[np.ndarray]:
    if np.dtype(dtype).kind == "f":
        return [RNG.uniform(-2, 2, shape).astype(dtype) for _ in range(n)]
    return [RNG.integers(1, 5, shape).astype(dtype) for _ in range(n)]


REDUCE = {
    "sum": lambda xs: np.sum(xs, axis=0),
    "prod": lambda xs: np.prod(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
    "min": lambda xs: np.min(xs, axis=0),
}


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "avg"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float16])
async def test_all_reduce_in_place(op: str, dtype: type) -> None:
    g = group()
    arrays = data(g.size, (5, 7), dtype)
    ts = await per_device(arrays)
    result = await g.all_reduce(ts, op=op)
    assert all(r is t for r, t in zip(result, ts, strict=True))  # in place
    want = np.sum(arrays, axis=0) / g.size if op == "avg" else REDUCE[op](arrays)
    if op == "avg" and np.dtype(dtype).kind == "i":
        want = np.sum(arrays, axis=0) // g.size
    for t in ts:
        got = await t.to_host()
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2 if dtype == np.float16 else 1e-6)


async def test_broadcast_all_gather_reduce_scatter() -> None:
    g = group()
    n = g.size
    arrays = data(n, (2 * n, 3), np.float32)
    ts = await per_device(arrays)
    gathered = await g.all_gather(ts)
    for i, t in enumerate(gathered):
        assert t.device is g.devices[i] and t.shape == (2 * n * n, 3)
        np.testing.assert_array_equal(await t.to_host(), np.concatenate(arrays))
    parts = await g.reduce_scatter(ts, op="max")
    full = np.max(arrays, axis=0)
    for i, t in enumerate(parts):
        assert t.shape == (2, 3)
        np.testing.assert_array_equal(await t.to_host(), full[2 * i : 2 * i + 2])
    outs = [await api.empty((2, 3), device=i) for i in range(n)]
    parts2 = await g.reduce_scatter(ts, out=outs)
    assert all(p is o for p, o in zip(parts2, outs, strict=True))
    np.testing.assert_allclose(await outs[-1].to_host(), np.sum(arrays, axis=0)[-2:], rtol=1e-6)
    await g.broadcast(ts, root=n - 1)
    for t in ts:
        np.testing.assert_array_equal(await t.to_host(), arrays[-1])


async def test_inputs_can_be_ops_and_the_collective_composes_lazily() -> None:
    """Ops as inputs, the collective inside a larger DAG awaited once: the all_reduce
    waits for the writes before it, and the reads after it see its result."""
    g = group()
    arrays = data(g.size, (64,), np.float32)
    ts = await per_device(arrays)
    doubled = [ops.multiply(t, 2.0, out=t) for t in ts]  # lazy writes into the inputs
    op = g.all_reduce(doubled).then(lambda r: ops.add(r[0], 1.0))
    got = await op.to_host()
    np.testing.assert_allclose(got, 2 * np.sum(arrays, axis=0) + 1, rtol=1e-5)


async def test_ordered_with_ops_submitted_by_other_tasks() -> None:
    """Writes submitted earlier on other streams (not awaited) come before the
    collective; a write submitted after it waits for the collective's read."""
    g = group()
    n = g.size
    ts = await per_device([np.zeros(1 << 16, np.float32) for _ in range(n)])
    from trio_cuda import lowlevel

    pendings = []
    for i, t in enumerate(ts):
        dev = g.devices[i]
        pendings.append(await lowlevel.submit(ops.add(t, float(i + 1), out=t), dev.create_stream()))
    gathered = g.all_gather(ts)
    after = [ops.multiply(t, 0.0, out=t) for t in ts]  # must wait for the gather's reads
    result = await trio_cuda.zip(gathered, *after)
    want = np.concatenate([np.full(1 << 16, i + 1, np.float32) for i in range(n)])
    np.testing.assert_array_equal(await result[0][0].to_host(), want)
    for p in pendings:
        await p.wait()
    for t in ts:
        assert not (await t.to_host()).any()


async def test_concurrent_collectives_from_many_tasks() -> None:
    g = group()
    n = g.size
    results: dict[int, np.ndarray] = {}
    arrays = {k: data(n, (33,), np.float64) for k in range(8)}

    async def one(k: int) -> None:
        ts = await per_device(arrays[k])
        await g.all_reduce(ts)
        results[k] = await ts[k % n].to_host()

    async with trio.open_nursery() as nursery:
        for k in range(8):
            nursery.start_soon(one, k)
    for k in range(8):
        np.testing.assert_allclose(results[k], np.sum(arrays[k], axis=0), rtol=1e-12)


async def test_bad_input_is_refused_before_any_work() -> None:
    g = group()
    n = g.size
    ts = await per_device(data(n, (4, 4), np.float32))
    with pytest.raises(ValueError, match="tensors for a group"):
        g.all_reduce(ts[:1])
    with pytest.raises(ValueError, match="rank 0's tensor is on device"):
        g.all_reduce(list(reversed(ts)))
    other = await api.zeros((3,), device=n - 1)
    with pytest.raises(ValueError, match="one shape and dtype"):
        g.all_reduce([*ts[:-1], other])
    with pytest.raises(ValueError, match="C-contiguous"):
        g.all_reduce([t.T for t in ts])
    with pytest.raises(ValueError, match="op must be"):
        g.all_reduce(ts, op="mean")
    with pytest.raises(ValueError, match="root"):
        g.broadcast(ts, root=n)
    with pytest.raises(ValueError, match="equal parts"):
        g.reduce_scatter([await api.zeros((n + 1,), device=i) for i in range(n)])
    with pytest.raises(TypeError, match="not supported"):
        g.all_reduce([await api.zeros((2,), np.bool_, device=i) for i in range(n)])
    bigs = [await api.zeros((4 * n, 4), device=i) for i in range(n)]
    with pytest.raises(ValueError, match="overlaps"):
        g.all_gather([b[:4] for b in bigs], out=bigs)
    with pytest.raises(TypeError, match="one tensor per device"):
        g.all_reduce(ts[0])
    with pytest.raises(ValueError, match="appears twice"):
        collectives.Group([0, 0])
    # nothing ran: the tensors keep their values
    for t, a in zip(ts, [await t.to_host() for t in ts], strict=True):
        np.testing.assert_array_equal(await t.to_host(), a)


async def test_an_input_op_with_the_wrong_shape_fails_at_planning() -> None:
    g = group()
    ts = await per_device(data(g.size, (4,), np.float32))
    bad = [ts[0], *(api.zeros((5,), device=i) for i in range(1, g.size))]
    with pytest.raises(ValueError, match="one shape and dtype"):
        await g.all_reduce(bad)
    np.testing.assert_array_equal((await ts[0].to_host()).shape, (4,))


async def test_collectives_are_not_captured() -> None:
    g = group()
    ts = await per_device(data(g.size, (4,), np.float32))
    with pytest.raises(trio_cuda.GraphCaptureError, match="captured"):
        g.all_reduce(ts).graph()


async def test_bfloat16_and_zero_size() -> None:
    g = group()
    n = g.size
    ts = await per_device([np.full(8, i + 1, np.float32) for i in range(n)])
    bf = [await t.astype("bfloat16") for t in ts]
    await g.all_reduce(bf)
    np.testing.assert_array_equal(await bf[0].astype(np.float32).to_host(), np.full(8, n * (n + 1) / 2, np.float32))
    empty = [await api.zeros((0, 3), device=i) for i in range(n)]
    assert [t.shape for t in await g.all_gather(empty)] == [(0, 3)] * n


async def test_after_a_reset_the_group_works_again() -> None:
    g = group()
    ts = await per_device(data(g.size, (4,), np.float32))
    await g.all_reduce(ts)
    await trio.to_thread.run_sync(g.devices[-1].reset)
    arrays = data(g.size, (4,), np.float32)
    ts = await per_device(arrays)
    await g.all_reduce(ts)
    np.testing.assert_allclose(await ts[-1].to_host(), np.sum(arrays, axis=0), rtol=1e-6)


@pytest.mark.faults_device
@pytest.mark.sim_only
async def test_a_peer_faulting_before_its_part_fails_the_collective_without_hanging() -> None:
    """Device 1 faults in a kernel the collective waits for: its part never runs. The
    other ranks give up instead of waiting forever: their results are marked as not
    written, the await raises the fault, and device 0 keeps working."""
    g = collectives.Group([0, 1])
    ts = await per_device(data(2, (32,), np.float32))
    with trio_cuda.use_device(1):
        await sleep(counter(), 1000)  # loaded
        bad = sleep(counter(), 100_000_000).then(lambda _: scribble(ts[1].partition((32,))))
        pending = await trio_cuda.lowlevel.submit(bad)
    with pytest.raises(trio_cuda.DeviceFault):
        await g.all_reduce(ts)  # enqueued while device 1 is still healthy
    with pytest.raises(trio_cuda.DeviceFault):
        await pending.wait()
    assert g.devices[1].is_faulted and not g.devices[0].is_faulted
    with pytest.raises(trio_cuda.DeviceFault, match=r"did not write|faulted"):
        await ts[0].to_host()
    np.testing.assert_array_equal(await api.full((3,), 2.0).to_host(), [2, 2, 2])
    await trio.to_thread.run_sync(g.devices[1].reset)
    fresh = await per_device([np.ones(4, np.float32), np.ones(4, np.float32)])
    await g.all_reduce(fresh)
    np.testing.assert_array_equal(await fresh[1].to_host(), [2, 2, 2, 2])


@pytest.mark.sim_only
def test_process_groups_need_cuda() -> None:
    with pytest.raises(trio_cuda.LaunchError, match="multi-process"):
        collectives.unique_id()


RANK = textwrap.dedent(
    """
    import sys
    import numpy as np
    import trio
    import trio_cuda
    from trio_cuda import api, collectives

    async def main(rank: int, blob: bytes) -> None:
        group = await collectives.ProcessGroup.join(blob, 2, rank, device=rank)
        x = await api.from_host(np.full(1000, rank + 1.0, np.float32), device=rank)
        await group.all_reduce(x)
        g = await group.all_gather(x)
        assert (await x.to_host() == 3.0).all()
        assert (await g[0].to_host() == 3.0).all() and g[0].shape == (2000,)
        group.close()
        print("rank", rank, "ok")

    trio.run(main, int(sys.argv[1]), bytes.fromhex(sys.argv[2]))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA and NCCL")
def test_two_processes_all_reduce_through_a_unique_id() -> None:
    blob = collectives.unique_id().hex()
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), blob], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {r} ok" in out, out + err[-3000:]


async def test_a_cancelled_wait_leaves_the_collective_running_and_ordered() -> None:
    """A cancel before the await submits nothing; a cancel while the submission waits
    returns at once, the collective still runs (it was enqueued), and later reads of its
    tensors are ordered after it."""
    g = group()
    arrays = data(g.size, (1 << 12,), np.float32)
    ts = await per_device(arrays)
    with trio.CancelScope() as scope:
        scope.cancel()
        await g.all_reduce(ts)
    assert scope.cancelled_caught
    np.testing.assert_array_equal(await ts[0].to_host(), arrays[0])  # nothing ran
    with trio_cuda.use_device(g.devices[0]):
        await sleep(counter(), 1000)  # loaded: the next launch is at once
        slow = sleep(counter(), 300_000_000).then(lambda _: ops.multiply(ts[0], 1.0, out=ts[0]))
    with trio.move_on_after(0.05) as scope:
        await g.all_reduce([slow, *ts[1:]])  # waits behind a 0.3 s kernel on device 0
    assert scope.cancelled_caught
    for t in ts:
        np.testing.assert_allclose(await t.to_host(), np.sum(arrays, axis=0), rtol=1e-6)


# -- found by an adversarial review ------------------------------------------------------------------
async def test_a_closed_group_is_refused_before_its_inputs_run() -> None:
    g = group()
    ts = await per_device([np.full(4, 2.0, np.float32) for _ in range(g.size)])
    g.close()
    with pytest.raises(RuntimeError, match="closed"):
        g.all_reduce([ops.multiply(t, 10.0, out=t) for t in ts])
    np.testing.assert_array_equal(await ts[0].to_host(), [2, 2, 2, 2])


async def test_avg_truncates_integers_toward_zero_and_does_not_overflow_halves() -> None:
    g = collectives.Group([0, 1])
    ints = await per_device([np.array([-1, 3, -3], np.int32), np.array([0, 0, 0], np.int32)])
    await g.all_reduce(ints, op="avg")
    np.testing.assert_array_equal(await ints[0].to_host(), [0, 1, -1])  # trunc(sum / n), as NCCL
    halves = await per_device([np.full(2, 40000.0, np.float16)] * 2)
    await g.all_reduce(halves, op="avg")
    np.testing.assert_array_equal(await halves[1].to_host(), np.full(2, 40000.0, np.float16))


@pytest.mark.sim_only
async def test_a_reset_during_a_collective_fails_it_without_faulting_or_hanging_the_others() -> None:
    g = collectives.Group([0, 1])
    ts = await per_device([np.full(32, 1.0, np.float32), np.full(32, 2.0, np.float32)])
    with trio_cuda.use_device(1):
        await sleep(counter(), 1000)
        slow = sleep(counter(), 300_000_000).then(lambda _: ops.multiply(ts[1], 1.0, out=ts[1]))
    failed: list[BaseException] = []

    async def collective(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with trio.fail_after(20):
                await _submit_and_signal(g, ts, slow, task_status)
        except (trio_cuda.DeviceReset, trio_cuda.DeviceFault) as err:
            failed.append(err)

    async with trio.open_nursery() as nursery:
        await nursery.start(collective)  # enqueued: rank 0 arrives, rank 1 waits behind 0.3 s
        await trio.to_thread.run_sync(g.devices[0].reset)
    assert failed, "the collective reports the reset"
    assert not g.devices[1].is_faulted
    np.testing.assert_array_equal(await api.full((3,), 2.0, device=1).to_host(), [2, 2, 2])
    fresh = await per_device([np.ones(4, np.float32), np.ones(4, np.float32)])
    await g.all_reduce(fresh)  # the group works again, and a full rewrite clears old marks
    np.testing.assert_array_equal(await fresh[0].to_host(), [2, 2, 2, 2])


async def _submit_and_signal(g: collectives.Group, ts: list, slow: object, task_status: trio.TaskStatus[None]) -> None:
    pending = await trio_cuda.lowlevel.submit(g.all_reduce([ts[0], slow]))
    task_status.started()
    await pending.wait()


async def test_communicators_of_a_reset_device_are_dropped_not_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a reset of one of its devices the group makes new communicators and drops the
    old ones without releasing them through the backend: NCCL's destroy of a communicator
    whose context a reset took ended the process (segmentation fault, 2 x H200,
    2026-11-30). Live ones are released by close()."""
    from trio_cuda._backends import backend

    released: list[Any] = []
    real = type(backend()).close_communicators
    monkeypatch.setattr(
        type(backend()), "close_communicators", lambda self, comms: (released.append(comms), real(self, comms))[1]
    )
    g = group()
    ts = await per_device(data(g.size, (4,), np.float32))
    await g.all_reduce(ts)
    old = g._comms
    await trio.to_thread.run_sync(g.devices[-1].reset)
    arrays = data(g.size, (4,), np.float32)
    ts = await per_device(arrays)
    await g.all_reduce(ts)
    np.testing.assert_allclose(await ts[0].to_host(), np.sum(arrays, axis=0), rtol=1e-6)
    assert g._comms is not old and released == []  # the stale ones were dropped
    live = g._comms
    g.close()
    assert released == [live]  # the live ones were released
    # a reset after the last collective: close() drops what the reset took
    g2 = group()
    await g2.all_reduce(await per_device(data(g2.size, (4,), np.float32)))
    await trio.to_thread.run_sync(g2.devices[0].reset)
    g2.close()
    assert released == [live]


# -- the group found at planning; communicators made outside the runtime lock ----------------
async def test_a_group_closed_while_its_collective_waits_for_pinned_memory_still_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DAG of a host copy and an all-reduce waits for pinned memory (the pinning is held
    at a gate); the group is closed meanwhile from another task. The planned collective
    keeps the group's communicators: it runs with the copy, correctly, and they are
    released once it was enqueued; the closed group refuses new collectives."""
    from trio_cuda._backends import backend

    g = collectives.Group([0, 1])
    await g.all_reduce(await per_device(data(2, (4,), np.float32)))  # communicators made
    released = threading.Event()
    real_close = type(backend()).close_communicators
    monkeypatch.setattr(type(backend()), "close_communicators", lambda self, comms: (real_close(self, comms), released.set())[0])
    pinning, gate = threading.Event(), threading.Event()
    driver_type = type(backend().driver(0))
    real_alloc = driver_type.host_alloc

    def gated(self: Any, size: int) -> Any:
        pinning.set()
        gate.wait(30)
        return real_alloc(self, size)

    monkeypatch.setattr(driver_type, "host_alloc", gated)
    # a copy larger than the staging pool keeps idle (64 MiB): it always pins anew
    n = 17 << 20
    host = RNG.uniform(-2, 2, n).astype(np.float32)
    x0 = await api.zeros((n,), device=0)
    x1 = await api.full((n,), 1.0, device=1)
    staging_waits = lowlevel.submission_statistics().waited_for_staging
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_all_reduce, g, [api.memcpy(x0, host), x1])
            assert await trio.to_thread.run_sync(pinning.wait, 30), "the submission did not wait for pinned memory"
            g.close()  # while the submission holds the group
            assert not released.is_set()
            gate.set()
    finally:
        gate.set()
    assert lowlevel.submission_statistics().waited_for_staging > staging_waits
    np.testing.assert_array_equal(await x0.to_host(), host + 1.0)
    np.testing.assert_array_equal(await x1.to_host(), host + 1.0)
    assert await trio.to_thread.run_sync(released.wait, 30)  # released after the collective
    with pytest.raises(RuntimeError, match="closed"):
        g.all_reduce([x0, x1])


async def _all_reduce(g: collectives.Group, tensors: list[Any]) -> None:
    with trio.fail_after(60):
        await g.all_reduce(tensors)


async def test_communicators_are_made_outside_the_runtime_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's first collective waits for its communicators (NCCL's setup is slow, and
    a join blocks until every rank has joined): made with the runtime lock free (another
    thread takes it meanwhile), in a worker thread for await and in the calling thread
    for sync()."""
    from trio_cuda._backends import backend
    from trio_cuda._guard import LOCK

    made: list[tuple[bool, threading.Thread]] = []
    real = type(backend()).communicators

    def watched(self: Any, drivers: Any) -> Any:
        took: list[bool] = []

        def take() -> None:
            took.append(LOCK.acquire(timeout=2))
            if took[0]:
                LOCK.release()

        other = threading.Thread(target=take)
        other.start()
        other.join()
        made.append((took[0], threading.current_thread()))
        return real(self, drivers)

    monkeypatch.setattr(type(backend()), "communicators", watched)
    before = lowlevel.submission_statistics()
    arrays = data(2, (8,), np.float32)
    ts = await per_device(arrays)
    g = collectives.Group([0, 1])
    await g.all_reduce(ts)
    assert len(made) == 1 and made[0][0], "the runtime lock was held while the communicators were made"
    assert made[0][1] is not threading.current_thread()  # a worker thread, not the trio thread
    np.testing.assert_allclose(await ts[0].to_host(), np.sum(arrays, axis=0), rtol=1e-6)
    g2 = collectives.Group([0, 1])

    def sync() -> threading.Thread:
        g2.all_reduce(ts).sync()
        return threading.current_thread()

    caller = await trio.to_thread.run_sync(sync)
    assert len(made) == 2 and made[1] == (True, caller)
    assert lowlevel.submission_statistics().waited_for_communicators == before.waited_for_communicators + 2
    np.testing.assert_allclose(await ts[1].to_host(), 2 * np.sum(arrays, axis=0), rtol=1e-6)
    g.close()
    g2.close()
