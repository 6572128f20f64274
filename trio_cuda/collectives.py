"""Collectives across devices as DeviceOps: NCCL on CUDA, emulated on the simulated device.

A :class:`Group` holds the devices of one process (one NCCL communicator each, made on
the first collective and again after a device reset). Each collective takes one tensor
(or tensor-producing op) per device, in the group's device order, and returns a DeviceOp
of the tuple of result tensors::

    group = collectives.Group([0, 1])
    await group.all_reduce([grad0, grad1])          # in place: every tensor gets the sum
    await group.broadcast([w0, w1], root=0)         # in place: every tensor gets w0
    gathered = await group.all_gather([x0, x1])     # new tensors: x0 and x1 stacked on axis 0
    parts = await group.reduce_scatter([g0, g1])    # new tensors: rank i gets rows i of the sum

The op enqueues the whole collective, one NCCL group call, on a stream of each device;
it is ordered with every other access to its tensors like any op (it waits for their
pending writes, later readers and writers wait for it), composes with ``then``/``zip``,
and is awaited, cancelled and fails like any op. Collectives are not captured in graphs
(GraphCaptureError).

:class:`ProcessGroup` is the multi-process form, one process (and one device) per rank,
started by a launcher (mpirun/srun, torchrun, Ray) and joined with ``await
ProcessGroup.from_env()`` (or ``from_store``); its collectives take this rank's one
tensor. On CUDA NCCL carries the data, across hosts too; on the simulated device (a
device per process) the launcher's channel does (MPI's messages, a store's keys)::

    group = await collectives.ProcessGroup.from_env()   # under: mpiexec -n 2 python prog.py
    await group.all_reduce(grad)

Supported: float16, bfloat16, float32, float64, int8, uint8, int32, uint32, int64,
uint64 tensors, C-contiguous; reductions "sum", "prod", "max", "min", "avg".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from . import _loop, _rendezvous
from ._backends import backend
from ._backends._boundary import CollectiveCall
from ._checks import BFLOAT16, arg_type, is_int
from ._device import Device
from ._errors import GraphCaptureError
from ._guard import LOCK
from ._op import DeviceOp
from ._ops._core import LibraryOp, alloc, overlaps, tensor_arg
from ._plan import Hold, Lane, Plan
from ._registry import as_device
from ._tensor import Tensor

__all__ = ["Group", "ProcessGroup", "unique_id"]

REDUCTIONS = ("sum", "prod", "max", "min", "avg")
_DTYPES = frozenset(
    np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64)
) | {BFLOAT16}


def unique_id() -> bytes:
    """A new id for :class:`ProcessGroup` (CUDA): make it on one rank, give it to all."""
    return backend().unique_id()


class _Base:
    """What Group and ProcessGroup share: devices, ranks, communicators, the ops.

    The group's state (communicators, their generations, the submissions holding it,
    closed) changes under the runtime lock. Making and destroying communicators are slow
    NCCL calls (a join blocks until every rank has joined; a destroy flushes the
    communicator's work), so they run without it.
    """

    devices: tuple[Device, ...]
    size: int

    def __init__(self) -> None:
        self._making = threading.Lock()  # one maker at a time; never taken under LOCK
        self._comms: Any = None
        self._generations: tuple[int, ...] | None = None
        self._closed = False
        self._holders = 0  # planned submissions holding the group (see _hold)

    # -- communicators ---------------------------------------------------------------
    def _make(self) -> Any:
        raise NotImplementedError

    def _gens(self) -> tuple[int, ...]:
        return tuple(d.generation for d in self.devices)

    def _current(self) -> Any:
        """The communicators for the devices' current generations, or None (under LOCK)."""
        comms = self._comms
        if comms is not None and self._generations == self._gens():
            return comms
        return None

    def _ensure(self) -> None:
        """Make the communicators for the devices' current generations if they are not
        made yet (without LOCK held: slow). Those of a device reset since they were made
        are dropped, not destroyed: their resources went with the device's context, and
        NCCL's destroy of such a communicator ends the process with a segmentation fault
        (2 x H200, 2026-11-30). The whole group's are dropped (NCCL's destroy is a call
        every rank makes): what NCCL holds on the host for them, and for the other
        devices' communicators, stays allocated, once per reset."""
        with self._making:
            with LOCK:
                if self._current() is not None:
                    return
                gens = self._gens()
                self._comms = None  # (stale: dropped)
            comms = self._make()
            with LOCK:
                orphan = self._closed and not self._holders  # closed while they were made
                if not orphan:
                    self._comms, self._generations = comms, gens
            if orphan and gens == self._gens():
                backend().close_communicators(comms)

    def _communicators(self) -> Any:
        """The communicators for the devices' current generations, made if needed
        (without LOCK held)."""
        self._ensure()
        with LOCK:
            return self._comms

    def _hold(self) -> _Hold:
        """A planned collective's hold on the group (under LOCK): until its submission
        finishes, close() leaves the communicators to it. A closed group is refused here,
        while planning, before anything of the DAG runs."""
        if self._closed:
            raise RuntimeError("this collectives group is closed")
        self._holders += 1
        return _Hold(self)

    def _unhold(self) -> None:
        """A holding submission finished (under LOCK). The last one of a closed group
        releases the communicators, in a thread: a destroy is slow, and this runs under
        LOCK."""
        self._holders -= 1
        if self._closed and not self._holders and self._comms is not None:
            threading.Thread(target=self._release, name="trio-cuda-group-close", daemon=True).start()

    def _release(self) -> None:
        """Release the communicators (without LOCK held); those made before a reset of one
        of the devices are dropped instead (see _ensure)."""
        with LOCK:
            comms, self._comms = self._comms, None
            live = comms is not None and self._generations == self._gens()
        if live:
            backend().close_communicators(comms)

    def close(self) -> None:
        """Refuse new collectives and release the communicators. A collective already
        planned (waiting for pinned memory, say) keeps them: it runs, and the last such
        one releases them when its submission is enqueued (NCCL's destroy waits for the
        communicators' work). Otherwise they are released now: after the group's
        collectives have completed, and not while one of its devices is being reset.
        Communicators made before a reset of one of the group's devices are dropped
        instead (see _ensure)."""
        with LOCK:
            self._closed = True
            if self._holders:
                return  # the last holder releases them (_unhold)
        self._release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the collectives -------------------------------------------------------------
    def _tensors(self, tensors: Any, name: str) -> tuple[Any, ...]:
        raise NotImplementedError

    def _check_open(self, name: str) -> None:
        if self._closed:
            raise RuntimeError(f"{name}: this collectives group is closed")

    def all_reduce(self, tensors: Any, op: str = "sum") -> DeviceOp[tuple[Tensor, ...]]:
        """Every tensor becomes the reduction (``op``: sum, prod, max, min, avg) of all of
        them, in place. Returns the same tensors."""
        return _op(Collective(self, "all_reduce", self._tensors(tensors, "all_reduce"), (), _reduction(op), 0))

    def broadcast(self, tensors: Any, root: int = 0) -> DeviceOp[tuple[Tensor, ...]]:
        """Every tensor becomes a copy of rank ``root``'s, in place. Returns the same tensors."""
        if not is_int(root) or not 0 <= int(root) < self.size:
            raise ValueError(f"broadcast: root must be a rank in [0, {self.size}), not {root!r}")
        return _op(Collective(self, "broadcast", self._tensors(tensors, "broadcast"), (), "sum", int(root)))

    def all_gather(self, tensors: Any, *, out: Any = None) -> DeviceOp[tuple[Tensor, ...]]:
        """Each rank gets every rank's tensor, concatenated along axis 0 in rank order: a
        new tensor of shape ``(size * n, ...)`` per rank (or into ``out=``, one per rank)."""
        ins = self._tensors(tensors, "all_gather")
        outs = self._tensors(out, "all_gather") if out is not None else ()
        return _op(Collective(self, "all_gather", ins, outs, "sum", 0))

    def reduce_scatter(self, tensors: Any, op: str = "sum", *, out: Any = None) -> DeviceOp[tuple[Tensor, ...]]:
        """The reduction of all tensors, split along axis 0 into ``size`` equal parts:
        rank ``i`` gets part ``i``, a new tensor (or into ``out=``, one per rank)."""
        ins = self._tensors(tensors, "reduce_scatter")
        outs = self._tensors(out, "reduce_scatter") if out is not None else ()
        return _op(Collective(self, "reduce_scatter", ins, outs, _reduction(op), 0))


def _op(c: Collective) -> DeviceOp[tuple[Tensor, ...]]:
    return cast("DeviceOp[tuple[Tensor, ...]]", c)


def _reduction(op: Any) -> str:
    if op not in REDUCTIONS:
        raise ValueError(f"collectives: op must be one of {', '.join(REDUCTIONS)}, not {op!r}")
    return str(op)


def _operand(x: Any, name: str) -> Any:
    if isinstance(x, (Tensor, DeviceOp)):
        return x
    raise TypeError(f"{name}: expected a tensor or a tensor-producing op per rank, not {arg_type(x)}")


class Group(_Base):
    """The devices of this process that take part in collectives (rank ``i`` is
    ``devices[i]``): ordinals or Device objects, distinct."""

    def __init__(self, devices: Sequence[int | Device]) -> None:
        super().__init__()
        if isinstance(devices, (int, Device)) or not isinstance(devices, Sequence) or not devices:
            raise ValueError(f"Group: give a non-empty list of devices, not {devices!r}")
        devs = tuple(as_device(d) for d in devices)
        if len(set(devs)) != len(devs):
            raise ValueError(f"Group: a device appears twice in {[d.ordinal for d in devs]}")
        self.devices = devs
        self.size = len(devs)

    def _make(self) -> Any:
        return backend().communicators([d._driver for d in self.devices])

    def _tensors(self, tensors: Any, name: str) -> tuple[Any, ...]:
        if isinstance(tensors, (Tensor, DeviceOp)) or not isinstance(tensors, Sequence):
            raise TypeError(f"{name}: give one tensor per device of the group (a list of {self.size})")
        if len(tensors) != self.size:
            raise ValueError(f"{name}: {len(tensors)} tensors for a group of {self.size} devices")
        return tuple(_operand(t, name) for t in tensors)

    def __repr__(self) -> str:
        return f"<trio_cuda Group of devices {[d.ordinal for d in self.devices]}>"


class ProcessGroup(_Base):
    """This process's rank in a collective of ``nranks`` processes, one device each.

    Join it from the launcher that started the processes, in trio or asyncio code:
    ``await ProcessGroup.from_env()`` (mpirun/mpiexec/srun through mpi4py, or torchrun),
    ``await ProcessGroup.from_store(store, nranks, rank)`` (a store every rank was handed:
    Ray), or by hand with an id from :func:`unique_id` on one rank:
    ``ProcessGroup(unique_id, nranks, rank, device)`` (blocks until every rank has
    joined; ``await ProcessGroup.join(...)`` waits in a worker thread). On CUDA the ranks'
    NCCL communicator carries the data; on the simulated device (each process with its own)
    the launcher's channel does, so the same program runs without GPUs.
    """

    rank: int
    nranks: int
    local_rank: int | None  # this rank's place among the ranks of its host (None: joined by hand)
    launcher: str  # "mpi", "torchrun", "store" or "unique id"

    def __init__(self, unique_id: bytes, nranks: int, rank: int, device: int | Device | None = None) -> None:
        if not isinstance(unique_id, (bytes, bytearray)):
            raise TypeError(
                f"ProcessGroup: unique_id must be bytes (from collectives.unique_id()), not {type(unique_id).__name__}"
            )
        _check_ranks(nranks, rank)
        self._setup(bytes(unique_id), int(nranks), int(rank), as_device(device), None, None, "unique id")

    def _setup(
        self, uid: bytes, nranks: int, rank: int, device: Device, channel: Any, local_rank: int | None, launcher: str
    ) -> ProcessGroup:
        super().__init__()
        self.rank, self.nranks, self.local_rank, self.launcher = rank, nranks, local_rank, launcher
        self.devices = (device,)
        self.size = nranks
        self._id = uid
        self._channel = channel
        self._communicators()  # join now: every rank blocks here until all have joined
        return self

    @classmethod
    async def join(cls, unique_id: bytes, nranks: int, rank: int, device: int | Device | None = None) -> ProcessGroup:
        """Join from trio or asyncio code: the blocking join runs in a worker thread."""
        return await _loop.run_in_thread(cls, unique_id, nranks, rank, device, abandon_on_cancel=False)

    @classmethod
    async def from_env(cls, device: int | Device | None = None, *, timeout: float = 300.0) -> ProcessGroup:
        """Join the group of the launcher that started this process: torchrun (its
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; the
        unique id through ``torch.distributed.TCPStore``, so torch must be installed) or
        mpirun/mpiexec/srun (rank and size from mpi4py, which carries the id). ``device``
        defaults to the local rank's (device 0 where the process sees one device).

        A partial or inconsistent environment raises ``ValueError`` naming the variables.
        The join waits up to ``timeout`` seconds for every rank: one that never arrives is
        a ``TimeoutError`` naming it on every rank that did. Cancelling the awaiting task
        ends the wait at once. On the simulated device, ``timeout`` is also how long a
        collective waits for the other ranks' parts."""
        _check_timeout(timeout)
        launch = await _loop.run_in_thread(_rendezvous.launch_from_env, dict(os.environ), abandon_on_cancel=True)
        return await cls._launched(launch, device, timeout)

    @classmethod
    async def from_store(
        cls, store: Any, nranks: int, rank: int, device: int | Device | None = None, *, timeout: float = 300.0
    ) -> ProcessGroup:
        """Join through a key-value store every rank was given: an object with
        ``torch.distributed.Store``'s methods (``set``, ``get``, ``check``, ``add``,
        ``delete_key``), such as torch's TCPStore or a Ray actor's (see
        examples/ray_data_parallel.py). The store carries the unique id (and, on the
        simulated device, the collectives' data). Timeouts, cancellation and ``device``
        as for :meth:`from_env`."""
        _check_ranks(nranks, rank)
        _check_timeout(timeout)
        missing = [m for m in ("set", "get", "check", "add", "delete_key") if not callable(getattr(store, m, None))]
        if missing:
            raise TypeError(
                f"ProcessGroup.from_store: a {arg_type(store)} is no store: it lacks {', '.join(missing)} "
                "(torch.distributed.Store's methods)"
            )
        return await cls._launched(_rendezvous.Launch("store", int(rank), int(nranks), store=store), device, timeout)

    @classmethod
    async def _launched(cls, launch: _rendezvous.Launch, device: int | Device | None, timeout: float) -> ProcessGroup:
        stop, ended = threading.Event(), threading.Event()

        def join() -> _rendezvous.Joined:
            try:
                return _rendezvous.join(launch, _new_id, timeout, stop)
            finally:
                ended.set()

        try:
            joined = await _loop.run_in_thread(join, abandon_on_cancel=True)
        finally:
            if not ended.is_set():
                # Cancelled: the abandoned join stops at its next poll (a few ms) and takes
                # back its hello; waiting for that (for a second at most: a store that does
                # not answer is left to the thread) lets a later join of this rank, or a
                # peer arriving later, never meet it.
                stop.set()

                async def wait_ended() -> None:
                    await _loop.run_in_thread(ended.wait, 1.0, abandon_on_cancel=False)

                await _loop.shielded(wait_ended)
        dev = _launched_device(device, joined.local_rank)
        group = cls.__new__(cls)
        # every rank has arrived: NCCL's join is quick now (abandoning it would leak its communicator)
        return await _loop.run_in_thread(
            group._setup,
            joined.unique_id,
            launch.size,
            launch.rank,
            dev,
            joined.channel,
            joined.local_rank,
            launch.launcher,
            abandon_on_cancel=False,
        )

    def _make(self) -> Any:
        if self._generations is not None:
            raise RuntimeError("ProcessGroup: the device was reset; every rank must join a new group")
        return backend().process_communicator(self.devices[0]._driver, self._id, self.nranks, self.rank, self._channel)

    def _tensors(self, tensors: Any, name: str) -> tuple[Any, ...]:
        if isinstance(tensors, Sequence) and not isinstance(tensors, (Tensor, DeviceOp)):
            if len(tensors) != 1:
                raise ValueError(f"{name}: a process group takes this rank's one tensor")
            tensors = tensors[0]
        return (_operand(tensors, name),)

    def __repr__(self) -> str:
        return f"<trio_cuda ProcessGroup rank {self.rank} of {self.nranks} on device {self.devices[0].ordinal}>"


def _check_ranks(nranks: Any, rank: Any) -> None:
    if not is_int(nranks) or int(nranks) < 1:
        raise ValueError(f"ProcessGroup: nranks must be a positive int, not {nranks!r}")
    if not is_int(rank) or not 0 <= int(rank) < int(nranks):
        raise ValueError(f"ProcessGroup: rank must be in [0, {nranks}), not {rank!r}")


def _check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"ProcessGroup: timeout must be a positive number of seconds, not {timeout!r}")


def _new_id() -> bytes:
    """Rank 0's id for the join: NCCL's, or none on the simulated device (its channel
    carries the data)."""
    return b"" if backend().name == "sim" else unique_id()


def _launched_device(device: int | Device | None, local_rank: int) -> Device:
    if device is not None:
        return as_device(device)
    n = backend().device_count()
    if local_rank < n:
        return as_device(local_rank)
    if n == 1:  # one device per process: CUDA_VISIBLE_DEVICES set per rank (srun, Ray), or the simulated device
        return as_device(0)
    raise ValueError(
        f"ProcessGroup: local rank {local_rank} has no device of its own (this process sees {n}): "
        "give device=, or make one device visible per rank (CUDA_VISIBLE_DEVICES)"
    )


class Collective(LibraryOp):
    """One collective over a group's tensors (see the module doc)."""

    __slots__ = ("_group", "_kind", "_n", "_op", "_root", "name")

    def __init__(self, group: _Base, kind: str, ins: tuple[Any, ...], outs: tuple[Any, ...], op: str, root: int) -> None:
        group._check_open(f"collectives.{kind}")  # before any input op is planned
        self._group = group
        self._kind = kind
        self._op = op
        self._root = root
        self._n = len(ins)
        self.name = f"collectives.{kind}"
        super().__init__((*ins, *outs))

    def _result_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        size = self._group.size
        if self._kind == "all_gather":
            return (size * shape[0], *shape[1:]) if shape else (size,)
        if self._kind == "reduce_scatter":
            if not shape or shape[0] % size:
                raise ValueError(f"{self.name}: axis 0 of {shape} must split into {size} equal parts")
            return (shape[0] // size, *shape[1:])
        return shape

    def _check(self, *args: Any) -> None:
        name = self.name
        ins = [tensor_arg(t, name, "tensor") for t in args[: self._n]]
        outs = [tensor_arg(t, name, "out= tensor") for t in args[self._n :]]
        first = ins[0]
        for i, t in enumerate(ins):
            dev = self._group.devices[i]
            if t.device is not dev:
                raise ValueError(
                    f"{name}: rank {i}'s tensor is on device {t.device.ordinal}, the group's rank {i} is device {dev.ordinal}"
                )
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    f"{name}: every rank's tensor must have one shape and dtype; {first.shape} {first.dtype} and {t.shape} {t.dtype}"
                )
            if not t.is_contiguous:
                raise ValueError(f"{name}: tensors must be C-contiguous (rank {i}'s is a strided view; copy it with .copy())")
        if first.dtype not in _DTYPES:
            raise TypeError(
                f"{name}: dtype {first.dtype} is not supported (float16, bfloat16, float32, float64, 8/32/64-bit ints)"
            )
        shape = self._result_shape(first.shape)
        if outs:
            if len(outs) != len(ins):
                raise ValueError(f"{name}: out= needs one tensor per rank ({len(ins)}), got {len(outs)}")
            for i, (o, t) in enumerate(zip(outs, ins, strict=True)):
                if o.shape != shape or o.dtype != first.dtype:
                    raise ValueError(f"{name}: rank {i}'s out= must be {shape} {first.dtype}, not {o.shape} {o.dtype}")
                if o.device is not t.device:
                    raise ValueError(f"{name}: rank {i}'s out= is on device {o.device.ordinal}, its tensor on {t.device.ordinal}")
                if not o.is_contiguous:
                    raise ValueError(f"{name}: out= tensors must be C-contiguous")
                if overlaps(o, t):
                    raise ValueError(f"{name}: rank {i}'s out= overlaps its input; use separate memory")

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> tuple[Tensor, ...]:  # type: ignore[override]
        if plan.capture is not None:
            raise GraphCaptureError(f"{self.name}: collectives cannot be captured in a graph")
        try:
            hold = self._group._hold()  # closed after the op was made: refused at planning
        except RuntimeError as err:
            raise RuntimeError(f"{self.name}: {err}") from None
        plan.hold(hold)
        ins: list[Tensor] = list(args[: self._n])
        given: list[Tensor] = list(args[self._n :])
        lanes = [lane.on(t.device) for t in ins]
        for t in (*ins, *given):
            plan.use(t._buffer, t)
        if self._kind in ("all_reduce", "broadcast"):
            outs = ins
        elif given:
            outs = given
        else:
            shape = self._result_shape(ins[0].shape)
            outs = [alloc(plan, ln, shape, ins[0].dtype, self.name) for ln in lanes]
        if ins[0].size:
            plan.step(lane, _collective_step, (self, hold, lanes, ins, outs))
            plan.ops.append(self.name)
        return tuple(outs)


class _Hold(Hold):
    """A planned collective's hold on its group, and the communicators it enqueues with."""

    __slots__ = ("comms", "group", "held")

    def __init__(self, group: _Base) -> None:
        self.group = group
        self.comms: Any = None
        self.held = True

    def ready(self) -> bool:
        self.comms = self.group._current()
        return self.comms is not None

    def make(self) -> None:
        self.group._ensure()

    def done(self) -> None:
        if self.held:
            self.held = False
            self.group._unhold()


def _collective_step(lane: Lane, arg: tuple[Collective, _Hold, list[Lane], list[Tensor], list[Tensor]]) -> None:
    op, hold, lanes, ins, outs = arg
    group = op._group
    for ln, i, o in zip(lanes, ins, outs, strict=True):
        if o._buffer is not i._buffer:
            ln.read(i._buffer, i._tracked)
        ln.write(o._buffer, o._tracked)
        ln.device._cross_device = True  # another rank's failure can fail it alone (see Device.poll)
    comms = hold.comms  # taken just before the enqueue (Plan.advance): for these generations
    first = ins[0]
    count = first.size // group.size if op._kind == "reduce_scatter" else first.size
    base = group.rank if isinstance(group, ProcessGroup) else 0
    calls = [
        CollectiveCall(base + r, ln.device._driver, ln.stream.handle, i.ptr, o.ptr, count)
        for r, (ln, i, o) in enumerate(zip(lanes, ins, outs, strict=True))
    ]
    backend().collective(op._kind, comms, calls, first.dtype, op._op, op._root)
    for ln, i, o in zip(lanes, ins, outs, strict=True):
        seq = ln.end()
        ln.wrote(o._buffer, seq, o._tracked)
        if o._buffer is not i._buffer:
            ln.was_read(i._buffer, seq, i._tracked)
