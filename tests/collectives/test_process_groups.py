"""ProcessGroup joined through a store (from_store) and from a launcher's environment
(from_env): results against numpy, a rank that never joins or never takes part, the
join's cancellation, a poisoned part, a reset of one rank's device, bad environments.

On the simulated device each rank here is a trio task of this process with a simulated
device of its own, and the store (tests/helpers/stores.py) is the channel, exactly the
path that separate processes take (tests/collectives/test_mpi.py runs them under mpiexec).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, collectives, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import counter, needs_devices
from ..helpers.faults import scribble
from ..helpers.stores import MemoryStore

pytestmark = [needs_devices(3), pytest.mark.sim_only]
RNG = np.random.default_rng(36)


async def joined(store: MemoryStore, n: int, timeout: float = 20.0) -> list[collectives.ProcessGroup]:
    """``n`` ranks of one group, rank r on device r, joined concurrently."""
    groups: list[Any] = [None] * n

    async def one(r: int) -> None:
        groups[r] = await collectives.ProcessGroup.from_store(store, n, r, device=r, timeout=timeout)

    async with trio.open_nursery() as nursery:
        for r in range(n):
            nursery.start_soon(one, r)
    return groups


async def every_rank(n: int, fn: Callable[[int], Awaitable[Any]]) -> list[Any]:
    out: list[Any] = [None] * n

    async def one(r: int) -> None:
        with trio_cuda.use_device(r):
            out[r] = await fn(r)

    async with trio.open_nursery() as nursery:
        for r in range(n):
            nursery.start_soon(one, r)
    return out


async def test_collectives_through_a_store_match_numpy_bitwise_on_every_rank() -> None:
    store = MemoryStore()
    groups = await joined(store, 3)
    assert [(g.rank, g.nranks, g.launcher, g.local_rank) for g in groups] == [(r, 3, "store", r) for r in range(3)]
    arrays = [RNG.uniform(-2, 2, (6, 5)).astype(np.float32) for _ in range(3)]
    ints = [RNG.integers(-9, 9, (7,)).astype(np.int64) for _ in range(3)]

    async def rank(r: int) -> dict[str, np.ndarray]:
        g = groups[r]
        x = await api.from_host(arrays[r], device=r)
        i = await api.from_host(ints[r], device=r)
        out = {"sum": await (await g.all_reduce(ops.multiply(x, 1.0)))[0].to_host()}
        out["max"] = await (await g.all_reduce(i, op="max"))[0].to_host()
        out["avg"] = await (await g.all_reduce(await api.from_host(ints[r], device=r), op="avg"))[0].to_host()
        out["gather"] = await (await g.all_gather(x))[0].to_host()
        out["scatter"] = await (await g.reduce_scatter(x, op="min"))[0].to_host()
        await g.broadcast(x, root=2)
        out["bcast"] = await x.to_host()
        return out

    results = await every_rank(3, rank)
    total = arrays[0] + arrays[1] + arrays[2]  # rank order, as every rank adds
    for r, got in enumerate(results):
        np.testing.assert_array_equal(got["sum"], total)
        np.testing.assert_array_equal(got["max"], np.max(ints, axis=0))
        np.testing.assert_array_equal(got["avg"], np.trunc(np.sum(ints, axis=0) / 3).astype(np.int64))
        np.testing.assert_array_equal(got["gather"], np.concatenate(arrays))
        np.testing.assert_array_equal(got["scatter"], np.min(arrays, axis=0)[2 * r : 2 * r + 2])
        np.testing.assert_array_equal(got["bcast"], arrays[2])
    for g in groups:
        g.close()
    # every payload read was deleted by its last reader: only the joins' counters remain
    assert len(store) == 3


async def test_a_rank_that_never_joins_is_a_timeout_naming_it_on_every_rank() -> None:
    store = MemoryStore()
    errors = await every_rank(2, lambda r: _join_error(store, r))
    for err in errors:
        assert isinstance(err, TimeoutError)
        assert "rank 2 of 3 did not join within 0.3 s" in str(err)


async def _join_error(store: MemoryStore, r: int) -> BaseException | None:
    try:
        await collectives.ProcessGroup.from_store(store, 3, r, device=r, timeout=0.3)
    except TimeoutError as err:
        return err
    return None


async def test_the_join_is_cancellable() -> None:
    """Rank 1 never comes: a cancel ends rank 0's wait at once, long before its timeout,
    and the event loop kept running meanwhile."""
    store = MemoryStore()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        start = trio.current_time()
        with trio.move_on_after(0.3) as scope:
            await collectives.ProcessGroup.from_store(store, 2, 0, device=0, timeout=60)
        nursery.cancel_scope.cancel()
    assert scope.cancelled_caught
    assert trio.current_time() - start < 5
    assert ticks >= 5


async def test_a_cancelled_or_timed_out_join_leaves_nothing_a_later_peer_meets() -> None:
    """Rank 0 gives up before rank 1 comes (cancelled, then timed out): rank 1 must not
    join a group without it, and both ranks' next joins meet."""
    store = MemoryStore()
    with trio.move_on_after(0.2):
        await collectives.ProcessGroup.from_store(store, 2, 0, device=0, timeout=60)
    with pytest.raises(TimeoutError, match="rank 1 of 2 did not join"):
        await collectives.ProcessGroup.from_store(store, 2, 0, device=0, timeout=0.2)
    with pytest.raises(TimeoutError, match="rank 0 of 2 did not join"):
        await collectives.ProcessGroup.from_store(store, 2, 1, device=1, timeout=0.3)
    groups = await joined(store, 2)
    x = [await api.from_host(np.full(4, r + 1.0, np.float32), device=r) for r in range(2)]
    out = await every_rank(2, lambda r: groups[r].all_reduce(x[r]))
    for r in range(2):
        np.testing.assert_array_equal(await out[r][0].to_host(), np.full(4, 3.0, np.float32))


async def test_a_rank_that_never_takes_part_fails_the_others_collective_without_hanging() -> None:
    groups = await joined(store := MemoryStore(), 3, timeout=2.0)
    xs = [await api.from_host(np.full(4, r + 1.0, np.float32), device=r) for r in range(3)]

    async def rank(r: int) -> BaseException | None:
        try:
            await groups[r].all_reduce(xs[r])
        except trio_cuda.DeviceFault as err:
            return err
        return None

    errors = await every_rank(2, rank)  # rank 2 never calls the all-reduce
    for r, err in enumerate(errors):
        assert isinstance(err, trio_cuda.DeviceFault), err
        assert "rank 2 of 3 did not take part within 2 s" in str(err)
        assert not trio_cuda.device(r).is_faulted  # the device keeps working
        np.testing.assert_array_equal(await api.full((2,), 3.0, device=r).to_host(), [3, 3])
    del store


@pytest.mark.faults_device
async def test_a_failed_part_fails_every_rank_naming_it() -> None:
    """Ranks 0 and 1 (devices 0 and 1); rank 1's input is copied from device 2, whose
    kernel faults: rank 1's part carries the failure, and rank 0's result is marked as
    not written, naming rank 1; devices 0 and 1 keep working."""
    groups = await joined(MemoryStore(), 2)
    x0 = await api.from_host(np.ones(32, np.float32), device=0)
    src = await api.from_host(np.ones(32, np.float32), device=2)
    with trio_cuda.use_device(2):
        await sleep(counter(), 1000)
        broken = await trio_cuda.lowlevel.submit(sleep(counter(), 100_000_000).then(lambda _: scribble(src.partition((32,)))))
    errors: dict[int, BaseException] = {}

    async def rank(r: int) -> None:
        try:
            await groups[r].all_reduce(x0 if r == 0 else api.dup(src, device=1))
        except trio_cuda.DeviceFault as err:
            errors[r] = err

    await every_rank(2, rank)
    with pytest.raises(trio_cuda.DeviceFault):
        await broken.wait()
    assert sorted(errors) == [0, 1]
    assert "rank 1's part failed" in str(errors[0]) and "device 2" in str(errors[0])
    with pytest.raises(trio_cuda.DeviceFault, match="rank 1's part failed"):
        await x0.to_host()
    assert not trio_cuda.device(0).is_faulted and not trio_cuda.device(1).is_faulted
    await trio.to_thread.run_sync(trio_cuda.device(2).reset)
    for g in groups:
        g.close()


async def test_a_reset_of_one_ranks_device_fails_the_collective_then_every_rank_joins_again() -> None:
    store = MemoryStore()
    groups = await joined(store, 3, timeout=10.0)
    xs = [await api.from_host(np.full(64, r + 1.0, np.float32), device=r) for r in range(3)]
    with trio_cuda.use_device(1):
        await sleep(counter(), 1000)  # loaded: the next launch is at once
        slow = sleep(counter(), 300_000_000).then(lambda _: ops.multiply(xs[1], 1.0, out=xs[1]))

    async def rank(r: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio_cuda.use_device(r):  # (rank 1's slow op runs on device 1)
            pending = await trio_cuda.lowlevel.submit(groups[r].all_reduce(slow if r == 1 else xs[r]))
        task_status.started()
        try:
            await pending.wait()
        except (trio_cuda.DeviceFault, trio_cuda.DeviceReset) as err:
            failures[r] = err

    failures: dict[int, BaseException] = {}
    async with trio.open_nursery() as nursery:
        for r in range(3):
            await nursery.start(rank, r)
        await trio.to_thread.run_sync(trio_cuda.device(1).reset)  # rank 1's part never runs
    assert sorted(failures) == [0, 1, 2]
    for r in (0, 2):
        assert "rank 1's part failed: device 1 (rank 1) was reset before its part ran" in str(failures[r])
    with pytest.raises(RuntimeError, match="every rank must join a new group"):
        await groups[1].all_reduce(await api.zeros((4,), device=1))
    for g in groups:
        g.close()
    fresh = await joined(store, 3)
    values = await every_rank(3, lambda r: fresh[r].all_reduce(api.full((4,), r + 1.0, device=r)).then(lambda t: t[0].to_host()))
    for v in values:
        np.testing.assert_array_equal(v, [6, 6, 6, 6])


async def test_from_store_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="delete_key"):
        await collectives.ProcessGroup.from_store(object(), 2, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), not 2"):
        await collectives.ProcessGroup.from_store(MemoryStore(), 2, 2)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, not 0"):
        await collectives.ProcessGroup.from_store(MemoryStore(), 2, 0, timeout=0)


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE")
LAUNCHERS += ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_PROCID")


@pytest.mark.parametrize(
    "env,message",
    [
        ({}, "no launcher in the environment: start the program with torchrun"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK, WORLD_SIZE set, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"),
        ({**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer >= 1"),
        ({**TORCHRUN, "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
        ({**TORCHRUN, "LOCAL_RANK": "5"}, "LOCAL_RANK=5 is not below WORLD_SIZE=2"),
        ({**TORCHRUN, "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ],
)
async def test_a_bad_or_partial_environment_names_the_variables(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for k in LAUNCHERS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        await collectives.ProcessGroup.from_env()


async def test_torchruns_environment_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import torch  # noqa: F401

        pytest.skip("torch is installed: its TCPStore would be reached")
    except ImportError:
        pass
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ImportError, match=r"needs torch for its TCPStore at MASTER_ADDR:MASTER_PORT"):
        await collectives.ProcessGroup.from_env()


class FailingStore(MemoryStore):
    """A store that fails once told to (its host gone, say)."""

    broken = False

    def check(self, keys: Sequence[str]) -> bool:
        if self.broken:
            raise ConnectionError("the store's host is gone")
        return super().check(keys)


async def test_a_failing_channel_fails_the_collective_not_the_device() -> None:
    store = FailingStore()
    groups = await joined(store, 2)
    store.broken = True
    errors = await every_rank(2, lambda r: _all_reduce_error(groups[r], r))
    for r, err in enumerate(errors):
        assert isinstance(err, trio_cuda.DeviceFault), err
        assert "the launcher's channel failed: ConnectionError: the store's host is gone" in str(err)
        assert not trio_cuda.device(r).is_faulted


async def _all_reduce_error(g: collectives.ProcessGroup, r: int) -> BaseException | None:
    try:
        await g.all_reduce(api.full((4,), 1.0, device=r))
    except trio_cuda.DeviceFault as err:
        return err
    finally:
        g.close()
    return None
