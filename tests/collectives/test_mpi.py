"""ProcessGroup across processes started by mpiexec (mpi4py and an MPI from PyPI: the
test extra's mpich), each process with its own device: results against numpy, a
cancelled await, a reset of one rank's device, a rank that dies, a rank that never
joins (the documented commands: test_launch_commands.py). On the simulated device MPI carries the data; on
CUDA, NCCL (with one GPU per rank: the 3-rank programs need 3 GPUs there)."""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import trio_cuda

try:
    import mpi4py  # noqa: F401

    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False

# the mpiexec of the environment first (the mpich wheel puts it beside python)
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
pytestmark = [
    pytest.mark.skipif(not HAVE_MPI4PY, reason="needs mpi4py (pip install 'trio-cuda[mpi]')"),
    pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)"),
]
ON_SIM = trio_cuda.backend_name() == "sim"


def mpiexec(n: int, args: list[str], *, flags: tuple[str, ...] = (), timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["TRIO_CUDA_SIM_DEVICES"] = "1"  # a device per process
    assert MPIEXEC is not None
    return subprocess.run([MPIEXEC, *flags, "-n", str(n), *args], capture_output=True, text=True, timeout=timeout, env=env)


@functools.cache
def _singleton_starts(env_items: frozenset[tuple[str, str]]) -> bool:
    code = "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 1"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=dict(env_items))
    return r.returncode == 0


def _singleton_mpi_starts(env: dict[str, str]) -> bool:
    """Whether mpi4py's MPI starts in a process not launched by mpiexec (MPICH's does;
    an Open MPI without ssh/rsh on the machine aborts the process)."""
    return _singleton_starts(frozenset(env.items()))


def program(tmp_path: pathlib.Path, source: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


COLLECTIVES = """
    import numpy as np
    import trio
    import trio_cuda
    from trio_cuda import api, collectives, lowlevel, ops
    from trio_cuda.kernels import sleep

    def counter():
        return api.zeros((1,), np.int32).partition((1,))

    async def main() -> None:
        g = await collectives.ProcessGroup.from_env(timeout=60)  # (a loaded machine's start)
        r, n = g.rank, g.nranks
        assert (g.launcher, g.local_rank, g.devices[0]) == ("mpi", r, trio_cuda.device(0)), g
        arrays = [np.random.default_rng(k).uniform(-2, 2, (2 * n, 3)).astype(np.float32) for k in range(n)]
        ints = [np.random.default_rng(10 + k).integers(-50, 50, 5) for k in range(n)]
        x = await api.from_host(arrays[r])
        got = await (await g.all_reduce(ops.multiply(x, 1.0)))[0].to_host()
        want = arrays[0].copy()
        for a in arrays[1:]:
            want = want + a  # rank order, as every rank adds
        np.testing.assert_array_equal(got, want)
        i = await api.from_host(ints[r])
        await g.all_reduce(i, op="avg")
        np.testing.assert_array_equal(await i.to_host(), np.trunc(np.sum(ints, axis=0) / n).astype(np.int64))
        np.testing.assert_array_equal(await (await g.all_gather(x))[0].to_host(), np.concatenate(arrays))
        part = await (await g.reduce_scatter(x, op="max"))[0].to_host()
        np.testing.assert_array_equal(part, np.max(arrays, axis=0)[2 * r : 2 * r + 2])
        await g.broadcast(x, root=n - 1)
        np.testing.assert_array_equal(await x.to_host(), arrays[-1])

        # a cancelled await: the collective still runs, and a later read sees its result
        y = await api.from_host(np.full(1000, r + 1.0, np.float32))
        await sleep(counter(), 1000)  # loaded: the next launch is at once
        slow = sleep(counter(), 200_000_000).then(lambda _: ops.multiply(y, 1.0, out=y))
        with trio.move_on_after(0.05) as scope:
            await g.all_reduce(slow)
        assert scope.cancelled_caught
        np.testing.assert_array_equal(await y.to_host(), np.full(1000, n * (n + 1) / 2, np.float32))

        # rank 1's device is reset while its part waits behind a slow kernel: every
        # rank's await fails, then every rank joins a new group
        z = await api.from_host(np.ones(8, np.float32))
        slow = sleep(counter(), 300_000_000).then(lambda _: ops.multiply(z, 1.0, out=z))
        pending = await lowlevel.submit(g.all_reduce(slow if r == 1 else z))
        if r == 1:
            await trio.to_thread.run_sync(trio_cuda.device(0).reset)
        try:
            await pending.wait()
            raise AssertionError("the collective should fail")
        except trio_cuda.DeviceReset:
            assert r == 1
        except trio_cuda.DeviceFault as err:
            assert r != 1 and "rank 1's part failed: device 0 (rank 1) was reset" in str(err), err
        g.close()
        g = await collectives.ProcessGroup.from_env(timeout=60)  # (a loaded machine's start)
        w = await (await g.all_reduce(api.full((4,), r + 1.0)))[0].to_host()
        np.testing.assert_array_equal(w, np.full(4, n * (n + 1) / 2))
        g.close()
        print(f"rank {r} ok", flush=True)

    trio.run(main)
"""


@pytest.mark.skipif(not ON_SIM, reason="3 ranks need 3 GPUs on CUDA")
def test_three_processes_collectives_cancellation_and_a_reset(tmp_path: pathlib.Path) -> None:
    r = mpiexec(3, [sys.executable, program(tmp_path, COLLECTIVES)])
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    # (mpiexec forwards the ranks' output as it comes: two ranks' lines may run together)
    assert sorted(re.findall(r"rank (\d) ok", r.stdout)) == ["0", "1", "2"], r.stdout


FAILURES = """
    import os
    import sys
    import time

    import numpy as np
    import trio
    from mpi4py import MPI

    import trio_cuda
    from trio_cuda import api, collectives

    async def main(mode: str) -> None:
        me = MPI.COMM_WORLD.Get_rank()
        # every process has started (imported numba...): the 1 s deadlines below time the
        # join and the collective, not a loaded machine's start
        MPI.COMM_WORLD.Barrier()
        if mode == "late" and me == 2:
            time.sleep(2)  # never joins
            return
        if mode == "late" and me == 0:
            # rank 0 gives up waiting for rank 2 itself: a cancel ends the join at once
            start = time.monotonic()
            with trio.move_on_after(0.5) as scope:
                await collectives.ProcessGroup.from_env(timeout=60)
            print(f"rank 0: cancelled {scope.cancelled_caught} after {time.monotonic() - start:.2f} s", flush=True)
            return
        try:
            g = await collectives.ProcessGroup.from_env(timeout=1)
        except TimeoutError as err:
            print(f"rank {me}: {err}", flush=True)
            return
        if me == 1:
            os._exit(3)  # dies without a word
        try:
            await g.all_reduce(api.full((4,), 1.0))
        except trio_cuda.DeviceFault as err:
            assert (await api.full((2,), 2.0).to_host() == 2).all()  # the device keeps working
            print(f"rank {me}: {err}", flush=True)
            # MPI's finalize would wait for the dead rank: end as a failed MPI job does
            # (or run `python -m mpi4py`, which aborts the job on an uncaught exception)
            os._exit(0)

    trio.run(main, sys.argv[1])
"""


@pytest.mark.skipif(not ON_SIM, reason="3 ranks need 3 GPUs on CUDA")
def test_a_rank_that_never_joins_times_out_or_is_given_up(tmp_path: pathlib.Path) -> None:
    """Rank 2 never joins: rank 1's join times out naming it, rank 0 cancels its own."""
    r = mpiexec(3, [sys.executable, program(tmp_path, FAILURES), "late"])
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "rank 1: ProcessGroup: rank 2 of 3 did not join within 1 s" in r.stdout, r.stdout + r.stderr[-4000:]
    cancelled = re.search(r"rank 0: cancelled True after ([0-9.]+) s", r.stdout)
    assert cancelled and float(cancelled.group(1)) < 5, r.stdout  # its timeout was 60 s


@pytest.mark.skipif(not ON_SIM, reason="3 ranks need 3 GPUs on CUDA")
def test_a_rank_that_dies_ends_the_job_or_fails_the_others_collective(tmp_path: pathlib.Path) -> None:
    """By default mpiexec ends the whole job when a rank dies; with hydra's
    -disable-auto-cleanup the others live on, and their collective fails naming it."""
    rank = program(tmp_path, FAILURES)
    start = time.monotonic()
    r = mpiexec(3, [sys.executable, rank, "dies"])
    assert r.returncode != 0 and time.monotonic() - start < 30, r.stdout + r.stderr[-4000:]
    version = subprocess.run([MPIEXEC or "", "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in version.upper():
        pytest.skip("mpiexec is not MPICH's hydra (no -disable-auto-cleanup)")
    r = mpiexec(3, [sys.executable, rank, "dies"], flags=("-disable-auto-cleanup",))
    assert r.returncode != 0, r.stdout + r.stderr[-4000:]  # rank 1's exit status
    for survivor in (0, 2):
        assert f"rank {survivor}: collective all_reduce: rank 1 of 3 did not take part within 1 s" in r.stdout, (
            r.stdout + r.stderr[-4000:]
        )


@pytest.mark.parametrize(
    "given,said",
    [
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "SLURM_PROCID=1, SLURM_NTASKS=2 but MPI says rank 0 of 1: srun started"),
        ({"SLURM_PROCID": "3"}, "SLURM_PROCID=3 but MPI says rank 0 of 1: srun started"),  # one variable alone too
        ({"PMI_RANK": "1"}, "PMI_RANK=1 but MPI says rank 0 of 1: mpi4py uses another MPI"),
    ],
)
def test_a_launchers_variables_that_mpi_contradicts_are_named(given: dict[str, str], said: str) -> None:
    """The launcher's variables say one rank, MPI (without that launcher's PMI) another:
    each process would otherwise train alone as rank 0 of 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA", "SLURM_"))}
    if not _singleton_mpi_starts(env):
        pytest.skip("MPI cannot start a process outside mpiexec here (Open MPI's singleton needs ssh/rsh)")
    env.update(given)
    code = "import trio; from trio_cuda import collectives; trio.run(collectives.ProcessGroup.from_env)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert said in r.stderr, r.stderr
