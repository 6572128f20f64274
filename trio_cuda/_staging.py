"""Pinned host staging memory for copies between host arrays and device memory.

Copies to and from host arrays go through page-locked (pinned) buffers, so they are
asynchronous. Pinning and unpinning are slow driver calls that may wait for the whole
device to be idle (seen on an H200: a read-back's cuMemHostAlloc waited for a 300 ms
kernel on another stream), so they never run on the trio thread or under the runtime
lock: a submission that needs a buffer the pool lacks pins it in a worker thread (or
the calling thread of ``sync()``) before enqueueing, and buffers are unpinned by a
janitor thread.

Each device has a pool of idle buffers in power-of-two sizes. A buffer returns to the
pool when its copy has completed *and*, for a read-back, the host value was copied
out (or abandoned). Idle buffers beyond the cap (``TRIO_CUDA_STAGING_CAP_MB``,
default 64 MiB per device) are unpinned. A submission whose completion its caller saw
(``await``, ``sync()``, ``Submitted.wait()``) gives its buffers back at once
(:func:`copies_completed`), so the pool is within its cap when the caller resumes; the
buffers of copies nobody waited for go back when their stream is next seen past them.
Everything here runs under the runtime lock except the finalizers, which only append
to lock-free queues, and the janitor's driver calls.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._config import env_int
from ._guard import LOCK

if TYPE_CHECKING:
    from collections.abc import Collection

    from ._backends._boundary import DeviceDriver
    from ._stream import Stream

__all__ = ["Staging", "StagingPool", "copies_completed", "drain", "pool_of"]

_MIN_SIZE = 1 << 12
# The first pinned allocation of a device makes a set at once (about 9 MiB), so that
# most small copies never need the slow path.
_PREFILL = ((1 << 12, 32), (1 << 16, 8), (1 << 20, 4), (1 << 22, 1))


_LARGE = 64 << 20
_LARGE_STEP = 16 << 20


def bucket(nbytes: int) -> int:
    """The pool size class of a copy of ``nbytes``: a power of two (at least 4 KiB) up to
    64 MiB, a multiple of 16 MiB above (a 65 GiB copy pins 65 GiB, not 128)."""
    if nbytes > _LARGE:
        return -(-nbytes // _LARGE_STEP) * _LARGE_STEP
    return max(_MIN_SIZE, 1 << (nbytes - 1).bit_length())


class StagingDevice(Protocol):
    """What the staging pools use of their device. The device drains its pool as it
    retires copies, so it stands above them: they name it by this protocol."""

    ordinal: int
    generation: int
    _driver: DeviceDriver
    _stats: Any
    _slow_lock: threading.Lock

    @property
    def _streams(self) -> Collection[Stream]: ...
    def _housekeeping(self) -> None: ...
    def begin_host_read(self, generation: int) -> bool: ...
    def end_host_read(self) -> None: ...


class Staging:
    """One pinned buffer lent to one copy; back to the pool after its last holder.

    A host-to-device copy has one holder (its stream, until the copy completes); a
    read-back has two (the stream, and the pending host value that copies the data
    out). Each holder calls its ``*_done`` once. The buffer goes back exactly once, by
    whoever sees the last holder go (or by the finalizer, if the holders vanished): a
    one-element deque is the lock-free "once".
    """

    __slots__ = ("__weakref__", "_host_done", "_once", "_stream_done", "buf", "generation", "pool", "size")

    def __init__(self, pool: StagingPool, buf: np.ndarray, size: int, host_hold: bool) -> None:
        self.pool = pool
        self.buf = buf
        self.size = size
        self.generation = pool.device.generation
        self._stream_done = False
        self._host_done = not host_hold
        self._once = collections.deque((True,))

    def stream_done(self) -> None:
        """The copy using the buffer has completed (called by the stream's retire)."""
        self._stream_done = True
        if self._host_done:
            self._give_back()

    def host_done(self) -> None:
        """The host value no longer needs the buffer (copied out, or abandoned)."""
        self._host_done = True
        if self._stream_done:
            self._give_back()

    def _give_back(self) -> None:
        try:
            self._once.pop()
        except IndexError:
            return  # given back already
        self.pool._returned.append((self.generation, self.size, self.buf))

    def __del__(self) -> None:
        # Lost holders (a dead graph's host data, an abandoned submission): nothing can
        # copy through the buffer any more once nothing references this object.
        try:
            self._give_back()
        except Exception:  # interpreter shutdown
            pass


class StagingPool:
    """The pinned buffers of one device (see the module docstring)."""

    def __init__(self, device: StagingDevice) -> None:
        self.device = device
        self.cap = env_int("TRIO_CUDA_STAGING_CAP_MB", 64, minimum=0) << 20
        self._free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._idle = 0  # bytes of idle buffers in _free
        self._pinned = 0  # bytes pinned in all (idle or lent)
        self._prefilled = False
        self._generation = device.generation
        self._returned: collections.deque[tuple[int, int, np.ndarray]] = collections.deque()
        self.pinned_peak = 0
        # Submissions between asking for pinned buffers and taking them: while there are
        # any, idle buffers beyond the cap may be theirs (pinned, not yet taken).
        self._waiting = 0

    # -- under LOCK ----------------------------------------------------------------
    def _sync_generation(self) -> None:
        if self._generation != self.device.generation:
            # Pinned memory of the old context went away with the reset.
            self._generation = self.device.generation
            self._free.clear()
            self._idle = self._pinned = 0
            self.device._stats.staging_bytes = 0
            self._prefilled = False
            self._returned.clear()

    def drain(self) -> None:
        """Take returned buffers back (under LOCK)."""
        self._sync_generation()
        gen = self._generation
        ret = self._returned
        while ret:
            g, size, buf = ret.popleft()
            if g == gen:
                self._put(size, buf)

    def _put(self, size: int, buf: np.ndarray) -> None:
        if self._idle + size > self.cap:
            self._unpin(size, buf)
            self._trim()
            return
        self._free[size].append(buf)
        self._idle += size

    def _trim(self) -> None:
        """Unpin idle buffers beyond the cap, unless a submission waiting for pinned
        memory may be about to take them (it trims when it stops waiting)."""
        if self._waiting:
            return
        free = self._free
        while self._idle > self.cap:
            big = max(k for k, v in free.items() if v)
            self._idle -= big
            self._unpin(big, free[big].pop())

    def wait_begin(self) -> None:
        """A submission asks for pinned buffers and will take them (under LOCK)."""
        self._waiting += 1

    def wait_end(self) -> None:
        """That submission took its buffers, or gave up (cancelled, failed): buffers it
        had pinned and did not take are trimmed to the cap now (under LOCK)."""
        self._waiting -= 1
        self._sync_generation()
        self._trim()

    def _unpin(self, size: int, buf: np.ndarray) -> None:
        self._pinned -= size
        stats = self.device._stats
        stats.staging_bytes = self._pinned
        stats.staging_unpins += 1
        stats.staging_unpinning += size
        _janitor.free(self.device, self._generation, buf, size)

    def take(self, nbytes: int, host_hold: bool) -> Staging | None:
        """An idle buffer for a copy of ``nbytes`` (> 0), or None if the pool has none."""
        self.drain()
        size = bucket(nbytes)
        bufs = self._free.get(size)
        if not bufs:
            # Buffers come back when their stream is seen past the copy: look at every
            # stream of the device before asking for more pinned memory.
            for s in list(self.device._streams):
                if s._keep and s.generation == self.device.generation:
                    s.retire()
            self.device._housekeeping()  # and the streams that died with copies in flight
            self.drain()
            bufs = self._free.get(size)
            if not bufs:
                return None
        self._idle -= size
        return Staging(self, bufs.pop(), size, host_hold)

    def missing(self, sizes: list[int]) -> list[int]:
        """The sizes (of ``sizes``, copy byte counts) the pool cannot lend now."""
        self.drain()
        have = {k: len(v) for k, v in self._free.items()}
        out = []
        for n in sizes:
            b = bucket(n)
            if have.get(b, 0) > 0:
                have[b] -= 1
            else:
                out.append(n)
        if out and not self._prefilled:
            self._prefilled = True  # once, even if several submissions pin at the same time
            room = self.cap - self._idle  # idle pinned memory stays within the cap
            for size, count in _PREFILL:
                for _ in range(count):
                    if size <= room:
                        out.append(size)
                        room -= size
        return out

    def add(self, generation: int, bufs: list[tuple[int, np.ndarray]]) -> None:
        """Put freshly pinned buffers into the pool (under LOCK)."""
        self._sync_generation()
        if generation != self._generation:
            return  # pinned before a reset: gone with the context
        for size, buf in bufs:
            self._pinned += size
            self._free[size].append(buf)
            self._idle += size
        self.pinned_peak = max(self.pinned_peak, self._pinned)
        stats = self.device._stats
        stats.staging_bytes = self._pinned
        stats.staging_pins += len(bufs)
        self._trim()  # pinned for a submission that gave up while the pins were made

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned memory the pool holds (idle or lent)."""
        return self._pinned

    @property
    def idle_bytes(self) -> int:
        return self._idle


def copies_completed(stagings: Iterable[Staging]) -> None:
    """The copies that used ``stagings`` are known complete (their submission's event
    was seen done, and it follows every copy of the submission): the buffers go back to
    their pools now, not when their streams are next retired, and idle memory beyond a
    pool's cap is handed to the janitor. Takes :data:`LOCK` (call it with no lock held,
    after the host values were copied out)."""
    pools: list[StagingPool] = []
    with LOCK:
        for st in stagings:
            st.stream_done()  # again when the stream retires its keep-alive: a no-op then
            if st.pool not in pools:
                pools.append(st.pool)
        for pool in pools:
            pool.drain()


def drain(device: StagingDevice) -> None:
    """Take back the returned buffers of ``device``'s pool, if it has one (under LOCK)."""
    pool = _pools.get(device.ordinal)
    if pool is not None:
        pool.drain()


def pin(device: StagingDevice, sizes: list[int]) -> None:
    """Pin buffers for copies of ``sizes`` bytes into the device's pool (slow; no LOCK held).

    Runs in a worker thread for ``await`` (or the calling thread of ``sync()``).
    """
    with LOCK:
        pool = pool_of(device)
        generation = device.generation
    made: list[tuple[int, np.ndarray]] = []
    with device._slow_lock:
        if generation == device.generation:
            for n in sizes:
                size = bucket(n)
                made.append((size, device._driver.host_alloc(size)))
    with LOCK:
        pool.add(generation, made)


_pools: dict[int, StagingPool] = {}


def pool_of(device: StagingDevice) -> StagingPool:
    """The staging pool of ``device`` (under LOCK)."""
    p = _pools.get(device.ordinal)
    if p is None:
        p = _pools[device.ordinal] = StagingPool(device)
    return p


class _Janitor:
    """Unpins buffers in a background thread (unpinning may wait for the device)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, int, np.ndarray, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # leaf: guards _thread
        self.freed = 0

    def free(self, device: StagingDevice, generation: int, buf: np.ndarray, size: int) -> None:
        """Unpin ``buf`` soon (under LOCK; ``size`` bytes are counted in the device's
        ``staging_unpinning`` until then)."""
        self._queue.put((device, generation, buf, size))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trio-cuda-janitor", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            device, generation, buf, size = self._queue.get()
            stats = device._stats
            with device._slow_lock:
                if generation == device.generation:
                    try:
                        device._driver.host_free(buf)
                    except Exception:  # a faulted device: the memory goes with the process
                        pass
            del buf
            with LOCK:  # after the slow lock, never inside it (the lock order)
                stats.staging_unpinning -= size
            self.freed += 1


_janitor = _Janitor()
