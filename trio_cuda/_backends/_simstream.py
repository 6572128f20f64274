"""The simulated device's streams and what runs on them: commands, events and their
tickets, allocations, open captures and graphs (see _sim for what is simulated)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from .._errors import DeviceFault
from ._boundary import Waker

__all__ = [
    "Alloc",
    "Command",
    "ForeignFailure",
    "SimCapture",
    "SimEvent",
    "SimGraph",
    "SimStream",
    "SimWaker",
    "StreamOwner",
    "Ticket",
    "describe_fault",
]


class StreamOwner(Protocol):
    """The simulated device a stream runs for: a stream stops at a reset (a new
    generation) and runs nothing while the device is faulted."""

    ordinal: int
    generation: int
    _fault: DeviceFault | None
    _wakers: set[Waker]

    def _run(self, stream: SimStream, cmd: Command) -> None: ...


class SimWaker(Waker):
    def __init__(self) -> None:
        self._sem = threading.Semaphore(0)

    def wait(self, timeout: float | None) -> bool:
        if not self._sem.acquire(timeout=timeout):
            return False
        while self._sem.acquire(blocking=False):
            pass  # (the posts that piled up: this one wake-up serves them)
        return True

    def post(self) -> None:
        self._sem.release()


class Ticket:
    """One record of an event: complete once the stream reaches it (maybe with an error)."""

    __slots__ = ("armed", "done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: DeviceFault | None = None
        self.armed: list[Waker] = []


class SimEvent:
    """An event: its latest record (a ticket)."""

    __slots__ = ("__weakref__", "device", "ticket")

    def __init__(self, device: StreamOwner) -> None:
        self.device = device
        self.ticket: Ticket | None = None  # never recorded: complete


class SimGraph:
    __slots__ = ("commands", "device")

    def __init__(self, device: StreamOwner, commands: list[Command]) -> None:
        self.device = device
        self.commands = commands


class SimCapture:
    """An open capture: the commands of every stream that joined it, in enqueue order."""

    __slots__ = ("commands", "origin", "streams")

    def __init__(self, origin: SimStream) -> None:
        self.origin = origin
        self.commands: list[Command] = []
        self.streams: set[SimStream] = {origin}


class Command:
    """A unit of stream work: what it does, and which allocations it reads and writes."""

    __slots__ = ("always", "fn", "full", "reads", "what", "writes")

    def __init__(
        self,
        fn: Callable[[], None],
        what: str,
        reads: tuple[int, ...] = (),
        writes: tuple[int, ...] = (),
        full: bool = False,
        always: bool = False,
    ) -> None:
        self.fn = fn
        self.what = what
        self.reads = reads  # device pointers read
        self.writes = writes  # device pointers written
        self.full = full  # the write covers its whole allocation (clears poison)
        self.always = always  # runs after a failed wait too (event records, frees)


class Alloc:
    __slots__ = ("data", "nbytes", "poison")

    def __init__(self, size: int, nbytes: int) -> None:
        self.data = np.zeros(size, dtype=np.uint8)
        self.nbytes = nbytes  # as requested (data is rounded up)
        self.poison: DeviceFault | None = None


class SimStream:
    __slots__ = ("__weakref__", "capture", "device", "error", "freeing", "generation", "queue", "thread")

    def __init__(self, device: StreamOwner) -> None:
        self.device = device
        self.freeing = 0  # bytes whose free is queued on it: its later allocations may reuse them
        self.generation = device.generation
        self.queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.capture: SimCapture | None = None
        self.error: DeviceFault | None = None  # a failed cross-device wait, until the next record

    def enqueue(self, cmd: Command) -> None:
        if self.capture is not None:
            self.capture.commands.append(cmd)
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name=f"trio-cuda-sim-stream-{self.device.ordinal}", daemon=True)
            self.thread.start()
        self.queue.put(cmd)

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)

    def _work(self) -> None:
        device = self.device
        while True:
            cmd = self.queue.get()
            if cmd is None or self.generation != device.generation:
                return
            if device._fault is not None:
                continue  # a faulted device runs nothing
            device._run(self, cmd)


def describe_fault(what: str, exc: BaseException) -> DeviceFault:
    if isinstance(exc, DeviceFault):
        return exc
    if isinstance(exc, IndexError):
        kind = "illegal memory access (index out of bounds)"
    elif isinstance(exc, ValueError) and "read-only" in str(exc):
        kind = "write to a read-only input (pass a tensor the kernel writes as a partition)"
    else:
        kind = f"{type(exc).__name__}"
    fault = DeviceFault(f"{kind}: {exc}", op=what)
    fault.__cause__ = exc
    return fault


class ForeignFailure(Exception):
    """A stream wait whose event belongs to a device that faulted or was reset."""

    def __init__(self, fault: DeviceFault) -> None:
        self.fault = fault
