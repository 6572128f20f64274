"""The CUDA backend: the driver API through ``cuda.bindings``.

* One **primary context** per device, made current lazily on each thread that calls in.
* **Streams** are non-blocking driver streams; **events** are created with timing off
  (no blocking sync: nothing calls ``cuEventSynchronize`` on them, and their queries
  are cheaper without it).
* **Memory** is stream-ordered (``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync``) from
  the device's default pool, whose release threshold is raised so that steady-state
  allocation never returns memory to the OS. Host copies go through pinned memory
  (``cuMemHostAlloc``), which the runtime pools.
* **Kernels** are numba-cuda Python functions compiled once per (content key,
  signature, compute capability) to PTX by numba's compiler, linked to a cubin by the
  driver, cached in memory and on disk (``TRIO_CUDA_CACHE_DIR``, default
  ``~/.cache/trio-cuda``; only kernels whose content key is stable), loaded with
  ``cuModuleLoadData`` and launched with ``cuLaunchKernel`` from pre-packed parameters
  in numba's argument layout. Tensor (input) arguments are compiled as read-only
  arrays, so a kernel that writes one is refused when it is built, before any launch.
  numba's dispatcher is never on the launch path (``_cudakernels``).
* **Completion**: ``arm`` queues, on a side stream per work stream, a wait for the event
  and a host function that is libc's ``sem_post`` itself (no Python callback, no GIL),
  posting the semaphore the notifier's helper thread sleeps on (``_cudawaker``).
* **Fast path**: the three driver calls of every await (``cuLaunchKernel``,
  ``cuEventRecord``, ``cuEventQuery``) go through a small C extension
  (``_cudafast``, built at install when a C compiler is present) straight to the
  driver's entry points, without the argument conversion of cuda.bindings' generic
  wrappers, which costs an await more than the driver's own calls (docs/performance.md);
  without it the same calls go through cuda.bindings (the same behaviour and errors).
* Every driver result goes through ``_cudaerrors.check``, which turns a bad ``CUresult`` into the
  project's errors; sticky errors (illegal address, ...) mark the device faulted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from .._errors import DeviceError, DeviceFault, DeviceOutOfMemory, LaunchError, fresh
from ._boundary import AttentionDesc, Backend, CollectiveCall, DeviceDriver, GemmDesc, KernelSource, Waker
from ._cublaslt import WORKSPACE, Gemms
from ._cudacapture import capture_call
from ._cudaerrors import NOT_READY, SUCCESS, check, error, result_code
from ._cudakernels import Launcher, Prepared, compile_cubin, param_format, param_values
from ._cudawaker import SEM_POST_ADDR, SemWaker, wakers
from ._cudnn import Attentions
from ._cudnn import load as _load_cudnn

try:
    from . import _cudafast
except ImportError:  # built without a C compiler: the pure-Python path
    _cudafast = None  # type: ignore[assignment]
_BUILT: bool = _cudafast is not None

__all__ = ["CudaBackend"]


class _ThreadState(threading.local):
    token: object = None  # the token of the context current on this thread


_tls = _ThreadState()
# Side streams for completion wake-ups per context: as many as a default stream pool's
# streams at its cap, so that those seldom share one.
_SIDE_STREAMS = 16


# -- graphs ----------------------------------------------------------------------------------
class _Graph:
    __slots__ = ("exec", "graph", "nodes")

    def __init__(self, graph: Any, exec_: Any, nodes: int) -> None:
        self.graph = graph
        self.exec = exec_
        self.nodes = nodes


#: Whether drivers made from now on use the fast path when it is built (a test hook: a
#: test of the cuda.bindings calls sets it False before the backend starts).
_use_fast_path = True


def fast_path() -> tuple[int, int, int] | None:
    """The driver entry points of ``cuLaunchKernel``, ``cuEventRecord`` and
    ``cuEventQuery`` for the compiled fast path, or None: not built, switched off
    (``_use_fast_path``), or an entry point the driver does not give."""
    if not _BUILT or not _use_fast_path:
        return None
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    out = []
    for name in (b"cuLaunchKernel", b"cuEventRecord", b"cuEventQuery"):
        # 12000: the CUDA 12.0 ABI of each call (none of the three changed since).
        r = cu.cuGetProcAddress(name, 12000, flags)
        if r[0] != SUCCESS or not int(r[1]):
            return None
        out.append(int(r[1]))
    return out[0], out[1], out[2]


def graph_launch_entry() -> int:
    """The driver entry point of ``cuGraphLaunch`` for the fast path's graph_launch (0:
    none; the backend then launches through cuda.bindings)."""
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    r = cu.cuGetProcAddress(b"cuGraphLaunch", 12000, flags)
    return int(r[1]) if r[0] == SUCCESS else 0


def _fast_path_note(fast: tuple[int, int, int] | None) -> str:
    """What the backend's announcement says about the fast path (silent when it is on)."""
    if fast is not None:
        return ""
    if not _BUILT:
        return "; compiled fast path not built (no C compiler at install): driver calls through cuda.bindings"
    if not _use_fast_path:
        return "; compiled fast path off"
    return "; compiled fast path off (the driver gave no entry point)"


class CudaDevice(DeviceDriver):
    """One CUDA device through its primary context."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.cu_device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        raw = check(cu.cuDeviceGetName(256, self.cu_device), "cuDeviceGetName")
        self.name = raw.split(b"\0", 1)[0].decode()
        attr = cu.CUdevice_attribute
        major = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.cu_device), "cuDeviceGetAttribute"
        )
        minor = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.cu_device), "cuDeviceGetAttribute"
        )
        self.compute_capability = (int(major), int(minor))
        self.total_memory = int(check(cu.cuDeviceTotalMem(self.cu_device), "cuDeviceTotalMem"))
        self._fault: DeviceFault | None = None
        self._lock = threading.Lock()
        self._setup()

    def _setup(self) -> None:
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain", self)
        self._token = object()  # identifies this context incarnation on each thread
        self._current()
        self.pool = check(cu.cuDeviceGetDefaultMemPool(self.cu_device), "cuDeviceGetDefaultMemPool", self)
        attr = cu.CUmemPool_attribute
        threshold = cu.cuuint64_t(0xFFFF_FFFF_FFFF_FFFF)
        check(
            cu.cuMemPoolSetAttribute(self.pool, attr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, threshold), "cuMemPoolSetAttribute", self
        )
        # No hidden cross-stream waits: by default the pool may make an allocation wait
        # for the stream that freed the memory it reuses, i.e. for everything queued on
        # that stream before the free (seen: a fresh allocation waiting behind an
        # unrelated 3 s kernel). Memory freed on other streams is reused only once the
        # free has completed, or when the allocating stream already depends on it.
        check(
            cu.cuMemPoolSetAttribute(self.pool, attr.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 0),
            "cuMemPoolSetAttribute",
            self,
        )
        self._launchers: dict[tuple[Any, ...], Launcher] = {}
        self._load_locks: dict[tuple[Any, ...], threading.Lock] = {}
        # The side streams for completion wake-ups (see arm), all made now, while nothing
        # runs: making a stream can block the calling thread until the work running on
        # the device completes (seen on an H200: 300 ms, while 100 ms kernels ran), so
        # none is made on the await path, and one made later costs one stream, not two.
        # Each stream made here takes the next in turn; work on a stream made elsewhere,
        # or on none, the first.
        self._sides = [self._new_stream() for _ in range(_SIDE_STREAMS)]
        self._notify: dict[int, Any] = {}
        self._next_side = 0
        self._gemms = Gemms()
        self._attention = Attentions()
        # Timing off and no blocking sync: nothing waits on these events with
        # cuEventSynchronize (a blocking wait spins, then sleeps on a waker the notifier's
        # side stream posts), and blocking sync makes the query that first sees an event
        # done, which every await makes, cost more (docs/performance.md).
        self._event_flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._fast = fast_path()
        self._graph_pfn = graph_launch_entry() if self._fast is not None and hasattr(_cudafast, "graph_launch") else 0

    # -- context ------------------------------------------------------------------
    def _current(self) -> None:
        """Make this device's context current on the calling thread (once per thread)."""
        if _tls.token is not self._token:
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent", self)
            _tls.token = self._token

    # -- faults -------------------------------------------------------------------
    def set_fault(self, fault: DeviceFault) -> None:
        with self._lock:
            if self._fault is None:
                self._fault = fault

    def fault(self) -> BaseException | None:
        return self._fault

    def reset(self) -> None:
        """Reset the primary context; raise DeviceFault if the device cannot work again.

        After an illegal address no driver call brings the device back inside the
        process (cuDevicePrimaryCtxReset, releasing and retaining the primary context
        again, and cuCtxCreate all fail with the sticky error; docs/runtime.md, "Reset").
        Then the device stays faulted and the error says so: only a new process can use
        it.
        """
        fault = self._fault
        self._launchers = {}
        self._notify = {}
        self._gemms.forget()
        self._attention.forget()
        try:
            check(cu.cuDevicePrimaryCtxReset(self.cu_device), "cuDevicePrimaryCtxReset", self)
            cu.cuDevicePrimaryCtxRelease(self.cu_device)  # balanced by the retain in _setup
            self._fault = None
            self._setup()
            # Prove the context works: a stream-ordered allocation and free.
            stream = self.create_stream()
            self.free(self.alloc(256, stream), stream)
            check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize", self)
            check(cu.cuStreamDestroy(stream), "cuStreamDestroy", self)
        except DeviceError as err:
            reason = fault.message if fault is not None else err.message
            self._fault = DeviceFault(
                f"the device cannot recover inside this process after: {reason}. The CUDA driver keeps "
                "this error for the whole process; restart the process to use the device again",
                device=self.ordinal,
                op=getattr(fault, "op", None),
            )
            raise fresh(self._fault) from err

    # -- streams and events ---------------------------------------------------------
    def create_stream(self) -> Any:
        self._current()
        stream = self._new_stream()
        self._notify[int(stream)] = self._sides[self._next_side % _SIDE_STREAMS]
        self._next_side += 1
        return stream

    def _new_stream(self) -> Any:
        return check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate", self)

    def destroy_stream(self, stream: Any) -> None:
        if self._fault is not None:
            return  # the context is gone with the fault
        self._current()
        self._notify.pop(int(stream), None)  # (its side stream serves others: it stays)
        self._gemms.drop_stream(int(stream), cu.cuGraphExecDestroy)
        ws = self._gemms.workspaces.pop(int(stream), None)
        if ws is not None:
            cu.cuMemFreeAsync(ws, stream)  # after the GEMMs queued on it
        ws = self._attention.drop_stream(int(stream))
        if ws is not None:
            cu.cuMemFreeAsync(ws, stream)  # after the attentions queued on it
        # Returns at once; work already enqueued completes first.
        cu.cuStreamDestroy(stream)

    def create_event(self) -> Any:
        self._current()
        return check(cu.cuEventCreate(self._event_flags), "cuEventCreate", self)

    def record(self, event: Any, stream: Any) -> None:
        if _tls.token is not self._token:
            self._current()
        fast = self._fast
        if fast is not None:
            err = _cudafast.record(fast[1], int(event), int(stream))
            if err:
                self._record_failed(err)
        else:
            err = cu.cuEventRecord(event, stream)[0]
            if err != SUCCESS:
                raise error(err, "cuEventRecord", self, launch=True)

    def wait_event(self, stream: Any, event: Any, *, ordering_only: bool = False) -> None:
        self._current()
        err = cu.cuStreamWaitEvent(stream, event, 0)[0]
        if err != SUCCESS:
            raise error(err, "cuStreamWaitEvent", self, launch=True)

    def query(self, event: Any) -> bool:
        if _tls.token is not self._token:
            self._current()
        fast = self._fast
        err = _cudafast.query(fast[2], int(event)) if fast is not None else int(cu.cuEventQuery(event)[0])
        if not err:
            return True
        if err == NOT_READY:
            if self._fault is not None:
                raise fresh(self._fault)
            return False
        raise error(result_code(err), "cuEventQuery", self)

    def arm(self, event: Any, stream: Any, waker: Waker) -> None:
        assert isinstance(waker, SemWaker)
        self._current()
        # (streams that share a side stream: a wake-up can wait there behind an earlier,
        # longer one, until the notifier's periodic poll)
        side = self._notify.get(int(stream), self._sides[0]) if stream is not None else self._sides[0]
        err = cu.cuStreamWaitEvent(side, event, 0)[0]
        if err == SUCCESS:
            err = cu.cuLaunchHostFunc(side, cu.CUhostFn(SEM_POST_ADDR), waker.addr)[0]
        if err != SUCCESS:
            # The helper thread's periodic poll still catches this event.
            e = error(err, "arming a completion wake-up", self)
            if isinstance(e, DeviceFault):
                waker.post()

    # -- memory ------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: Any) -> int:
        self._current()
        err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, self.pool, stream)
        if err != SUCCESS:
            raise error(err, f"allocating {nbytes} bytes", self, launch=True)
        return int(ptr)

    def free(self, ptr: int, stream: Any) -> None:
        if self._fault is not None:
            return  # the context is gone with the fault; reset releases everything
        self._current()
        err = cu.cuMemFreeAsync(ptr, stream)[0]
        if err != SUCCESS:
            raise error(err, "cuMemFreeAsync", self)

    def host_alloc(self, nbytes: int) -> np.ndarray:
        self._current()
        ptr = int(check(cu.cuMemHostAlloc(nbytes, 0), f"pinning {nbytes} bytes of host memory", self))
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        return arr

    def host_free(self, buf: np.ndarray) -> None:
        self._current()
        check(cu.cuMemFreeHost(buf.ctypes.data), "cuMemFreeHost", self)

    def fill(self, ptr: int, nbytes: int, pattern: bytes, stream: Any) -> None:
        self._current()
        n = len(pattern)
        if n == 1:
            res = cu.cuMemsetD8Async(ptr, pattern[0], nbytes, stream)
        elif n == 2:
            res = cu.cuMemsetD16Async(ptr, struct.unpack("<H", pattern)[0], nbytes // 2, stream)
        elif n == 4:
            res = cu.cuMemsetD32Async(ptr, struct.unpack("<I", pattern)[0], nbytes // 4, stream)
        elif n == 8:
            lo, hi = struct.unpack("<II", pattern)
            rows = nbytes // 8
            res = cu.cuMemsetD2D32Async(ptr, 8, lo, 1, rows, stream)
            if res[0] == SUCCESS:
                res = cu.cuMemsetD2D32Async(ptr + 4, 8, hi, 1, rows, stream)
        else:
            raise ValueError(f"fill pattern of {n} bytes")
        if res[0] != SUCCESS:
            raise error(res[0], "memset", self, launch=True)

    def copy_h2d(self, dst: int, src: np.ndarray, stream: Any) -> None:
        self._current()
        err = cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, stream)[0]
        if err != SUCCESS:
            raise error(err, "copy host to device", self, launch=True)

    def copy_d2h(self, dst: np.ndarray, src: int, stream: Any) -> None:
        self._current()
        err = cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, stream)[0]
        if err != SUCCESS:
            raise error(err, "copy device to host", self, launch=True)

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._current()
        err = cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream)[0]
        if err != SUCCESS:
            raise error(err, "copy device to device", self, launch=True)

    def copy_peer(self, dst: int, src_driver: DeviceDriver, src: int, nbytes: int, stream: Any) -> None:
        assert isinstance(src_driver, CudaDevice)
        self._current()
        err = cu.cuMemcpyPeerAsync(dst, self.ctx, src, src_driver.ctx, nbytes, stream)[0]
        if err != SUCCESS:
            raise error(err, f"copy from device {src_driver.ordinal}", self, launch=True)

    # -- libraries ------------------------------------------------------------------
    def foreign_stream(self, handle: int) -> Any:
        return cu.CUstream(handle)

    def wait_foreign(self, stream: Any, foreign: Any) -> None:
        self._current()
        ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate", self)
        try:
            check(cu.cuEventRecord(ev, foreign), "cuEventRecord", self)
            check(cu.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent", self)
        finally:
            cu.cuEventDestroy(ev)

    # -- tracing: timing events, only while a trace is open ------------------------------
    def trace_clock(self) -> tuple[Any, float]:
        """A timing event recorded and waited for now, and the host time just after."""
        self._current()
        ev = check(cu.cuEventCreate(0), "cuEventCreate", self)
        check(cu.cuEventRecord(ev, 0), "cuEventRecord", self)
        check(cu.cuEventSynchronize(ev), "cuEventSynchronize", self)
        return ev, time.perf_counter()

    def timestamp(self, stream: Any) -> Any:
        self._current()
        ev = check(cu.cuEventCreate(0), "cuEventCreate", self)
        check(cu.cuEventRecord(ev, stream), "cuEventRecord", self)
        return ev

    def timestamp_seconds(self, reference: tuple[Any, float], stamp: Any) -> float | None:
        self._current()
        ref, host = reference
        err, ms = cu.cuEventElapsedTime(ref, stamp)
        cu.cuEventDestroy(stamp)
        if err != SUCCESS:
            return None  # not reached (or the device faulted): left out of the trace
        return host + float(ms) / 1e3

    def matmul(
        self,
        desc: GemmDesc,
        a: int,
        b: int,
        d: int,
        bias: int,
        stream: Any,
        capturing: bool | None = None,
        foreign: bool = False,
        reuse: bool = False,
    ) -> None:
        if _tls.token is not self._token:
            self._current()
        gemms = self._gemms
        if capturing is None:  # (a stream of ours may have joined another library's capture)
            capturing = self._capturing(stream)
        if reuse and not capturing and not foreign and gemms.replay:
            # A recipe's GEMM on the same memory as before (its third call: the first
            # two built the recipe and prepared it): cuBLASLt's call is captured once
            # and replayed as a graph, because launching the graph costs the host much
            # less than cuBLASLt's own call does (docs/performance.md).
            key = (desc, a, b, d, bias, int(stream))
            graphs = gemms.graphs
            g = graphs.pop(key, None)
            if g is not None:
                graphs[key] = g  # the most recently used last: eviction takes the first
            elif gemms.capture_ok and key not in gemms.refused:
                g = self._gemm_graph(key, desc, a, b, d, bias, stream)
            if g is not None:
                pfn = self._graph_pfn
                if pfn:
                    err = _cudafast.graph_launch(pfn, g[0], key[5])
                else:
                    err = int(cu.cuGraphLaunch(g[1], stream)[0])
                if not err:
                    gemms.replays += 1
                    return
                exc = error(result_code(err), "cuGraphLaunch (a replayed GEMM)", self, launch=True, op="matmul")
                if isinstance(exc, DeviceFault):
                    raise exc
                # Refused: the library makes the call. Out of memory may pass (the graph
                # stays); any other refusal would come again (the graph goes).
                if not isinstance(exc, DeviceOutOfMemory):
                    gemms.drop(key, cu.cuGraphExecDestroy)
        plan, ws, ws_bytes = self._gemm_plan(desc, stream, capturing, foreign)
        try:
            plan.run(a, b, d, bias, ws, ws_bytes, int(stream))
        except Exception as exc:  # cuBLASLtError: the library refused to enqueue it
            raise LaunchError(f"cuBLASLt matmul failed: {exc}", device=self.ordinal, op="matmul") from exc

    def attention_check(self) -> None:
        _load_cudnn()

    def attention(
        self,
        desc: AttentionDesc,
        q: int,
        k: int,
        v: int,
        bias: int,
        o: int,
        stream: Any,
        capturing: bool | None = None,
        foreign: bool = False,
    ) -> None:
        """cuDNN's fused SDPA (see _cudnn)."""
        if _tls.token is not self._token:
            self._current()
        if capturing is None:
            capturing = self._capturing(stream)
        self._attention.call(
            desc,
            q,
            k,
            v,
            bias,
            o,
            int(stream),
            capturing,
            foreign,
            lambda n: self.alloc(n, stream),
            lambda p: cu.cuMemFreeAsync(p, stream),  # after the attentions queued on it
            self.ordinal,
        )

    def at_exit(self) -> None:
        """Destroy the replayed GEMMs' graphs and capture stream before the interpreter's
        teardown (no more are made)."""
        if self._fault is None:
            self._current()
            self._gemms.close(cu.cuGraphExecDestroy, cu.cuStreamDestroy)

    def _capturing(self, stream: Any) -> bool:
        """Whether ``stream`` is recording a graph now (asks the driver)."""
        err, status = cu.cuStreamIsCapturing(stream)
        if err != SUCCESS:
            raise error(err, "cuStreamIsCapturing", self)
        return bool(status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)

    def _gemm_plan(self, desc: GemmDesc, stream: Any, capturing: bool, foreign: bool) -> tuple[Any, int, int]:
        """The cuBLASLt plan of ``desc`` and the workspace (pointer, bytes) of ``stream``."""
        gemms = self._gemms
        try:
            plan = gemms.plan(desc, capturing or foreign)  # True: a plan that needs no workspace
        except (RuntimeError, ImportError) as exc:
            raise LaunchError(f"matmul {desc.m}x{desc.k} @ {desc.k}x{desc.n} ({desc.dtype}): {exc}", device=self.ordinal) from exc
        ws, ws_bytes = 0, 0
        # No workspace on another library's stream: it would be keyed by a handle the
        # library may destroy and hand out again (and nothing would free it).
        if plan.workspace and not capturing and not foreign:
            key = int(stream)
            ws = gemms.workspaces.get(key, 0)
            if not ws:
                ws = gemms.workspaces[key] = self.alloc(WORKSPACE, stream)
            ws_bytes = WORKSPACE
        return plan, ws, ws_bytes

    def _gemm_graph(self, key: tuple[Any, ...], desc: GemmDesc, a: int, b: int, d: int, bias: int, stream: Any) -> Any:
        """cuBLASLt's call for ``key`` (the GEMM's desc, pointers and stream) captured
        once and kept instantiated, or None (see _cudacapture.capture_call). The graph
        holds what the call enqueues on ``stream`` itself: the same kernel, the same
        arguments, the stream's workspace; it is launched on that stream only, and
        dropped with it (destroy_stream) or with the context (reset)."""
        plan, ws, ws_bytes = self._gemm_plan(desc, stream, False, False)
        return capture_call(
            self._gemms, key, lambda cs: plan.run(a, b, d, bias, ws, ws_bytes, cs), self, "a replayed GEMM", "matmul"
        )

    def mem_info(self) -> tuple[int, int]:
        self._current()
        free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo", self)
        return int(free), int(total)

    # -- kernels ---------------------------------------------------------------------
    def link(self, ptx: bytes, name: str) -> bytes:
        self._current()
        state = check(cu.cuLinkCreate(0, [], []), "cuLinkCreate", self)
        try:
            check(
                cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, ptx, len(ptx), name.encode(), 0, [], []),
                f"linking kernel {name}",
                self,
            )
            cubin_ptr, size = check(cu.cuLinkComplete(state), f"linking kernel {name}", self)
            return ctypes.string_at(int(cubin_ptr), int(size))
        finally:
            cu.cuLinkDestroy(state)

    def loaded_kernel(self, source: KernelSource, signature: tuple[Any, ...]) -> Any:
        return self._launchers.get((source.key, signature))

    def load_kernel(self, source: KernelSource, signature: tuple[Any, ...], args: Sequence[Any]) -> Launcher:
        key = (source.key, signature)
        launcher = self._launchers.get(key)
        if launcher is not None:
            return launcher
        lock = self._load_locks.setdefault(key, threading.Lock())
        with lock:  # one compilation per kernel and signature, whatever the threads
            launcher = self._launchers.get(key)
            if launcher is not None:
                return launcher
            cubin, entry = compile_cubin(self, source, args)
            self._current()
            op = f"kernel {source.name}"
            module = check(cu.cuModuleLoadData(cubin), "cuModuleLoadData", self, launch=True, op=op)
            function = check(cu.cuModuleGetFunction(module, entry.encode()), "cuModuleGetFunction", self, launch=True, op=op)
            if hasattr(cu, "cuFuncLoad"):
                # Finish lazy loading now, not at the first launch (loading can wait for
                # work already running on the device; here it waits in a worker thread).
                check(cu.cuFuncLoad(function), "cuFuncLoad", self, launch=True, op=op)
            fmt, nslots = param_format(args)
            launcher = Launcher(module, function, fmt, nslots, source.name)
            self._launchers[key] = launcher
        return launcher

    def prepare_launch(
        self,
        loaded: Launcher,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
    ) -> Prepared:
        return Prepared(loaded, grid, block, param_values(args))

    def launch(self, p: Prepared, stream: Any) -> None:
        if _tls.token is not self._token:
            self._current()
        fast = self._fast
        if fast is not None:
            err = _cudafast.launch(fast[0], p.fn, p.gx, p.gy, p.gz, p.bx, p.by, p.bz, 0, int(stream), p.params)
        else:
            err = int(cu.cuLaunchKernel(p.function, p.gx, p.gy, p.gz, p.bx, p.by, p.bz, 0, stream, p.params, 0)[0])
        if err:
            self._launch_failed(err, p)

    def _launch_failed(self, err: int, p: Prepared) -> None:
        """Raise the error of a launch that returned ``err``."""
        grid, block = (p.gx, p.gy, p.gz), (p.bx, p.by, p.bz)
        raise error(result_code(err), f"launching grid={grid} block={block}", self, launch=True, op=f"kernel {p.name}")

    def _record_failed(self, err: int) -> None:
        """Raise the error of an event record that returned ``err`` (the fast path's)."""
        raise error(result_code(err), "cuEventRecord", self, launch=True)

    # -- graphs ----------------------------------------------------------------------
    def begin_capture(self, stream: Any) -> None:
        self._current()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        check(cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture", self)

    def end_capture(self, stream: Any) -> _Graph:
        self._current()
        graph = check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture", self)
        try:
            nodes = check(cu.cuGraphGetNodes(graph), "cuGraphGetNodes", self)
            count = nodes[1] if isinstance(nodes, tuple) else len(nodes)
            exec_ = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate", self)
        except BaseException:
            cu.cuGraphDestroy(graph)
            raise
        return _Graph(graph, exec_, int(count))

    def abort_capture(self, stream: Any) -> None:
        self._current()
        err, graph = cu.cuStreamEndCapture(stream)
        if err == SUCCESS and graph is not None and int(graph) != 0:
            cu.cuGraphDestroy(graph)

    def graph_launch(self, graph: _Graph, stream: Any) -> None:
        self._current()
        err = cu.cuGraphLaunch(graph.exec, stream)[0]
        if err != SUCCESS:
            raise error(err, "cuGraphLaunch", self, launch=True)

    def graph_nodes(self, graph: _Graph) -> int:
        return graph.nodes

    def graph_destroy(self, graph: _Graph) -> None:
        if self._fault is None:
            self._current()
            cu.cuGraphExecDestroy(graph.exec)
            cu.cuGraphDestroy(graph.graph)


# ncclDataType_t and ncclRedOp_t values
_NCCL_TYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}  # fmt: skip
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def _nccl() -> tuple[Any, Any]:
    """nccl4py's Python layer and raw bindings (imported on the first collective)."""
    try:
        import nccl.bindings.nccl as bindings
        import nccl.core as core
    except ImportError as exc:
        raise LaunchError(f"collectives need nccl4py and NCCL (pip install 'trio-cuda[cuda]'): {exc}") from exc
    return core, bindings


class CudaBackend(Backend):
    name = "cuda"
    # Polling sees completion within one scheduler pass; a parked wait wakes only after
    # the host function, the helper thread and trio's wake-up. Work that ends within
    # the budget is seen sooner by polling, and beside longer work the parked wait's
    # delay is small (docs/notifier.md has the figures).
    poll_budget_us = 5000.0
    # An await whose first poll after trio's pass finds a kernel of a few us (a GEMV)
    # still running polls on for up to this long when that pass came back at once: with
    # nothing else to run, another pass through trio's scheduler only delays seeing a
    # kernel that ends within microseconds (docs/performance.md).
    spin_us = 20.0

    def __init__(self) -> None:
        check(cu.cuInit(0), "cuInit")
        self._count = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        self._drivers: dict[int, CudaDevice] = {}
        self._lock = threading.Lock()
        version = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        first = self.driver(0)
        assert isinstance(first, CudaDevice)
        self.description = (
            f"CUDA backend ({self._count} device{'s' if self._count != 1 else ''}, device 0: {first.name}, "
            f"cc {first.compute_capability[0]}.{first.compute_capability[1]}, driver {version // 1000}.{version % 1000 // 10}"
            f"{_fast_path_note(first._fast)})"
        )

    def device_count(self) -> int:
        return self._count

    def driver(self, ordinal: int) -> DeviceDriver:
        d = self._drivers.get(ordinal)
        if d is None:
            with self._lock:
                d = self._drivers.get(ordinal)
                if d is None:
                    d = self._drivers[ordinal] = CudaDevice(ordinal)
        return d

    def new_waker(self) -> Waker:
        w = SemWaker()
        wakers.append(w)
        return w

    # -- collectives: NCCL through nccl4py's raw-pointer bindings ----------------------
    def communicators(self, drivers: Sequence[DeviceDriver]) -> list[Any]:
        nccl, _ = _nccl()
        ordinals = [d.ordinal for d in drivers]
        for d in drivers:
            d._current()  # type: ignore[attr-defined]  # the primary contexts exist before NCCL uses them
        try:
            comms: list[Any] = list(nccl.Communicator.init_all(ordinals))
        except Exception as exc:
            raise LaunchError(f"NCCL could not make communicators for devices {ordinals}: {exc}") from exc
        return comms

    def process_communicator(self, driver: DeviceDriver, unique_id: bytes, nranks: int, rank: int, channel: Any = None) -> Any:
        nccl, _ = _nccl()
        driver._current()  # type: ignore[attr-defined]  # NCCL takes the calling thread's device
        try:
            return [nccl.Communicator.init(nranks, rank, nccl.UniqueId.from_bytes(unique_id))]
        except Exception as exc:
            raise LaunchError(f"NCCL could not join rank {rank} of {nranks}: {exc}", device=driver.ordinal) from exc

    def unique_id(self) -> bytes:
        nccl, _ = _nccl()
        return bytes(nccl.get_unique_id())

    def collective(
        self, kind: str, comms: Any, calls: Sequence[CollectiveCall], dtype: np.dtype[Any], op: str, root: int
    ) -> None:
        _, b = _nccl()
        dt = _NCCL_TYPES[dtype.name]
        red = _NCCL_OPS[op]
        b.group_start()
        try:
            for c in calls:
                comm = b.Comm(comms[c.rank if len(comms) > 1 else 0].ptr)
                stream = int(c.stream)
                if kind == "all_reduce":
                    b.all_reduce(c.send, c.recv, c.count, dt, red, comm, stream)
                elif kind == "broadcast":
                    b.broadcast(c.send, c.recv, c.count, dt, root, comm, stream)
                elif kind == "all_gather":
                    b.all_gather(c.send, c.recv, c.count, dt, comm, stream)
                else:
                    b.reduce_scatter(c.send, c.recv, c.count, dt, red, comm, stream)
        except Exception as exc:
            try:
                b.group_end()
            except Exception:
                pass
            raise LaunchError(f"NCCL {kind} could not be enqueued: {exc}", op=f"collective {kind}") from exc
        try:
            b.group_end()
        except Exception as exc:
            raise LaunchError(f"NCCL {kind} could not be enqueued: {exc}", op=f"collective {kind}") from exc

    def close_communicators(self, comms: Any) -> None:
        for c in comms:
            try:
                c.destroy()
            except Exception:  # (NCCL's cleanup errors: nothing more to release)
                pass
