"""Joining a process group through a launcher: where the ranks come from, and the channel
that carries what the ranks must tell each other.

The launchers people use say who a process is: ``mpirun``/``mpiexec``/``srun`` (MPI:
mpi4py's ``COMM_WORLD``; their environment variables only show that one is there),
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
and the key-value store ``torch.distributed.TCPStore`` at the master's address), or a
program that hands each rank a store itself (Ray: see examples/ray_data_parallel.py).
Nothing here is a server of its own: the channel is MPI's point-to-point messages or
the store's keys.

The join is one exchange of a hello between every pair of ranks (rank 0's carries the
NCCL unique id, every one its host name, whence the local ranks), in polling form with
a deadline: a rank that never arrives is a ``TimeoutError`` naming it on every rank that
did, and a ``stop`` event (set when the awaiting task is cancelled) ends the wait at the
next poll. On the simulated device the same channel then carries the collectives' data
between the processes (``_backends._simcollectives.ProcessComm``), as Gloo does for
PyTorch on CPUs.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Joined", "Launch", "MpiChannel", "Stopped", "StoreChannel", "exchange", "join", "launch_from_env", "ranks"]

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# What mpirun/mpiexec (MPICH's and Intel's hydra: PMI_*; Open MPI: OMPI_COMM_WORLD_*;
# PMIx launchers: PMIX_RANK) and srun (SLURM_PROCID with --mpi) set in each rank.
MPI = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_PROCID")
_joins = itertools.count(1)  # this process's joins through MPI (one rank per process)


@dataclasses.dataclass(frozen=True)
class Launch:
    """Who this process is, as its launcher says."""

    launcher: str  # "mpi", "torchrun" or "store"
    rank: int
    size: int
    local_rank: int | None = None  # torchrun's LOCAL_RANK; otherwise found by the join
    master: tuple[str, int] | None = None  # torchrun's MASTER_ADDR, MASTER_PORT
    store: Any = None  # for "store": an object with torch.distributed.Store's methods


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    value = env[name]
    try:
        n = int(value)
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise ValueError(f"ProcessGroup.from_env: {name}={value!r} is not an integer >= {minimum}")
    return n


def launch_from_env(env: Mapping[str, str]) -> Launch:
    """The launch this environment describes: torchrun's variables, else an MPI
    launcher's (through mpi4py). A partial or inconsistent environment is a
    ``ValueError`` naming the variables."""
    given = [k for k in TORCHRUN if k in env]
    if given:
        missing = [k for k in TORCHRUN if k not in env]
        if missing:
            raise ValueError(
                f"ProcessGroup.from_env: torchrun's environment is partial: {', '.join(given)} set, "
                f"{', '.join(missing)} missing (torchrun sets all of {', '.join(TORCHRUN)})"
            )
        size = _int(env, "WORLD_SIZE", 1)
        rank = _int(env, "RANK", 0)
        local = _int(env, "LOCAL_RANK", 0)
        port = _int(env, "MASTER_PORT", 1)
        bad = [
            f"RANK={rank} is not below WORLD_SIZE={size}" if rank >= size else "",
            f"LOCAL_RANK={local} is not below WORLD_SIZE={size}" if local >= size else "",
            f"MASTER_PORT={port} is not a port" if port > 65535 else "",
            "MASTER_ADDR is empty" if not env["MASTER_ADDR"].strip() else "",
        ]
        if any(bad):
            raise ValueError(f"ProcessGroup.from_env: {'; '.join(b for b in bad if b)}")
        return Launch("torchrun", rank, size, local, (env["MASTER_ADDR"], port))
    mpi = [k for k in MPI if k in env]
    if not mpi:
        raise ValueError(
            "ProcessGroup.from_env: no launcher in the environment: start the program with "
            f"torchrun (which sets {', '.join(TORCHRUN)}) or mpirun/mpiexec/srun (which set one of {', '.join(MPI)}), "
            "or join with ProcessGroup.from_store or ProcessGroup.join"
        )
    comm = _mpi_world(mpi[0])
    rank, size = comm.Get_rank(), comm.Get_size()
    for rk, sz, hint in (
        ("PMI_RANK", "PMI_SIZE", "mpi4py uses another MPI than the launcher's: run the mpiexec of the MPI mpi4py loads"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpi4py uses another MPI than Open MPI's mpirun"),
        ("SLURM_PROCID", "SLURM_NTASKS", "srun started the tasks without MPI: srun --mpi=pmix (or pmi2)"),
    ):
        # each variable the launcher set must agree with MPI (one alone too: a partial
        # environment would otherwise make every process a group of one)
        said = {k: env[k] for k in (rk, sz) if k in env}
        if said and any(env[k] != str(v) for k, v in ((rk, rank), (sz, size)) if k in env):
            told = ", ".join(f"{k}={v}" for k, v in said.items())
            raise ValueError(f"ProcessGroup.from_env: {told} but MPI says rank {rank} of {size}: {hint}")
    return Launch("mpi", rank, size)


def _mpi_world(variable: str) -> Any:
    try:
        from mpi4py import MPI as mpi
    except ImportError as exc:
        raise ImportError(
            f"ProcessGroup.from_env: an MPI launcher started this process ({variable} is set) "
            "but mpi4py is missing: pip install 'trio-cuda[mpi]'"
        ) from exc
    return mpi.COMM_WORLD


# -- channels ---------------------------------------------------------------------------
# Our MPI calls come from several threads (the join's, the simulated streams'): one at a
# time, so that an MPI library without MPI_THREAD_MULTIPLE is safe too.
_MPI_LOCK = threading.Lock()


class MpiChannel:
    """Messages between the ranks of an MPI communicator: a buffered send to each peer,
    a matched probe to see whether a peer's has arrived (both return at once)."""

    def __init__(self, comm: Any, timeout: float) -> None:
        self.comm = comm
        with _MPI_LOCK:
            self.rank, self.size = comm.Get_rank(), comm.Get_size()
            self._tags = int(comm.Get_attr(_mpi().TAG_UB) or 32767) - 16
        self.timeout = timeout
        self._sends: list[Any] = []  # (under _MPI_LOCK)

    def _tag(self, tag: int) -> int:
        return 16 + tag % self._tags

    def post(self, tag: int, payloads: Sequence[bytes]) -> None:
        """Send ``payloads[p]`` to every peer ``p`` (``payloads[self.rank]`` is not sent)."""
        t = self._tag(tag)
        with _MPI_LOCK:
            reqs = [self.comm.isend(payloads[p], dest=p, tag=t) for p in range(self.size) if p != self.rank]
            self._sends = [r for r in self._sends if not r.Test()] + reqs

    def collect(self, tag: int, got: dict[int, bytes]) -> None:
        """Add to ``got`` the peers' payloads of ``tag`` that have arrived."""
        t = self._tag(tag)
        with _MPI_LOCK:
            for p in range(self.size):
                if p != self.rank and p not in got:
                    msg = self.comm.improbe(source=p, tag=t)
                    if msg is not None:
                        got[p] = msg.recv()

    def done(self, tag: int) -> None:
        """Every peer's payload of ``tag`` has been collected (nothing to release)."""

    def withdraw(self, tag: int) -> None:
        """An abandoned join's hellos: MPI gives no way to take back a buffered send (a
        peer's later join of the same number may still meet it; see docs/multi-gpu.md)."""


def _mpi() -> Any:
    from mpi4py import MPI as mpi

    return mpi


class StoreChannel:
    """Keys of a store with torch.distributed.Store's methods (``set``, ``get``,
    ``check``, ``add``, ``delete_key``): torch's TCPStore, or the store a program hands
    every rank (a Ray actor's, say). Rank ``s``'s payload for rank ``d`` is the key
    ``prefix/tag/s/d``; the last rank to have read all of a tag's payloads deletes them."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int, timeout: float, joins_key: str = "") -> None:
        self.store, self.prefix, self.rank, self.size, self.timeout = store, prefix, rank, size, timeout
        self.joins_key = joins_key  # the key counting this rank's joins

    def _key(self, tag: int, src: int, dst: int) -> str:
        return f"{self.prefix}/{tag}/{src}/{dst}"

    def post(self, tag: int, payloads: Sequence[bytes]) -> None:
        for p in range(self.size):
            if p != self.rank:
                self.store.set(self._key(tag, self.rank, p), payloads[p])

    def collect(self, tag: int, got: dict[int, bytes]) -> None:
        missing = [p for p in range(self.size) if p != self.rank and p not in got]
        keys = [self._key(tag, p, self.rank) for p in missing]
        if keys and self.store.check(keys):  # all there: one round trip to ask
            for p, k in zip(missing, keys, strict=True):
                got[p] = bytes(self.store.get(k))
            return
        for p, k in zip(missing, keys, strict=True):
            if self.store.check([k]):
                got[p] = bytes(self.store.get(k))

    def withdraw(self, tag: int) -> None:
        """Take back this rank's payloads of an abandoned join and its number, so that a
        peer arriving later does not join a group this rank left, and this rank's next
        join meets the peers' first one."""
        for p in range(self.size):
            if p != self.rank:
                self.store.delete_key(self._key(tag, self.rank, p))
        self.store.add(self.joins_key, -1)

    def done(self, tag: int) -> None:
        if self.size > 1 and int(self.store.add(f"{self.prefix}/{tag}/read", 1)) == self.size:
            for s, d in itertools.permutations(range(self.size), 2):
                self.store.delete_key(self._key(tag, s, d))
            self.store.delete_key(f"{self.prefix}/{tag}/read")


Channel = MpiChannel | StoreChannel


def open_channel(launch: Launch, timeout: float) -> tuple[Channel, int]:
    """The channel of this launch and the join's number (the same on every rank: ranks
    join their groups in one order). Blocking: connecting to torchrun's store waits for
    it up to ``timeout``; run it in a thread."""
    if launch.launcher == "mpi":
        return MpiChannel(_mpi().COMM_WORLD, timeout), next(_joins)
    if launch.launcher == "torchrun":
        store = _tcp_store(launch, timeout)
        env = os.environ
        prefix = f"trio_cuda/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    else:
        store, prefix = launch.store, "trio_cuda"
    # the store numbers each rank's joins (ranks of one store may share a process)
    joins = f"{prefix}/joins/{launch.rank}"
    n = int(store.add(joins, 1))
    return StoreChannel(store, f"{prefix}/{n}", launch.rank, launch.size, timeout, joins), n


def _tcp_store(launch: Launch, timeout: float) -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError(
            "ProcessGroup.from_env: torchrun's environment (RANK, WORLD_SIZE, ...) needs torch for its "
            "TCPStore at MASTER_ADDR:MASTER_PORT (pip install torch), or start the program with mpirun"
        ) from exc
    import datetime

    assert launch.master is not None
    host, port = launch.master
    # torchrun's agent hosts a store there already (TORCHELASTIC_USE_AGENT_STORE);
    # otherwise rank 0 hosts it, as torch.distributed's env:// does
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        return dist.TCPStore(
            host,
            port,
            launch.size,
            is_master=launch.rank == 0 and not agent,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except Exception as exc:  # (torch's DistStoreError and RuntimeError alike)
        raise TimeoutError(f"ProcessGroup.from_env: rank {launch.rank} reached no store at {host}:{port}: {exc}") from exc


# -- the join -----------------------------------------------------------------------------
def exchange(
    channel: Channel, tag: int, payloads: Sequence[bytes], deadline: float, give_up: Callable[[], bool]
) -> tuple[dict[int, bytes], list[int]]:
    """Post ``payloads`` (one per rank) and collect every peer's for ``tag`` until all
    have come, ``deadline`` (time.monotonic) passes or ``give_up()`` says so. Returns
    what came and the ranks still missing."""
    channel.post(tag, payloads)
    got: dict[int, bytes] = {}
    pause = 2e-5
    while True:
        channel.collect(tag, got)
        missing = [p for p in range(channel.size) if p != channel.rank and p not in got]
        if not missing:
            channel.done(tag)
            return got, []
        if give_up() or time.monotonic() >= deadline:
            return got, missing
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


def ranks(ps: Sequence[int]) -> str:
    return f"rank{'s' if len(ps) > 1 else ''} {', '.join(map(str, ps))}"


@dataclasses.dataclass(frozen=True)
class Joined:
    """What the join found: rank 0's unique id, this rank's local rank and the channel."""

    unique_id: bytes
    local_rank: int
    channel: Channel


class Stopped(Exception):
    """The join's task was cancelled (nobody sees this: the task is gone)."""


def join(launch: Launch, make_id: Callable[[], bytes], timeout: float, stop: threading.Event) -> Joined:
    """Open the channel and exchange the hellos (blocking, polling ``stop``; run it in a
    thread). ``make_id`` runs on rank 0 only. The hellos of join ``n`` (the n-th of this
    rank) are apart from every other join's: a late hello of an abandoned join never
    meets a later one."""
    deadline = time.monotonic() + timeout
    channel, number = open_channel(launch, timeout)
    uid = make_id() if launch.rank == 0 else b""
    host = socket.gethostname()
    # the hellos' tag: on MPI's COMM_WORLD the join's number (the collectives use a
    # communicator of their own); in a store, whose prefix has the number, one that no
    # collective uses (a hello still unread must not meet a collective's part)
    tag = number if isinstance(channel, MpiChannel) else -1
    got, missing = exchange(channel, tag, [pickle.dumps((uid, host))] * launch.size, deadline, stop.is_set)
    if missing:  # abandoned (cancelled or timed out) before every peer came
        channel.withdraw(tag)
    if stop.is_set():
        raise Stopped()
    if missing:
        raise TimeoutError(
            f"ProcessGroup: {ranks(missing)} of {launch.size} did not join within {timeout:g} s "
            f"(rank {launch.rank} waited, through {launch.launcher})"
        )
    hellos = {p: pickle.loads(b) for p, b in got.items()}
    hellos[launch.rank] = (uid, host)
    if isinstance(channel, MpiChannel):
        # every rank is here: the communicator gets a deadline of its own
        channel = _own_communicator(channel, time.monotonic() + timeout, stop)
    local = launch.local_rank
    if local is None:
        local = sum(1 for p in range(launch.rank) if hellos[p][1] == host)
    return Joined(hellos[0][0], local, channel)


def _own_communicator(channel: MpiChannel, deadline: float, stop: threading.Event) -> MpiChannel:
    """A communicator of the group's own (its collectives' tags never meet another
    group's). MPI's Idup is collective: it comes after the hellos showed every rank here."""
    with _MPI_LOCK:
        comm, req = channel.comm.Idup()

    def made() -> bool:
        with _MPI_LOCK:
            return bool(req.Test())

    while not made():
        if stop.is_set():
            raise Stopped()
        if time.monotonic() >= deadline:
            raise TimeoutError("ProcessGroup: the ranks did not make the group's MPI communicator in time")
        time.sleep(1e-4)
    return MpiChannel(comm, channel.timeout)
