"""The simulated device: a faithful, GPU-free implementation of the backend boundary.

What is simulated, and how:

* **Streams** are worker threads, each running its commands in FIFO order, so work
  on different streams really overlaps (whenever it does not hold the GIL).
* **Events** hold their latest record (a ticket): ``record`` enqueues a command that
  completes a new ticket; ``wait_event`` enqueues a command that blocks its stream until
  the ticket current at call time completes, so re-recording never releases an earlier
  waiter. An event never recorded counts as complete, as on CUDA.
* **Memory** is numpy byte arrays at fake 256-byte aligned addresses with a
  configurable capacity (``TRIO_CUDA_SIM_MEMORY`` bytes, default 4 GiB). Allocation
  is reserved at call time and released when the stream reaches the free,
  like stream-ordered allocation.
* **Kernels** run through numba's CUDA simulator (one kernel at a time, process-wide,
  as the simulator requires), on numpy views of device memory. Inputs (tensor
  arguments) are read-only views, so a kernel that writes an input is caught.
* **Faults**: an exception inside a command (an out-of-bounds index in a kernel, a
  write to an input) makes the device faulted, as an illegal address does on CUDA:
  queued and later work is dropped, every query and wait raises the fault, and only
  ``reset`` clears it.
* **Graphs**: while a stream captures, commands are recorded instead of run;
  replay runs the recorded commands in capture order on the launching stream.

``TRIO_CUDA_SIM_DEVICES`` sets the number of simulated devices (default 1).
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .._errors import DeviceFault, DeviceOutOfMemory, GraphCaptureError, LaunchError
from ._boundary import ArrayArg, Backend, DeviceDriver, KernelSource, Waker

__all__ = ["SimBackend"]

# One condition guards the state of every simulated event, across devices, so a
# stream of one device can wait on an event of another.
_cond = threading.Condition()
# numba's simulator supports one kernel at a time per process.
_kernel_lock = threading.Lock()

_ALIGN = 256


class _SimWaker(Waker):
    def __init__(self) -> None:
        self._sem = threading.Semaphore(0)

    def wait(self, timeout: float | None) -> bool:
        return self._sem.acquire(timeout=timeout)

    def post(self) -> None:
        self._sem.release()


class _Ticket:
    """One record of an event: complete once the stream reaches it."""

    __slots__ = ("done", "armed")

    def __init__(self) -> None:
        self.done = False
        self.armed: list[Waker] = []


class _SimEvent:
    """An event: its latest record (a ticket). Waits capture the ticket current at call
    time, so re-recording an event never releases earlier waiters early, as on CUDA."""

    __slots__ = ("device", "ticket")

    def __init__(self, device: "_SimDevice") -> None:
        self.device = device
        self.ticket: _Ticket | None = None  # never recorded: complete


class _SimGraph:
    __slots__ = ("device", "commands")

    def __init__(self, device: "_SimDevice", commands: list[tuple[Callable[[], None], str]]) -> None:
        self.device = device
        self.commands = commands


class _Capture:
    """An open capture: the commands of every stream that joined it, in enqueue order."""

    __slots__ = ("origin", "commands", "streams")

    def __init__(self, origin: "_SimStream") -> None:
        self.origin = origin
        self.commands: list[tuple[Callable[[], None], str]] = []
        self.streams: set[_SimStream] = {origin}


class _SimStream:
    __slots__ = ("device", "generation", "queue", "thread", "capture")

    def __init__(self, device: "_SimDevice") -> None:
        self.device = device
        self.generation = device.generation
        self.queue: queue.SimpleQueue[tuple[Callable[[], None], str] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.capture: _Capture | None = None

    def enqueue(self, fn: Callable[[], None], what: str) -> None:
        if self.capture is not None:
            self.capture.commands.append((fn, what))
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name=f"trio-cuda-sim-stream-{self.device.ordinal}", daemon=True)
            self.thread.start()
        self.queue.put((fn, what))

    def _work(self) -> None:
        device = self.device
        while True:
            item = self.queue.get()
            if item is None or self.generation != device.generation:
                return
            fn, what = item
            if device._fault is not None:
                continue  # a faulted device runs nothing
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - a fault, whatever raised it
                device._set_fault(_describe_fault(what, exc))


def _describe_fault(what: str, exc: BaseException) -> DeviceFault:
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


class _SimDevice(DeviceDriver):
    def __init__(self, ordinal: int, capacity: int) -> None:
        self.ordinal = ordinal
        self.name = f"trio-cuda simulated device {ordinal}"
        self.compute_capability = (9, 0)
        self.total_memory = capacity
        self.generation = 0
        self._fault: DeviceFault | None = None
        self._lock = threading.Lock()
        self._allocs: dict[int, np.ndarray] = {}
        self._bases: list[int] = []
        self._next = _ALIGN * (1 + ordinal) << 36  # distinct address ranges per device
        self._in_use = 0
        self._wakers: set[Waker] = set()
        self._kernels: dict[int, Any] = {}

    # -- faults ---------------------------------------------------------------
    def _set_fault(self, fault: DeviceFault) -> None:
        if fault.device is None:
            fault = DeviceFault(fault.message, device=self.ordinal, op=fault.op)
        with _cond:
            if self._fault is None:
                self._fault = fault
            wakers = list(self._wakers)
            _cond.notify_all()
        for w in wakers:
            w.post()

    def fault(self) -> BaseException | None:
        return self._fault

    def _check(self) -> None:
        if self._fault is not None:
            raise self._fault

    def reset(self) -> None:
        with _cond:
            self.generation += 1
            self._fault = None
            _cond.notify_all()
        with self._lock:
            self._allocs.clear()
            self._bases.clear()
            self._in_use = 0

    # -- streams and events ---------------------------------------------------
    def create_stream(self) -> _SimStream:
        self._check()
        return _SimStream(self)

    def create_event(self) -> _SimEvent:
        return _SimEvent(self)

    def _live(self, stream: _SimStream) -> _SimStream:
        if stream.generation != self.generation:
            raise LaunchError("stream belongs to the device before its reset", device=self.ordinal)
        return stream

    def record(self, event: _SimEvent, stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        ticket = _Ticket()
        event.ticket = ticket
        if stream.capture is not None:
            # As on CUDA, a record inside a capture only marks a point for other streams
            # of the capture to depend on; it adds no node.
            _capture_events[event] = stream.capture
            return
        stream.enqueue(lambda: self._complete(ticket), "event record")

    def _complete(self, ticket: _Ticket) -> None:
        with _cond:
            ticket.done = True
            ready = ticket.armed
            ticket.armed = []
            _cond.notify_all()
        for w in ready:
            w.post()

    def wait_event(self, stream: _SimStream, event: _SimEvent) -> None:
        self._check()
        self._live(stream)
        ticket = event.ticket
        # A stream that waits on an event recorded in an open capture joins that capture;
        # a capture replays its commands in capture order, so nothing is left to wait for.
        cap = _capture_events.get(event)
        if cap is not None:
            if stream.capture is None:
                stream.capture = cap
                cap.streams.add(stream)
            return
        if ticket is None or ticket.done:
            return
        src = event.device

        def wait() -> None:
            with _cond:
                while not ticket.done:
                    if src._fault is not None:
                        raise DeviceFault(f"waited on an event of device {src.ordinal}, which faulted: {src._fault}")
                    if src.generation != gen_src or self.generation != stream.generation:
                        return
                    _cond.wait()

        gen_src = src.generation
        stream.enqueue(wait, "stream wait")

    def query(self, event: _SimEvent) -> bool:
        dev = event.device
        if dev._fault is not None:
            raise dev._fault
        t = event.ticket
        return t is None or t.done

    def synchronize(self, event: _SimEvent) -> None:
        dev = event.device
        gen = dev.generation
        ticket = event.ticket
        with _cond:
            while ticket is not None and not ticket.done:
                if dev._fault is not None:
                    raise dev._fault
                if dev.generation != gen:
                    return
                _cond.wait()
        if dev._fault is not None:
            raise dev._fault

    def arm(self, event: _SimEvent, stream: _SimStream, waker: Waker) -> None:
        dev = event.device
        ticket = event.ticket
        with _cond:
            dev._wakers.add(waker)
            done = ticket is None or ticket.done or dev._fault is not None
            if not done:
                ticket.armed.append(waker)
        if done:
            waker.post()

    # -- memory ---------------------------------------------------------------
    def alloc(self, nbytes: int, stream: _SimStream) -> int:
        self._check()
        self._live(stream)
        if stream.capture is not None:
            raise GraphCaptureError("allocation inside a graph capture", device=self.ordinal)
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            if self._in_use + size > self.total_memory:
                raise DeviceOutOfMemory(
                    f"cannot allocate {nbytes} bytes: {self._in_use} of {self.total_memory} bytes in use",
                    device=self.ordinal,
                )
            ptr = self._next
            self._next += size
            self._allocs[ptr] = np.zeros(size, dtype=np.uint8)
            bisect.insort(self._bases, ptr)
            self._in_use += size
        return ptr

    def free(self, ptr: int, stream: _SimStream) -> None:
        gen = self.generation

        def release() -> None:
            with self._lock:
                if self.generation != gen:
                    return
                buf = self._allocs.pop(ptr)
                del self._bases[bisect.bisect_left(self._bases, ptr)]
                self._in_use -= buf.nbytes

        if self._fault is not None or stream.generation != gen:
            if stream.generation == gen:  # a faulted device runs nothing: free now
                release()
            return
        stream.enqueue(release, "free")

    def memory_in_use(self) -> int:
        return self._in_use

    def _bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i >= 0:
                base = self._bases[i]
                buf = self._allocs[base]
                off = ptr - base
                if off + nbytes <= buf.nbytes:
                    return buf[off : off + nbytes]
        raise IndexError(f"illegal address: {nbytes} bytes at {ptr:#x} are not allocated on device {self.ordinal}")

    def host_alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def host_free(self, buf: np.ndarray) -> None:
        pass

    def fill(self, ptr: int, nbytes: int, pattern: bytes, stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        pat = np.frombuffer(pattern, dtype=np.uint8)

        def run() -> None:
            dst = self._bytes(ptr, nbytes)
            dst.reshape(-1, len(pat))[:] = pat

        stream.enqueue(run, "fill")

    def copy_h2d(self, dst: int, src: np.ndarray, stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        data = src.reshape(-1).view(np.uint8)

        def run() -> None:
            self._bytes(dst, data.nbytes)[:] = data

        stream.enqueue(run, "copy host to device")

    def copy_d2h(self, dst: np.ndarray, src: int, stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        out = dst.reshape(-1).view(np.uint8)

        def run() -> None:
            out[:] = self._bytes(src, out.nbytes)

        stream.enqueue(run, "copy device to host")

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: _SimStream) -> None:
        self._check()
        self._live(stream)

        def run() -> None:
            self._bytes(dst, nbytes)[:] = self._bytes(src, nbytes)

        stream.enqueue(run, "copy device to device")

    def copy_peer(self, dst: int, src_driver: DeviceDriver, src: int, nbytes: int, stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        assert isinstance(src_driver, _SimDevice)

        def run() -> None:
            src_driver._check()
            self._bytes(dst, nbytes)[:] = src_driver._bytes(src, nbytes)

        stream.enqueue(run, f"copy from device {src_driver.ordinal}")

    def mem_info(self) -> tuple[int, int]:
        return self.total_memory - self._in_use, self.total_memory

    # -- kernels --------------------------------------------------------------
    def _compiled(self, source: KernelSource) -> Any:
        k = self._kernels.get(id(source))
        if k is None:
            from numba import cuda

            k = cuda.jit(source.py_func)
            self._kernels[id(source)] = k
        return k

    def prepare_launch(
        self,
        source: KernelSource,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[ArrayArg | int | float | bool | np.generic],
    ) -> tuple[Any, ...]:
        _check_launch_config(source.name, grid, block, self.ordinal)
        impl = source.host_impl
        compiled = None if impl is not None else self._compiled(source)
        return (source.name, impl, compiled, grid, block, tuple(args))

    def launch(self, prepared: tuple[Any, ...], stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        name, impl, compiled, grid, block, args = prepared

        def run() -> None:
            values = [self._array(a) if isinstance(a, ArrayArg) else a for a in args]
            if impl is not None:
                impl(*values)
                return
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            wrapped = [FakeCUDAArray(v) if isinstance(v, np.ndarray) else v for v in values]
            with _kernel_lock:
                compiled[grid, block](*wrapped)

        stream.enqueue(run, f"kernel {name}")

    def _array(self, a: ArrayArg) -> np.ndarray:
        if a.shape:
            span = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.dtype.itemsize
        else:
            span = a.dtype.itemsize
        if any(n == 0 for n in a.shape):
            span = 0
        raw = self._bytes(a.ptr, max(span, 0))
        arr = np.ndarray(a.shape, dtype=a.dtype, buffer=raw, strides=a.strides)
        if not a.writable:
            arr.flags.writeable = False
        return arr

    # -- graphs ---------------------------------------------------------------
    def begin_capture(self, stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        if stream.capture is not None:
            raise GraphCaptureError("the stream is capturing already", device=self.ordinal)
        stream.capture = _Capture(stream)

    def end_capture(self, stream: _SimStream) -> _SimGraph:
        cap = stream.capture
        if cap is None or cap.origin is not stream:
            raise GraphCaptureError("the stream did not begin a capture", device=self.ordinal)
        for s in cap.streams:
            s.capture = None
        for ev in [e for e, c in _capture_events.items() if c is cap]:
            del _capture_events[ev]
        return _SimGraph(self, list(cap.commands))

    def graph_launch(self, graph: _SimGraph, stream: _SimStream) -> None:
        self._check()
        self._live(stream)
        commands = graph.commands

        def run() -> None:
            for fn, what in commands:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001
                    raise _describe_fault(f"graph node {what}", exc) from exc

        stream.enqueue(run, "graph launch")

    def graph_nodes(self, graph: _SimGraph) -> int:
        return len(graph.commands)

    def graph_destroy(self, graph: _SimGraph) -> None:
        graph.commands = []


# Events recorded inside an open capture, and the capture they belong to.
_capture_events: dict[_SimEvent, _Capture] = {}


def _check_launch_config(name: str, grid: tuple[int, int, int], block: tuple[int, int, int], ordinal: int) -> None:
    bx, by, bz = block
    gx, gy, gz = grid
    if min(block) < 1 or min(grid) < 1:
        raise LaunchError(f"invalid launch configuration grid={grid} block={block}", device=ordinal, op=name)
    if bx > 1024 or by > 1024 or bz > 64 or bx * by * bz > 1024:
        raise LaunchError(
            f"too many threads per block: block={block} ({bx * by * bz} threads; at most 1024)",
            device=ordinal,
            op=name,
        )
    if gx > 2**31 - 1 or gy > 65535 or gz > 65535:
        raise LaunchError(f"grid too large: {grid}", device=ordinal, op=name)


class SimBackend(Backend):
    name = "sim"
    # Simulated kernels run on Python threads: a long-polling trio thread would hold the
    # GIL they need, so awaits park early.
    poll_budget_us = 100.0

    def __init__(self) -> None:
        count = int(os.environ.get("TRIO_CUDA_SIM_DEVICES", "1"))
        capacity = int(os.environ.get("TRIO_CUDA_SIM_MEMORY", str(4 << 30)))
        if count < 1:
            raise ValueError(f"TRIO_CUDA_SIM_DEVICES must be at least 1, not {count}")
        self._devices = [_SimDevice(i, capacity) for i in range(count)]
        self.description = f"simulated device ({count} device{'s' if count != 1 else ''}, kernels through numba's CUDA simulator)"

    def device_count(self) -> int:
        return len(self._devices)

    def driver(self, ordinal: int) -> DeviceDriver:
        return self._devices[ordinal]

    def new_waker(self) -> Waker:
        return _SimWaker()
