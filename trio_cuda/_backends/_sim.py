"""The simulated device: a faithful, GPU-free implementation of the backend boundary.

What is simulated, and how:

* **Streams** are worker threads, each running its commands in FIFO order, so work
  on different streams really overlaps (whenever it does not hold the GIL). A
  destroyed stream finishes its queued commands and its thread exits.
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
  Compiled kernels are cached by the kernel's content key, never by ``id``.
* **Faults**: an exception inside a command (an out-of-bounds index in a kernel, a
  write to an input) makes the device faulted, as an illegal address does on CUDA:
  queued and later work is dropped, every query and wait raises the fault, and only
  ``reset`` clears it.
* **Faults stay on their device**: a stream that waits for an event of *another*
  device which faulted (or was reset) does not fault its own device. The wait fails:
  the stream skips its commands up to its next event record, that record completes
  with the error (so the op that waited fails with DeviceFault), and the memory the
  skipped commands would have written is *poisoned*: a later command reading it
  fails the same way, until a copy or fill rewrites the whole allocation.
* **Graphs**: while a stream captures, commands are recorded instead of run;
  replay runs the recorded commands in capture order on the launching stream.

``TRIO_CUDA_SIM_DEVICES`` sets the number of simulated devices (default 1).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._config import env_flag, env_int
from .._errors import DeviceFault, DeviceOutOfMemory, GraphCaptureError, LaunchError, fresh
from ._boundary import (
    ArrayArg,
    AttentionDesc,
    Backend,
    CollectiveCall,
    DeviceDriver,
    GemmDesc,
    GemmOperand,
    KernelSource,
    Waker,
    gemm_dtype,
)
from ._simattention import attend
from ._simcollectives import ProcessComm, Rendezvous, SimComms
from ._simstream import (
    Alloc,
    Command,
    ForeignFailure,
    SimCapture,
    SimEvent,
    SimGraph,
    SimStream,
    SimWaker,
    Ticket,
    describe_fault,
)

__all__ = ["SimBackend"]


_OPS_NUMBA = env_flag("TRIO_CUDA_SIM_OPS_NUMBA")


def _tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 mantissa bits, round to nearest even)."""
    u: Any = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
    out: np.ndarray = (u & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return out


# One condition guards the state of every simulated event, across devices, so a
# stream of one device can wait on an event of another.
_cond = threading.Condition()
# numba's simulator supports one kernel at a time per process.
_kernel_lock = threading.Lock()
# Wakers live for the whole process (see Waker).
_wakers: list[SimWaker] = []

_ALIGN = 256


class _SimDevice(DeviceDriver):
    def __init__(self, ordinal: int, capacity: int) -> None:
        self.ordinal = ordinal
        self.name = f"trio-cuda simulated device {ordinal}"
        self.compute_capability = (9, 0)
        self.total_memory = capacity
        self.generation = 0
        self._fault: DeviceFault | None = None
        self._lock = threading.Lock()
        self._allocs: dict[int, Alloc] = {}
        self._bases: list[int] = []
        self._next = _ALIGN * (1 + ordinal) << 36  # distinct address ranges per device
        self._in_use = 0
        self._wakers: set[Waker] = set()
        self._kernels: dict[str, Any] = {}
        self._streams: weakref.WeakSet[SimStream] = weakref.WeakSet()
        self._adopted: dict[int, Any] = {}  # adopted host memory -> its owner
        self._process_comms: weakref.WeakSet[ProcessComm] = weakref.WeakSet()  # told of a reset

    # -- faults ---------------------------------------------------------------
    def set_fault(self, fault: DeviceFault) -> None:
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
            raise fresh(self._fault)

    def reset(self) -> None:
        with _cond:
            self.generation += 1
            self._fault = None
            wakers = list(self._wakers)
            _cond.notify_all()
        for s in list(self._streams):
            s.close()
        for c in list(self._process_comms):
            c.abandon()  # the parts its streams will never run: the peers hear at once
        with self._lock:
            self._allocs.clear()
            self._bases.clear()
            self._in_use = 0
        for w in wakers:
            w.post()

    # -- running commands -----------------------------------------------------
    def _run(self, stream: SimStream, cmd: Command) -> None:
        if cmd.always:
            try:
                cmd.fn()
            except BaseException as exc:
                self.set_fault(describe_fault(cmd.what, exc))
            return
        err = stream.error
        if err is None:
            for ptr in cmd.reads:
                a = self._alloc_at(ptr)
                if a is not None and a.poison is not None:
                    err = stream.error = DeviceFault(
                        f"{cmd.what} reads data that a failed op did not write ({a.poison.message})",
                        device=self.ordinal,
                        op=cmd.what,
                    )
                    break
        if err is not None:
            self._poison(cmd.writes, err)
            return
        try:
            cmd.fn()
        except ForeignFailure as f:
            stream.error = f.fault
            self._poison(cmd.writes, f.fault)  # what it would have written is not there
            return
        except BaseException as exc:
            self.set_fault(describe_fault(cmd.what, exc))
            return
        if cmd.full:
            for ptr in cmd.writes:
                a = self._alloc_at(ptr)
                if a is not None:
                    a.poison = None

    def _poison(self, ptrs: tuple[int, ...], err: DeviceFault) -> None:
        for ptr in ptrs:
            a = self._alloc_at(ptr)
            if a is not None:
                a.poison = err

    def _alloc_at(self, ptr: int) -> Alloc | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                return None
            a = self._allocs[self._bases[i]]
            return a if ptr < self._bases[i] + a.data.nbytes else None

    # -- streams and events ---------------------------------------------------
    def create_stream(self) -> SimStream:
        self._check()
        s = SimStream(self)
        self._streams.add(s)
        return s

    def destroy_stream(self, stream: SimStream) -> None:
        stream.close()

    def create_event(self) -> SimEvent:
        return SimEvent(self)

    def _live(self, stream: SimStream) -> SimStream:
        if stream.generation != self.generation:
            raise LaunchError("stream belongs to the device before its reset", device=self.ordinal)
        return stream

    def record(self, event: SimEvent, stream: SimStream) -> None:
        self._check()
        self._live(stream)
        ticket = Ticket()
        event.ticket = ticket
        if stream.capture is not None:
            # As on CUDA, a record inside a capture only marks a point for other streams
            # of the capture to depend on; it adds no node.
            _capture_events[event] = stream.capture
            return
        _capture_events.pop(event, None)  # a handle recycled from a capture is an ordinary event again

        def complete() -> None:
            err = stream.error
            stream.error = None  # the failure ends with this submission's record
            with _cond:
                ticket.error = err
                ticket.done = True
                ready = ticket.armed
                ticket.armed = []
                _cond.notify_all()
            for w in ready:
                w.post()

        # A record runs even after a failed wait: it carries the failure to the waiters.
        stream.enqueue(Command(complete, "event record", always=True))

    def wait_event(self, stream: SimStream, event: SimEvent, *, ordering_only: bool = False) -> None:
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
        if ticket is None or (ticket.done and (ticket.error is None or ordering_only)):
            return
        src = event.device
        gen_src = src.generation

        def wait() -> None:
            with _cond:
                while not ticket.done:
                    if src._fault is not None:
                        if src is self:
                            raise fresh(src._fault)
                        if ordering_only:
                            return
                        raise ForeignFailure(
                            DeviceFault(
                                f"waited for work of device {src.ordinal}, which faulted: {src._fault.message}",
                                device=self.ordinal,
                            )
                        )
                    if src.generation != gen_src:
                        if ordering_only:
                            return
                        raise ForeignFailure(
                            DeviceFault(f"waited for work of device {src.ordinal}, which was reset", device=self.ordinal)
                        )
                    if self.generation != stream.generation:
                        return
                    _cond.wait()
            if ticket.error is not None and not ordering_only:
                raise ForeignFailure(ticket.error)

        stream.enqueue(Command(wait, f"wait for device {src.ordinal}" if src is not self else "stream wait"))

    def query(self, event: SimEvent) -> bool:
        dev = event.device
        if dev._fault is not None:
            raise fresh(dev._fault)
        t = event.ticket
        if t is None:
            return True
        if t.done and t.error is not None:
            raise fresh(t.error)
        return t.done

    def arm(self, event: SimEvent, stream: SimStream | None, waker: Waker) -> None:
        dev = event.device
        ticket = event.ticket
        with _cond:
            dev._wakers.add(waker)
            done = ticket is None or ticket.done or dev._fault is not None
            if not done:
                assert ticket is not None
                ticket.armed.append(waker)
        if done:
            waker.post()

    # -- memory ---------------------------------------------------------------
    def alloc(self, nbytes: int, stream: SimStream) -> int:
        self._check()
        self._live(stream)
        if stream.capture is not None:
            raise GraphCaptureError("allocation inside a graph capture", device=self.ordinal)
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            # Like CUDA's stream-ordered allocator: memory freed earlier on the same stream
            # can serve this allocation (the free comes first in the stream's order).
            if self._in_use - stream.freeing + size > self.total_memory:
                raise DeviceOutOfMemory(
                    f"cannot allocate {nbytes} bytes: {self._in_use} of {self.total_memory} bytes in use",
                    device=self.ordinal,
                )
            ptr = self._next
            self._next += size
            self._allocs[ptr] = Alloc(size, nbytes)
            bisect.insort(self._bases, ptr)
            self._in_use += size
        return ptr

    def adopt(self, address: int, nbytes: int, owner: Any) -> int:
        """Host memory another library owns (``owner`` keeps it alive) as memory of this
        simulated device, without a copy: a device address that reaches it."""
        self._check()
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(address)
        raw._owner = owner  # type: ignore[attr-defined]  # every view of the memory keeps its owner alive
        view = np.ctypeslib.as_array(raw)[:nbytes]
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        a = Alloc.__new__(Alloc)
        a.data, a.nbytes, a.poison = view, nbytes, None
        with self._lock:
            ptr = self._next
            self._next += size
            self._allocs[ptr] = a
            bisect.insort(self._bases, ptr)
        self._adopted[ptr] = owner
        return ptr

    def release_adopted(self, ptr: int) -> None:
        with self._lock:
            if self._allocs.pop(ptr, None) is not None:
                del self._bases[bisect.bisect_left(self._bases, ptr)]
        self._adopted.pop(ptr, None)

    def free(self, ptr: int, stream: SimStream) -> None:
        gen = self.generation

        queued = 0

        def release() -> None:
            with self._lock:
                stream.freeing -= queued
                if self.generation != gen:
                    return
                a = self._allocs.pop(ptr)
                del self._bases[bisect.bisect_left(self._bases, ptr)]
                self._in_use -= a.data.nbytes

        if self._fault is not None or stream.generation != gen:
            if stream.generation == gen:  # a faulted device runs nothing: free now
                release()
            return
        with self._lock:
            a = self._allocs.get(ptr)
            queued = a.data.nbytes if a is not None else 0
            stream.freeing += queued
        # A free runs even on a stream whose wait failed (memory is returned regardless).
        stream.enqueue(Command(release, "free", always=True))

    def memory_in_use(self) -> int:
        return self._in_use

    def _bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i >= 0:
                base = self._bases[i]
                buf = self._allocs[base].data
                off = ptr - base
                if off + nbytes <= buf.nbytes:
                    return buf[off : off + nbytes]
        raise IndexError(f"illegal address: {nbytes} bytes at {ptr:#x} are not allocated on device {self.ordinal}")

    def _whole(self, ptr: int, nbytes: int) -> bool:
        with self._lock:
            a = self._allocs.get(ptr)
        return a is not None and nbytes >= a.nbytes

    def host_alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def host_free(self, buf: np.ndarray) -> None:
        pass

    def fill(self, ptr: int, nbytes: int, pattern: bytes, stream: SimStream) -> None:
        self._check()
        self._live(stream)
        pat = np.frombuffer(pattern, dtype=np.uint8)

        def run() -> None:
            dst = self._bytes(ptr, nbytes)
            dst.reshape(-1, len(pat))[:] = pat

        stream.enqueue(Command(run, "fill", (), (ptr,), self._whole(ptr, nbytes)))

    def copy_h2d(self, dst: int, src: np.ndarray, stream: SimStream) -> None:
        self._check()
        self._live(stream)
        data = src.reshape(-1).view(np.uint8)

        def run() -> None:
            self._bytes(dst, data.nbytes)[:] = data

        stream.enqueue(Command(run, "copy host to device", (), (dst,), self._whole(dst, data.nbytes)))

    def copy_d2h(self, dst: np.ndarray, src: int, stream: SimStream) -> None:
        self._check()
        self._live(stream)
        out = dst.reshape(-1).view(np.uint8)

        def run() -> None:
            out[:] = self._bytes(src, out.nbytes)

        stream.enqueue(Command(run, "copy device to host", (src,), ()))

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: SimStream) -> None:
        self._check()
        self._live(stream)

        def run() -> None:
            self._bytes(dst, nbytes)[:] = self._bytes(src, nbytes)

        stream.enqueue(Command(run, "copy device to device", (src,), (dst,), self._whole(dst, nbytes)))

    def copy_peer(self, dst: int, src_driver: DeviceDriver, src: int, nbytes: int, stream: SimStream) -> None:
        self._check()
        self._live(stream)
        assert isinstance(src_driver, _SimDevice)
        gen_src = src_driver.generation

        def run() -> None:
            if src_driver._fault is not None or src_driver.generation != gen_src:
                raise ForeignFailure(
                    DeviceFault(f"copy from device {src_driver.ordinal}, which faulted or was reset", device=self.ordinal)
                )
            a = src_driver._alloc_at(src)
            if a is not None and a.poison is not None:
                raise ForeignFailure(
                    DeviceFault(f"copy from device {src_driver.ordinal} of data a failed op did not write", device=self.ordinal)
                )
            self._bytes(dst, nbytes)[:] = src_driver._bytes(src, nbytes)

        stream.enqueue(Command(run, f"copy from device {src_driver.ordinal}", (), (dst,), self._whole(dst, nbytes)))

    def mem_info(self) -> tuple[int, int]:
        return self.total_memory - self._in_use, self.total_memory

    # -- libraries ------------------------------------------------------------
    # -- tracing ----------------------------------------------------------------
    def trace_clock(self) -> Any:
        return None  # simulated streams run on host threads: stamps are host times

    def timestamp(self, stream: SimStream) -> list[float]:
        stamp: list[float] = []
        if stream.capture is None and stream.generation == self.generation:
            stream.enqueue(Command(lambda: stamp.append(time.perf_counter()), "timestamp", always=True))
        return stamp

    def timestamp_seconds(self, reference: Any, stamp: list[float]) -> float | None:
        return stamp[0] if stamp else None

    def matmul(
        self,
        desc: GemmDesc,
        a: int,
        b: int,
        d: int,
        bias: int,
        stream: SimStream,
        capturing: bool | None = None,
        foreign: bool = False,
        reuse: bool = False,
    ) -> None:
        """numpy's matmul with cuBLASLt's arithmetic: float32 accumulation for half types
        (float64 for float64), TF32 rounding of float32 inputs when allowed, the epilogue
        in the accumulation type, one rounding into D."""
        self._check()
        self._live(stream)
        dt = gemm_dtype(desc.dtype)
        nbytes = desc.batch * desc.m * desc.n * dt.itemsize

        def run() -> None:
            acc = np.float64 if dt == np.float64 else np.float32
            x = self._matrices(a, desc.a, desc.batch, dt).astype(acc)
            y = self._matrices(b, desc.b, desc.batch, dt).astype(acc)
            if desc.allow_tf32 and dt == np.float32:
                x, y = _tf32(x), _tf32(y)
            with np.errstate(all="ignore"):
                r = np.matmul(x, y)
                if desc.has_bias:
                    r = r + self._bytes(bias, desc.n * dt.itemsize).view(dt).astype(acc)
                if desc.activation == "relu":
                    r = np.maximum(r, acc(0))
                elif desc.activation == "gelu":
                    r = acc(0.5) * r * (1 + np.tanh(acc(0.7978845608028654) * (r + acc(0.044715) * r * r * r)))
            out = self._bytes(d, nbytes).view(dt).reshape(desc.batch, desc.m, desc.n)
            out[...] = r.astype(dt)

        reads = (a, b, bias) if desc.has_bias else (a, b)
        stream.enqueue(Command(run, "matmul", reads, (d,), self._whole(d, nbytes)))

    attention_dtypes = ("float16", "bfloat16", "float32")

    def attention(
        self,
        desc: AttentionDesc,
        q: int,
        k: int,
        v: int,
        bias: int,
        o: int,
        stream: SimStream,
        capturing: bool | None = None,
        foreign: bool = False,
    ) -> None:
        """numpy, the softmax in float32 (see _simattention)."""
        self._check()
        self._live(stream)
        reads = (q, k, v, bias) if desc.bias_shape is not None else (q, k, v)
        stream.enqueue(Command(lambda: attend(self._bytes, desc, q, k, v, bias, o), "attention", reads, (o,)))

    def _matrices(self, ptr: int, op: GemmOperand, batch: int, dt: np.dtype[Any]) -> np.ndarray:
        isz = dt.itemsize
        last = (op.rows - 1) * (1 if op.col_major else op.ld) + (op.cols - 1) * (op.ld if op.col_major else 1)
        span = ((batch - 1) * op.batch_stride + last + 1) * isz
        raw = self._bytes(ptr, span)
        strides = (op.batch_stride * isz, isz, op.ld * isz) if op.col_major else (op.batch_stride * isz, op.ld * isz, isz)
        return np.ndarray((batch, op.rows, op.cols), dtype=dt, buffer=raw, strides=strides)

    # -- kernels --------------------------------------------------------------
    def _host(self, source: KernelSource) -> bool:
        # TRIO_CUDA_SIM_OPS_NUMBA=1 (tests): the ops' generated kernels run their numba
        # code in numba's simulator instead of their numpy twins.
        if source.host_impl is None:
            return False
        return not (_OPS_NUMBA and getattr(source, "generated", False))

    def loaded_kernel(self, source: KernelSource, signature: tuple[Any, ...]) -> Any:
        if self._host(source):
            return (source.name, source.host_impl, True)
        k = self._kernels.get(source.key)
        return None if k is None else (source.name, k, False)

    def load_kernel(self, source: KernelSource, signature: tuple[Any, ...], args: Sequence[Any]) -> Any:
        if self._host(source):
            return (source.name, source.host_impl, True)
        k = self._kernels.get(source.key)
        if k is None:
            from numba import cuda

            k = self._kernels.setdefault(source.key, cuda.jit(source.py_func))
        return (source.name, k, False)

    def prepare_launch(
        self,
        loaded: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
    ) -> tuple[Any, ...]:
        name, impl, host_impl = loaded
        _check_launch_config(name, grid, block, self.ordinal)
        reads = tuple(a.ptr for a in args if isinstance(a, ArrayArg) and not a.writable)
        writes = tuple(a.ptr for a in args if isinstance(a, ArrayArg) and a.writable)
        return (name, impl, host_impl, grid, block, tuple(args), reads, writes)

    def launch(self, prepared: tuple[Any, ...], stream: SimStream) -> None:
        self._check()
        self._live(stream)
        name, loaded, host_impl, grid, block, args, reads, writes = prepared

        def run() -> None:
            values = [self._array(a) if isinstance(a, ArrayArg) else a for a in args]
            if host_impl:
                loaded(*values)
                return
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            wrapped = [FakeCUDAArray(v) if isinstance(v, np.ndarray) else v for v in values]
            with _kernel_lock:
                loaded[grid, block](*wrapped)

        stream.enqueue(Command(run, f"kernel {name}", reads, writes))

    def _array(self, a: ArrayArg) -> np.ndarray:
        if any(n == 0 for n in a.shape):  # no element: no memory to look up (may be none)
            empty = np.empty(a.shape, a.dtype)
            empty.flags.writeable = a.writable
            return empty
        else:
            lo = sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=False) if s < 0)
            hi = sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=False) if s > 0)
            span = hi - lo + a.dtype.itemsize
        raw = self._bytes(a.ptr + lo, max(span, 0))
        arr = np.ndarray(a.shape, dtype=a.dtype, buffer=raw, offset=-lo, strides=a.strides)
        if not a.writable:
            arr.flags.writeable = False
        return arr

    # -- graphs ---------------------------------------------------------------
    def begin_capture(self, stream: SimStream) -> None:
        self._check()
        self._live(stream)
        if stream.capture is not None:
            raise GraphCaptureError("the stream is capturing already", device=self.ordinal)
        stream.capture = SimCapture(stream)

    def _end(self, stream: SimStream) -> SimCapture:
        cap = stream.capture
        if cap is None or cap.origin is not stream:
            raise GraphCaptureError("the stream did not begin a capture", device=self.ordinal)
        for s in cap.streams:
            s.capture = None
        for ev in [e for e, c in _capture_events.items() if c is cap]:
            del _capture_events[ev]
        return cap

    def end_capture(self, stream: SimStream) -> SimGraph:
        return SimGraph(self, list(self._end(stream).commands))

    def abort_capture(self, stream: SimStream) -> None:
        self._end(stream)

    def graph_launch(self, graph: SimGraph, stream: SimStream) -> None:
        self._check()
        self._live(stream)
        commands = graph.commands
        reads = tuple(p for c in commands for p in c.reads)
        writes = tuple(p for c in commands for p in c.writes)

        def run() -> None:
            for c in commands:
                try:
                    c.fn()
                except ForeignFailure:
                    raise
                except BaseException as exc:
                    raise describe_fault(f"graph node {c.what}", exc) from exc

        stream.enqueue(Command(run, "graph launch", reads, writes))

    def graph_nodes(self, graph: SimGraph) -> int:
        return len(graph.commands)

    def graph_destroy(self, graph: SimGraph) -> None:
        graph.commands = []


# Events recorded inside an open capture, and the capture they belong to.
_capture_events: weakref.WeakKeyDictionary[SimEvent, SimCapture] = weakref.WeakKeyDictionary()


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
        count = env_int("TRIO_CUDA_SIM_DEVICES", 1, minimum=1)
        capacity = env_int("TRIO_CUDA_SIM_MEMORY", 4 << 30, minimum=1 << 20)
        self._devices = [_SimDevice(i, capacity) for i in range(count)]
        self.description = f"simulated device ({count} device{'s' if count != 1 else ''}, kernels through numba's CUDA simulator)"

    def device_count(self) -> int:
        return len(self._devices)

    def driver(self, ordinal: int) -> DeviceDriver:
        return self._devices[ordinal]

    def new_waker(self) -> Waker:
        w = SimWaker()
        _wakers.append(w)
        return w

    def communicators(self, drivers: Sequence[DeviceDriver]) -> SimComms:
        return SimComms([d for d in drivers if isinstance(d, _SimDevice)])

    def process_communicator(self, driver: DeviceDriver, unique_id: bytes, nranks: int, rank: int, channel: Any = None) -> Any:
        if channel is None:
            raise LaunchError(
                "the simulated device has no NCCL for multi-process collectives: join through a launcher "
                "(ProcessGroup.from_env or from_store), whose channel carries the data, or use a Group of simulated devices"
            )
        comm = ProcessComm(driver, channel, rank, nranks)
        driver._process_comms.add(comm)  # type: ignore[attr-defined]
        return comm

    def unique_id(self) -> bytes:
        raise LaunchError(
            "the simulated device makes no NCCL unique id: its multi-process collectives join through a launcher "
            "(ProcessGroup.from_env or from_store), whose channel carries the data"
        )

    def collective(
        self, kind: str, comms: Any, calls: Sequence[CollectiveCall], dtype: np.dtype[Any], op: str, root: int
    ) -> None:
        for c in calls:
            d: Any = c.driver
            d._check()
            d._live(c.stream)
            if c.stream.capture is not None:
                raise GraphCaptureError("collectives cannot be captured in a graph", device=d.ordinal)
        if isinstance(comms, ProcessComm):
            (c,) = calls
            tag = comms.next_tag()  # in enqueue order, the same on every rank

            def part(c: CollectiveCall = c, d: Any = c.driver) -> None:
                bad = c.stream.error
                if bad is None:
                    a = d._alloc_at(c.send)
                    if a is not None and a.poison is not None:
                        bad = a.poison
                comms.run(kind, c, dtype, op, root, tag, bad)

            c.stream.enqueue(Command(part, f"collective {kind}", (), (c.recv,), always=True))
            return
        rdv = Rendezvous(kind, calls, dtype, op, root)
        for c in calls:
            d = c.driver

            def run(c: CollectiveCall = c, d: Any = d) -> None:
                stream: Any = c.stream
                bad = stream.error
                if bad is None:
                    a = d._alloc_at(c.send)
                    if a is not None and a.poison is not None:
                        bad = a.poison
                rdv.arrive(c.rank, bad)

            # always: it runs after a failed wait too (it then poisons every result)
            c.stream.enqueue(Command(run, f"collective {kind}", (), (c.recv,), always=True))

    def close_communicators(self, comms: Any) -> None:
        pass
