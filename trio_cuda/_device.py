"""Devices: the current device, per-device policies, memory, reset.

``Device`` objects are per-process singletons obtained from :func:`devices`,
:func:`device` or :func:`current_device`; the current device is a context
variable, so it is per trio task (inherited by children) and per thread.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ._backends import backend
from ._backends._boundary import DeviceDriver
from ._errors import DeviceFault, DeviceOutOfMemory
from ._stream import Stream

if TYPE_CHECKING:
    from ._scheduling import SchedulingPolicy

__all__ = [
    "Device",
    "DeviceStatistics",
    "current_device",
    "device",
    "device_count",
    "devices",
    "use_device",
]


@dataclass(frozen=True)
class DeviceStatistics:
    """A snapshot of one device's runtime counters (see :meth:`Device.statistics`).

    Attributes:
        ordinal: The device ordinal.
        backend: ``"cuda"`` or ``"sim"``.
        submissions: DAG submissions so far.
        launches: Kernel launches enqueued.
        graph_launches: CUDA graph replays enqueued.
        allocations: Device allocations made.
        frees: Device frees enqueued.
        copies: Copies and fills enqueued.
        stream_waits: Cross-stream waits enqueued by dependency tracking and joins.
        bytes_in_use: Bytes of live device buffers plus frees not yet enqueued.
        streams: Streams created on the device.
        faulted: Whether the device is faulted (and refuses work until reset).
    """

    ordinal: int
    backend: str
    submissions: int
    launches: int
    graph_launches: int
    allocations: int
    frees: int
    copies: int
    stream_waits: int
    bytes_in_use: int
    streams: int
    faulted: bool


class _Counters:
    __slots__ = ("submissions", "launches", "graph_launches", "allocations", "frees", "copies", "stream_waits")

    def __init__(self) -> None:
        self.submissions = self.launches = self.graph_launches = self.allocations = 0
        self.frees = self.copies = self.stream_waits = 0


class Device:
    """One GPU (or simulated GPU). Get devices from :func:`devices` / :func:`device`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Device cannot be constructed directly; use trio_cuda.device(i) or trio_cuda.devices()")

    @classmethod
    def _new(cls, ordinal: int, driver: DeviceDriver, backend_name: str) -> "Device":
        self = object.__new__(cls)
        self.ordinal = ordinal
        self._driver = driver
        self._backend_name = backend_name
        self._generation = 0
        self._lock = threading.RLock()
        self._event_pool: list[Any] = []
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self._policy: SchedulingPolicy | None = None
        self._pending_frees: collections.deque[tuple[int, int, Any]] = collections.deque()
        self._staging_pool: collections.defaultdict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._bytes_in_use = 0
        self._stats = _Counters()
        self._capturing = 0
        return self

    # -- identity ---------------------------------------------------------------
    @property
    def name(self) -> str:
        """The device's name as the driver reports it."""
        return self._driver.name

    @property
    def compute_capability(self) -> tuple[int, int]:
        """(major, minor) compute capability."""
        return self._driver.compute_capability

    @property
    def total_memory(self) -> int:
        """Total device memory in bytes."""
        return self._driver.total_memory

    def __repr__(self) -> str:
        return f"<trio_cuda.Device {self.ordinal}: {self.name}>"

    # -- streams and policy -----------------------------------------------------
    def create_stream(self) -> Stream:
        """A new stream on this device."""
        with self._lock:
            self._check_usable()
            s = Stream._new(self)
            self._streams.add(s)
            return s

    @property
    def policy(self) -> "SchedulingPolicy":
        """The scheduling policy ``await op`` and ``op.sync()`` use on this device.

        Defaults to :class:`StreamPoolRoundRobin` over 4 streams. Assign another
        policy (for this device) to change it.
        """
        if self._policy is None:
            from ._scheduling import StreamPoolRoundRobin

            with self._lock:
                if self._policy is None:
                    self._policy = StreamPoolRoundRobin(self)
        return self._policy

    @policy.setter
    def policy(self, policy: "SchedulingPolicy") -> None:
        from ._scheduling import SchedulingPolicy

        if not isinstance(policy, SchedulingPolicy):
            raise TypeError(f"expected a SchedulingPolicy, got {policy!r}")
        if policy.device is not self:
            raise ValueError(f"the policy schedules on device {policy.device.ordinal}, not device {self.ordinal}")
        self._policy = policy

    # -- faults -----------------------------------------------------------------
    @property
    def is_faulted(self) -> bool:
        """True after an asynchronous fault, until :meth:`reset`."""
        return self._driver.fault() is not None

    def _check_usable(self) -> None:
        fault = self._driver.fault()
        if fault is not None:
            raise DeviceFault(
                f"the device refuses new work until it is reset: it faulted earlier ({fault}); "
                f"call trio_cuda.device({self.ordinal}).reset() to recover",
                device=self.ordinal,
                op=getattr(fault, "op", None),
            ) from fault

    def reset(self) -> None:
        """Discard the device's state and clear a fault.

        All memory of the device is released: tensors allocated before the reset can
        no longer be used. Streams (and policies) keep working with fresh driver streams.
        Tasks still waiting on work of this device get :class:`DeviceFault`.
        """
        with self._lock:
            self._driver.reset()
            self._generation += 1
            self._event_pool.clear()
            self._pending_frees.clear()
            self._staging_pool.clear()
            self._bytes_in_use = 0
            self._capturing = 0
            for s in list(self._streams):
                s._attach()
        from ._notifier import notifier

        notifier().device_reset(self)

    # -- memory -----------------------------------------------------------------
    def _alloc(self, nbytes: int, stream: Stream, what: str = "allocation") -> int:
        """Stream-ordered allocation; on exhaustion, flush frees, synchronize and retry once."""
        self._flush_frees(stream)
        try:
            ptr = self._driver.alloc(nbytes, stream.handle)
        except DeviceOutOfMemory:
            self._synchronize_locked()
            try:
                ptr = self._driver.alloc(nbytes, stream.handle)
            except DeviceOutOfMemory as err:
                raise DeviceOutOfMemory(err.message, device=self.ordinal, op=what) from None
        self._bytes_in_use += nbytes
        self._stats.allocations += 1
        return ptr

    def _defer_free(self, ptr: int, nbytes: int, generation: int, accesses: Any) -> None:
        # Called from Buffer.__del__, possibly in any thread and in the middle of a
        # submission: only record the free; it is enqueued at the next safe point.
        self._pending_frees.append((ptr, nbytes, (generation, accesses)))

    def _flush_frees(self, stream: Stream | None = None) -> None:
        """Enqueue deferred frees, each after every pending access to its memory."""
        pending = self._pending_frees
        if not pending or self._capturing:
            return
        while pending:
            ptr, nbytes, (generation, accesses) = pending.popleft()
            if generation != self._generation:
                continue  # memory of a reset device is gone already
            self._bytes_in_use -= nbytes
            # Free on the stream of the last writer (or of the caller), after every reader.
            target = None
            for s, _ in accesses:
                if s.device is self and s._generation == self._generation:
                    target = s
                    break
            if target is None:
                target = stream if stream is not None else self.policy.next_stream()
            for s, seq in accesses:
                target.wait_for(s, seq)
            self._driver.free(ptr, target.handle)
            target.mark()
            self._stats.frees += 1

    def memory_in_use(self) -> int:
        """Bytes of device memory held by live tensors (and frees not yet enqueued)."""
        return self._bytes_in_use

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes, as the driver reports it."""
        return self._driver.mem_info()

    # -- whole-device operations ------------------------------------------------
    def _synchronize_locked(self) -> None:
        for s in list(self._streams):
            if s._generation == self._generation and s.seq > s.done_seq:
                s.event_at(s.mark()).synchronize()
                s.retire()

    def synchronize(self) -> None:
        """Block until all work enqueued on the device's streams has completed (plain code only).

        Also enqueues deferred frees first, so memory of dropped tensors returns to the pool.
        """
        from ._execution import check_blocking_allowed

        check_blocking_allowed("Device.synchronize()")
        with self._lock:
            self._flush_frees()
            self._synchronize_locked()

    def statistics(self) -> DeviceStatistics:
        """A frozen snapshot of this device's counters."""
        c = self._stats
        return DeviceStatistics(
            ordinal=self.ordinal,
            backend=self._backend_name,
            submissions=c.submissions,
            launches=c.launches,
            graph_launches=c.graph_launches,
            allocations=c.allocations,
            frees=c.frees,
            copies=c.copies,
            stream_waits=c.stream_waits,
            bytes_in_use=self._bytes_in_use,
            streams=len(self._streams),
            faulted=self.is_faulted,
        )


_devices: list[Device] | None = None
_devices_lock = threading.Lock()
_current: contextvars.ContextVar[Device | None] = contextvars.ContextVar("trio_cuda_current_device", default=None)


def devices() -> list[Device]:
    """All devices of the selected backend (the first call opens the backend)."""
    global _devices
    if _devices is None:
        with _devices_lock:
            if _devices is None:
                b = backend()
                _devices = [Device._new(i, b.driver(i), b.name) for i in range(b.device_count())]
    return list(_devices)


def device_count() -> int:
    """The number of devices."""
    return len(devices())


def device(ordinal: int) -> Device:
    """The device with the given ordinal.

    Raises:
        ValueError: No such device.
    """
    all_ = devices()
    if not isinstance(ordinal, int) or isinstance(ordinal, bool):
        raise TypeError(f"device ordinal must be an int, not {type(ordinal).__name__}")
    if not 0 <= ordinal < len(all_):
        raise ValueError(f"no device {ordinal}: there are {len(all_)} device(s)")
    return all_[ordinal]


def current_device() -> Device:
    """The device that ``await op`` uses in this task or thread (device 0 unless changed)."""
    d = _current.get()
    if d is not None:
        return d
    return _devices[0] if _devices is not None else device(0)


def _as_device(d: "Device | int | None") -> Device:
    if d is None:
        return current_device()
    if isinstance(d, Device):
        return d
    return device(d)


@contextlib.contextmanager
def use_device(d: "Device | int") -> Iterator[Device]:
    """Make ``d`` the current device for the block (in this task/thread and the tasks it starts).

    Example::

        with trio_cuda.use_device(1):
            t = await api.zeros((4, 4))   # on device 1
    """
    dev = _as_device(d)
    token = _current.set(dev)
    try:
        yield dev
    finally:
        _current.reset(token)
