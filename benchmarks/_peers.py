"""Baseline ("peer") measurements that the trio-cuda benchmark compares against.

Each peer does the same small pieces of GPU work through another Python route to the
GPU, on one GPU (device 0) in one process, warm (every path is run before it is timed),
timed with ``time.perf_counter_ns`` on the host. Every figure is a median over
repetitions. The peers are:

* ``raw_cuda_bindings``: the CUDA driver API through ``cuda.bindings.driver``, called
  directly: a retained primary context, streams made with ``CU_STREAM_NON_BLOCKING``,
  events with ``CU_EVENT_DISABLE_TIMING``, memory from ``cuMemAlloc``, kernels compiled
  to PTX by numba-cuda's ``compile_ptx`` and loaded with ``cuModuleLoadData`` (where
  the driver's JIT refuses that PTX, e.g. when it is of a newer ISA version than the
  driver knows, it is linked to a cubin with nvJitLink first), launched with
  ``cuLaunchKernel`` from a kernel-parameter array packed once. Every ``CUresult`` is
  checked. It is the floor: Python's cost of one driver call per operation and
  nothing else.
* ``cuda_core``: NVIDIA's ``cuda.core`` (``cuda.core`` or, for older releases,
  ``cuda.core.experimental``): ``Device``, ``Program`` (CUDA C++ compiled to a cubin
  for the device's architecture by NVRTC), ``LaunchConfig`` and ``launch``, non-blocking
  streams from ``Device.create_stream`` and an event (timing off) from
  ``Device.create_event``.
* ``cupy``: ``cupy.RawKernel`` on the same CUDA C++ source, launched on
  ``cupy.cuda.Stream(non_blocking=True)`` made current with ``with stream:``, and a
  ``cupy.cuda.Event(disable_timing=True)`` polled through ``Event.done``.
* ``torch``: PyTorch eager mode: the tiny operation is ``x.add_(1.0)`` on a 32-element
  float32 CUDA tensor (one kernel launch each), on ``torch.cuda.Stream()`` streams
  (PyTorch creates its streams non-blocking) made current with
  ``torch.cuda.stream(s)``, and a ``torch.cuda.Event()`` (timing off) polled with
  ``Event.query()``. Its busy kernel is ``torch.cuda._sleep(cycles)``, PyTorch's
  private one-thread ``clock64()`` spin, with ``cycles`` calibrated once with timing
  events to last about 1 ms.

The kernels. The *tiny* kernel runs one block of 32 threads and does ``x[i] += 1.0`` on
a float32 array of 32 elements; every launch uses the same array, so consecutive
launches on a stream depend on each other through the stream's order. The *spin* kernel
runs one block of one thread that calls ``nanosleep(1000)`` 1000 times
(``cuda.nanosleep`` in numba, ``__nanosleep`` in CUDA C++), about 1 ms of GPU time
that occupies almost none of the GPU; PTX lets a ``nanosleep`` last anywhere from 0 to
twice the time asked for, so the spin's real length is what the
``independent16_one_stream_ms`` figure shows (about 16 spins back to back). After all
the timing, each peer reads the array back and checks that every element equals the
number of tiny launches it made; a mismatch is reported in ``error``.

The figures (keys of the dict each peer returns):

* ``chain_us_per_op``: N tiny launches (default 2000) enqueued back to back on one
  stream, then one synchronization of that stream; the wall time from before the first
  launch to the return of the synchronization, divided by N, in microseconds. Median of
  ``reps`` repetitions (default 5). This is the host-side cost of submitting one
  dependent operation when the host never waits, i.e. launch throughput.
* ``sync_each_us_per_op``: the same tiny launches, but the stream is synchronized after
  every launch (``cuStreamSynchronize``, ``Stream.sync``, ``Stream.synchronize``),
  for N_sync launches (default ``min(N, 500)``); the total wall time divided by N_sync,
  in microseconds, median of ``reps`` repetitions. This is the cost of one operation
  whose result the host waits for, waiting the library's blocking way.
* ``roundtrip_us``: one tiny launch, then an event recorded on the same stream, then a
  busy loop that queries the event until it reports completion; the wall time of one
  such round trip in microseconds, median over N_roundtrip round trips (default N).
  This is the latency from submitting one operation to the host seeing it done, by
  polling (the way an event loop would see it).
* ``independent16_pool_ms``: 16 spin kernels that do not depend on each other, launched
  round-robin over a pool of 4 streams (kernel k on stream k mod 4), then all 4 streams
  synchronized; the wall time from before the first launch to the return of the last
  synchronization, in milliseconds, median of ``reps`` repetitions. With the GPU running
  the 4 streams concurrently this is about 4 spins' time.
* ``independent16_one_stream_ms``: the same 16 spins all launched on one stream, then
  that stream synchronized; wall time in milliseconds, median of ``reps`` repetitions
  (about 16 spins' time, since one stream runs its kernels one after another).
* ``independent16_speedup``: ``independent16_one_stream_ms / independent16_pool_ms``:
  how much the 4-stream pool gains from running independent work concurrently (about 4
  at best).
* ``error``: ``None``, or a string naming the stage that failed (``setup``,
  ``warm-up``, ``chain``, ``sync_each``, ``roundtrip``, ``independent16``, ``check``,
  ``cleanup``) and the exception. A peer whose library is missing, or that finds no
  GPU, reports every figure as ``None``; figures measured before a failure are kept.
  Every peer is independent: one failing does not affect the others, and each frees
  what it made (streams, events, modules, memory) when it ends.

Only the Python standard library is imported at module import; every GPU library
(cuda.bindings, cuda.core, numba-cuda, CuPy, PyTorch) is imported inside the peer that
uses it, so this module imports on a machine without them. The raw peer initializes the
driver before importing numba-cuda, so on a machine without a GPU it never imports
``numba.cuda`` (which would fix numba's simulator choice before trio-cuda makes it).
"""

from __future__ import annotations

import ctypes
import gc
import re
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FIELDS", "PEERS", "run_all", "run_peer"]

#: The keys of every result dict, in order.
FIELDS: tuple[str, ...] = (
    "name",
    "chain_us_per_op",
    "sync_each_us_per_op",
    "roundtrip_us",
    "independent16_pool_ms",
    "independent16_one_stream_ms",
    "independent16_speedup",
    "error",
)

DEFAULT_N = 2000
DEFAULT_REPS = 5
#: Default number of launches for the synchronize-after-each figure (capped by ``n``).
DEFAULT_N_SYNC = 500

_TINY_ELEMENTS = 32  # float32 elements in the array; also the tiny kernel's block size
_SPIN_ITERATIONS = 1000  # nanosleep calls per spin kernel
_SPIN_SLEEP_NS = 1000  # nanoseconds asked of each nanosleep
_TORCH_SPIN_TARGET_MS = 1.0  # what torch.cuda._sleep is calibrated to
_INDEPENDENT_KERNELS = 16
_POOL_STREAMS = 4
_WARMUP_CHAIN = 200  # tiny launches of warm-up (capped by n)
_WARMUP_SMALL = 20  # warm-up synchronized launches and round trips (capped)

#: CUDA C++ source of the kernels for the cuda_core and cupy peers.
_CXX_SOURCE = rf"""
extern "C" __global__ void tiny(float* x) {{
    unsigned int i = threadIdx.x;
    if (i < {_TINY_ELEMENTS}u) x[i] += 1.0f;
}}

extern "C" __global__ void spin() {{
    for (int k = 0; k < {_SPIN_ITERATIONS}; ++k) __nanosleep({_SPIN_SLEEP_NS}u);
}}

extern "C" __global__ void zero(float* x) {{
    unsigned int i = threadIdx.x;
    if (i < {_TINY_ELEMENTS}u) x[i] = 0.0f;
}}
"""

_now = time.perf_counter_ns


# -- pure-Python helpers ----------------------------------------------------------------


def _empty_result(name: str) -> dict[str, Any]:
    """A result dict with every figure ``None``.

    Args:
        name: The peer's name.

    Returns:
        A dict with exactly the keys of :data:`FIELDS`.
    """
    res: dict[str, Any] = dict.fromkeys(FIELDS)
    res["name"] = name
    return res


def _median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence of numbers, as a float.

    Args:
        values: The samples.

    Returns:
        Their median.

    Raises:
        ValueError: If ``values`` is empty.
    """
    if not values:
        raise ValueError("no samples")
    return float(statistics.median(values))


def _check_count(value: Any, what: str) -> int:
    """Checks that a count is a positive int (not a bool).

    Args:
        value: The count.
        what: Its name, for the error message.

    Returns:
        The count.

    Raises:
        ValueError: If it is not an int of at least 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return value


def _resolve_counts(n: int, reps: int, n_sync: int | None, n_roundtrip: int | None) -> tuple[int, int, int, int]:
    """Validates the counts and fills in the defaults.

    Args:
        n: Launches in the chain figure.
        reps: Repetitions of each repeated figure.
        n_sync: Launches in the synchronize-after-each figure; ``None`` for
            ``min(n, 500)``.
        n_roundtrip: Round trips in the round-trip figure; ``None`` for ``n``.

    Returns:
        ``(n, reps, n_sync, n_roundtrip)``.

    Raises:
        ValueError: If a count is not a positive int.
    """
    n = _check_count(n, "n")
    reps = _check_count(reps, "reps")
    n_sync = _check_count(min(n, DEFAULT_N_SYNC) if n_sync is None else n_sync, "n_sync")
    n_roundtrip = _check_count(n if n_roundtrip is None else n_roundtrip, "n_roundtrip")
    return n, reps, n_sync, n_roundtrip


def _describe(exc: BaseException) -> str:
    """One line naming an exception's type and message."""
    text = " ".join(str(exc).split())
    if len(text) > 500:
        text = text[:497] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _ptx_entries(ptx: str) -> list[tuple[str, int]]:
    """The kernels (entry points) a PTX module defines, with their parameter counts.

    Args:
        ptx: PTX source text.

    Returns:
        ``(name, number_of_params)`` for each ``.visible .entry`` in order.
    """
    out = []
    for m in re.finditer(r"\.visible\s+\.entry\s+([A-Za-z_$%][\w$%.]*)\s*\(([^)]*)\)", ptx):
        out.append((m.group(1), len(re.findall(r"\.param\b", m.group(2)))))
    return out


class _Peer:
    """The operations a peer provides to :func:`_run_peer`.

    A subclass makes nothing in ``__init__``: :meth:`open` makes its GPU objects and
    :meth:`close` frees whatever exists, also after a failed :meth:`open`.

    Attributes:
        name: The peer's name (the ``name`` of its result).
        spin_unavailable: ``None``, or why the peer has no spin kernel (then the
            independent16 figures are skipped).
    """

    name = "?"
    spin_unavailable: str | None = None

    def open(self) -> None:
        """Makes the context, kernels, streams, event and array."""
        raise NotImplementedError

    def chain(self, k: int) -> None:
        """Enqueues ``k`` tiny launches on the main stream, without waiting."""
        raise NotImplementedError

    def sync(self) -> None:
        """Synchronizes the main stream."""
        raise NotImplementedError

    def sync_each(self, k: int) -> None:
        """``k`` times: one tiny launch on the main stream, then synchronize it."""
        raise NotImplementedError

    def roundtrip_ns(self, k: int) -> list[int]:
        """``k`` round trips (launch, record event, poll it); each one's nanoseconds."""
        raise NotImplementedError

    _streams: Sequence[Any]  # the 4-stream pool; the first is the main stream

    def _spins(self, streams: Sequence[Any]) -> None:
        """16 spins round-robin over ``streams``, then synchronize them."""
        raise NotImplementedError

    def spin_pool(self) -> None:
        """16 spins round-robin over the 4-stream pool, then synchronize the pool."""
        self._spins(self._streams)

    def spin_one(self) -> None:
        """16 spins on the main stream, then synchronize it."""
        self._spins(self._streams[:1])

    def read_x(self) -> list[float]:
        """Waits for all work, then reads the array back."""
        raise NotImplementedError

    def close(self) -> None:
        """Frees everything :meth:`open` made."""
        raise NotImplementedError


def _run_peer(peer: _Peer, n: int, reps: int, n_sync: int, n_roundtrip: int) -> dict[str, Any]:
    """Measures every figure through one peer, never raising (but for BaseExceptions).

    Args:
        peer: The peer, not yet opened.
        n: Launches in the chain figure.
        reps: Repetitions of the chain, sync_each and independent16 figures.
        n_sync: Launches in the synchronize-after-each figure.
        n_roundtrip: Round trips in the round-trip figure.

    Returns:
        The result dict (keys :data:`FIELDS`).
    """
    res = _empty_result(peer.name)
    stage = "setup"
    launches = 0  # tiny launches made, for the final check
    try:
        peer.open()

        stage = "warm-up"
        w = min(n, _WARMUP_CHAIN)
        peer.chain(w)
        peer.sync()
        launches += w
        w = min(n_sync, _WARMUP_SMALL)
        peer.sync_each(w)
        launches += w
        w = min(n_roundtrip, _WARMUP_SMALL)
        peer.roundtrip_ns(w)
        launches += w

        stage = "chain"
        samples: list[float] = []
        for _ in range(reps):
            t0 = _now()
            peer.chain(n)
            peer.sync()
            samples.append((_now() - t0) / n / 1e3)
            launches += n
        res["chain_us_per_op"] = _median(samples)

        stage = "sync_each"
        samples = []
        for _ in range(reps):
            t0 = _now()
            peer.sync_each(n_sync)
            samples.append((_now() - t0) / n_sync / 1e3)
            launches += n_sync
        res["sync_each_us_per_op"] = _median(samples)

        stage = "roundtrip"
        ns = peer.roundtrip_ns(n_roundtrip)
        launches += n_roundtrip
        res["roundtrip_us"] = _median(ns) / 1e3

        stage = "independent16"
        skipped = peer.spin_unavailable
        if skipped is None:
            peer.spin_pool()  # warm-up: every pool stream, and the spin kernel
            peer.spin_one()
            pool: list[float] = []
            one: list[float] = []
            for _ in range(reps):
                t0 = _now()
                peer.spin_pool()
                pool.append((_now() - t0) / 1e6)
                t0 = _now()
                peer.spin_one()
                one.append((_now() - t0) / 1e6)
            pool_ms, one_ms = _median(pool), _median(one)
            res["independent16_pool_ms"] = pool_ms
            res["independent16_one_stream_ms"] = one_ms
            res["independent16_speedup"] = one_ms / pool_ms if pool_ms > 0 else None

        stage = "check"
        values = peer.read_x()
        wrong = [v for v in values if v != float(launches)]
        if len(values) != _TINY_ELEMENTS or wrong:
            res["error"] = (
                f"check: the array holds {values[:4]!r}... ({len(wrong)} of {len(values)} wrong), "
                f"expected every element = {launches} (the number of tiny launches)"
            )
        elif skipped is not None:
            res["error"] = f"independent16: skipped: {skipped}"
    except Exception as exc:  # a peer must never crash the benchmark
        res["error"] = f"{stage}: {_describe(exc)}"
    finally:
        try:
            peer.close()
        except Exception as exc:
            if res["error"] is None:
                res["error"] = f"cleanup: {_describe(exc)}"
        gc.collect()
    return res


# -- raw cuda.bindings ------------------------------------------------------------------


def _numba_ptx(cc: tuple[int, int]) -> tuple[str, str]:
    """Compiles the tiny and spin kernels to PTX with numba-cuda (no GPU needed).

    Args:
        cc: The compute capability to compile for, ``(major, minor)``.

    Returns:
        ``(tiny_ptx, spin_ptx)``: the tiny kernel takes one ``float32[::1]`` array (7
        kernel parameters in numba's ABI), the spin kernel takes none.
    """
    from numba import cuda, float32, uint32
    from numba.cuda import compile_ptx

    iterations, sleep_ns = _SPIN_ITERATIONS, _SPIN_SLEEP_NS

    def tiny(x):  # type: ignore[no-untyped-def]
        i = cuda.threadIdx.x
        if i < x.shape[0]:
            x[i] += float32(1.0)

    def spin():  # type: ignore[no-untyped-def]
        for _ in range(iterations):
            cuda.nanosleep(uint32(sleep_ns))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tiny_ptx, _ = compile_ptx(tiny, "void(float32[::1])", cc=cc)
            spin_ptx, _ = compile_ptx(spin, "void()", cc=cc)
        except AttributeError as exc:
            if "row_stack" in str(exc):  # numba-cuda 0.30 with numpy >= 2.5
                import numpy

                raise RuntimeError(
                    f"numba-cuda cannot compile kernels with numpy {numpy.__version__} ({exc}); "
                    "install numpy<2.5 (as pyproject.toml pins it)"
                ) from exc
            raise
    return tiny_ptx, spin_ptx


def _ptx_to_cubin(ptx: str, cc: tuple[int, int]) -> bytes:
    """Links PTX to a cubin with nvJitLink (``cuda.bindings.nvjitlink``).

    Used when the driver's own JIT refuses the PTX (for instance PTX of a newer ISA
    version than the driver knows, from a newer NVVM than the driver).

    Args:
        ptx: PTX source text.
        cc: The compute capability, ``(major, minor)``.

    Returns:
        The cubin image.

    Raises:
        RuntimeError: If nvJitLink fails (with its error log).
    """
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(1, [f"-arch=sm_{cc[0]}{cc[1]}".encode()])
    try:
        data = ptx.encode()
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "peer.ptx")
            nvjitlink.complete(handle)
        except Exception as exc:
            log = ""
            try:
                size = nvjitlink.get_error_log_size(handle)
                buf = bytearray(size)
                nvjitlink.get_error_log(handle, buf)
                log = bytes(buf).rstrip(b"\0").decode(errors="replace")
            except Exception:
                pass
            raise RuntimeError(f"nvJitLink failed: {_describe(exc)} {log}".strip()) from exc
        size = nvjitlink.get_linked_cubin_size(handle)
        cubin = bytearray(size)
        nvjitlink.get_linked_cubin(handle, cubin)
        return bytes(cubin)
    finally:
        nvjitlink.destroy(handle)


class _RawBindingsPeer(_Peer):
    """The CUDA driver API through ``cuda.bindings.driver``, kernels from numba-cuda."""

    name = "raw_cuda_bindings"

    def __init__(self, device: int = 0) -> None:
        self._device_ordinal = device
        self._cu: Any = None
        self._dev: Any = None
        self._ctx: Any = None
        self._prev_ctx: Any = None
        self._retained = False
        self._modules: list[Any] = []
        self._streams: list[Any] = []
        self._event: Any = None
        self._x: Any = None
        self._tiny: Any = None
        self._spin: Any = None
        self._slots: Any = None
        self._slot_ptrs: Any = None
        self._kernel_params = 0

    def _ck(self, ret: Any, what: str) -> Any:
        """Checks a cuda.bindings return tuple ``(CUresult, *values)``.

        Returns:
            ``None``, the one value, or a tuple of the values.

        Raises:
            RuntimeError: If the CUresult is not CUDA_SUCCESS.
        """
        cu = self._cu
        err = ret[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {self._err_name(err)}")
        if len(ret) == 1:
            return None
        if len(ret) == 2:
            return ret[1]
        return tuple(ret[1:])

    def _err_name(self, err: Any) -> str:
        try:
            e2, name = self._cu.cuGetErrorName(err)
            if e2 == self._cu.CUresult.CUDA_SUCCESS and name:
                return f"{name.decode() if isinstance(name, bytes) else name} ({int(err)})"
        except Exception:
            pass
        return repr(err)

    def _load(self, ptx: str, cc: tuple[int, int]) -> Any:
        """Loads a PTX module (through nvJitLink where the driver refuses the PTX)."""
        cu = self._cu
        err, module = cu.cuModuleLoadData(ptx.encode() + b"\0")
        if err != cu.CUresult.CUDA_SUCCESS:
            first = self._err_name(err)
            try:
                cubin = _ptx_to_cubin(ptx, cc)
            except Exception as exc:
                raise RuntimeError(
                    f"cuModuleLoadData(PTX) failed: {first}; linking it with nvJitLink failed too: {_describe(exc)}"
                ) from exc
            module = self._ck(cu.cuModuleLoadData(cubin), f"cuModuleLoadData(cubin) after PTX failed with {first}")
        self._modules.append(module)
        return module

    def open(self) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        # The driver first: on a machine without a GPU this fails before numba.cuda is
        # imported (see the module docstring).
        self._ck(cu.cuInit(0), "cuInit")
        count = self._ck(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if count <= self._device_ordinal:
            raise RuntimeError(f"no CUDA device {self._device_ordinal} ({count} found)")
        self._dev = self._ck(cu.cuDeviceGet(self._device_ordinal), "cuDeviceGet")
        attr = cu.CUdevice_attribute
        major = self._ck(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev), "cuDeviceGetAttribute"
        )
        minor = self._ck(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev), "cuDeviceGetAttribute"
        )
        cc = (int(major), int(minor))
        self._prev_ctx = self._ck(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._ctx = self._ck(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._retained = True
        self._ck(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

        tiny_ptx, spin_ptx = _numba_ptx(cc)
        entries = _ptx_entries(tiny_ptx)
        if len(entries) != 1 or entries[0][1] != 7:
            raise RuntimeError(f"unexpected numba PTX for the tiny kernel: entries {entries!r}, expected one with 7 params")
        self._tiny = self._ck(cu.cuModuleGetFunction(self._load(tiny_ptx, cc), entries[0][0].encode()), "cuModuleGetFunction")
        entries = _ptx_entries(spin_ptx)
        if len(entries) != 1 or entries[0][1] != 0:
            raise RuntimeError(f"unexpected numba PTX for the spin kernel: entries {entries!r}, expected one with 0 params")
        self._spin = self._ck(cu.cuModuleGetFunction(self._load(spin_ptx, cc), entries[0][0].encode()), "cuModuleGetFunction")

        flags = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        for _ in range(_POOL_STREAMS):
            self._streams.append(self._ck(cu.cuStreamCreate(flags), "cuStreamCreate"))
        self._event = self._ck(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
        nbytes = 4 * _TINY_ELEMENTS
        self._x = self._ck(cu.cuMemAlloc(nbytes), "cuMemAlloc")
        self._ck(cu.cuMemsetD32Async(self._x, 0, _TINY_ELEMENTS, self._streams[0]), "cuMemsetD32Async")
        self._ck(cu.cuStreamSynchronize(self._streams[0]), "cuStreamSynchronize")

        # numba's ABI for one float32[::1] array: meminfo, parent, nitems, itemsize,
        # data, shape[0], strides[0]; one 8-byte slot each, packed once.
        self._slots = (ctypes.c_uint64 * 7)(0, 0, _TINY_ELEMENTS, 4, int(self._x), _TINY_ELEMENTS, 4)
        base = ctypes.addressof(self._slots)
        self._slot_ptrs = (ctypes.c_void_p * 7)(*[base + 8 * i for i in range(7)])
        self._kernel_params = ctypes.addressof(self._slot_ptrs)  # a void** as an int

    def chain(self, k: int) -> None:
        launch, ok = self._cu.cuLaunchKernel, self._cu.CUresult.CUDA_SUCCESS
        f, s, params = self._tiny, self._streams[0], self._kernel_params
        for _ in range(k):
            (err,) = launch(f, 1, 1, 1, _TINY_ELEMENTS, 1, 1, 0, s, params, 0)
            if err != ok:
                raise RuntimeError(f"cuLaunchKernel failed: {self._err_name(err)}")

    def sync(self) -> None:
        self._ck(self._cu.cuStreamSynchronize(self._streams[0]), "cuStreamSynchronize")

    def sync_each(self, k: int) -> None:
        cu = self._cu
        launch, synchronize, ok = cu.cuLaunchKernel, cu.cuStreamSynchronize, cu.CUresult.CUDA_SUCCESS
        f, s, params = self._tiny, self._streams[0], self._kernel_params
        for _ in range(k):
            (err,) = launch(f, 1, 1, 1, _TINY_ELEMENTS, 1, 1, 0, s, params, 0)
            if err != ok:
                raise RuntimeError(f"cuLaunchKernel failed: {self._err_name(err)}")
            (err,) = synchronize(s)
            if err != ok:
                raise RuntimeError(f"cuStreamSynchronize failed: {self._err_name(err)}")

    def roundtrip_ns(self, k: int) -> list[int]:
        cu = self._cu
        launch, record, query = cu.cuLaunchKernel, cu.cuEventRecord, cu.cuEventQuery
        ok, not_ready = cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_NOT_READY
        f, s, params, ev = self._tiny, self._streams[0], self._kernel_params, self._event
        out = []
        for _ in range(k):
            t0 = _now()
            (err,) = launch(f, 1, 1, 1, _TINY_ELEMENTS, 1, 1, 0, s, params, 0)
            if err != ok:
                raise RuntimeError(f"cuLaunchKernel failed: {self._err_name(err)}")
            (err,) = record(ev, s)
            if err != ok:
                raise RuntimeError(f"cuEventRecord failed: {self._err_name(err)}")
            while True:
                (err,) = query(ev)
                if err == ok:
                    break
                if err != not_ready:
                    raise RuntimeError(f"cuEventQuery failed: {self._err_name(err)}")
            out.append(_now() - t0)
        return out

    def _spins(self, streams: Sequence[Any]) -> None:
        cu = self._cu
        launch, ok, f = cu.cuLaunchKernel, cu.CUresult.CUDA_SUCCESS, self._spin
        for i in range(_INDEPENDENT_KERNELS):
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, streams[i % len(streams)], 0, 0)
            if err != ok:
                raise RuntimeError(f"cuLaunchKernel failed: {self._err_name(err)}")
        for s in streams:
            self._ck(cu.cuStreamSynchronize(s), "cuStreamSynchronize")

    def read_x(self) -> list[float]:
        cu = self._cu
        self._ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        host = (ctypes.c_float * _TINY_ELEMENTS)()
        self._ck(cu.cuMemcpyDtoH(ctypes.addressof(host), self._x, 4 * _TINY_ELEMENTS), "cuMemcpyDtoH")
        return [float(v) for v in host]

    def close(self) -> None:
        cu = self._cu
        if cu is None:
            return
        errors: list[str] = []

        def attempt(fn: Callable[..., Any], *args: Any, what: str) -> None:
            try:
                self._ck(fn(*args), what)
            except Exception as exc:
                errors.append(_describe(exc))

        if self._retained:
            attempt(cu.cuCtxSynchronize, what="cuCtxSynchronize")
        if self._event is not None:
            attempt(cu.cuEventDestroy, self._event, what="cuEventDestroy")
            self._event = None
        for s in self._streams:
            attempt(cu.cuStreamDestroy, s, what="cuStreamDestroy")
        self._streams = []
        for m in self._modules:
            attempt(cu.cuModuleUnload, m, what="cuModuleUnload")
        self._modules = []
        if self._x is not None:
            attempt(cu.cuMemFree, self._x, what="cuMemFree")
            self._x = None
        if self._retained:
            # Leave the thread's current context as it was before open(), so that no
            # later user finds a released primary context current.
            attempt(cu.cuCtxSetCurrent, self._prev_ctx, what="cuCtxSetCurrent")
            attempt(cu.cuDevicePrimaryCtxRelease, self._dev, what="cuDevicePrimaryCtxRelease")
            self._retained = False
        if errors:
            raise RuntimeError("; ".join(errors))


# -- cuda.core --------------------------------------------------------------------------


def _import_cuda_core() -> Any:
    """``cuda.core`` (0.4 and later), or ``cuda.core.experimental`` (earlier releases)."""
    try:
        import cuda.core as mod

        if all(hasattr(mod, a) for a in ("Device", "Program", "LaunchConfig", "launch")):
            return mod
    except ImportError:
        pass
    import cuda.core.experimental as mod  # type: ignore[no-redef]

    return mod


class _CudaCorePeer(_Peer):
    """NVIDIA's cuda.core: Program (NVRTC to cubin), LaunchConfig, launch, streams, events."""

    name = "cuda_core"

    def __init__(self, device: int = 0) -> None:
        self._device_ordinal = device
        self._cc: Any = None
        self._dev: Any = None
        self._program: Any = None
        self._streams: list[Any] = []
        self._event: Any = None
        self._x: Any = None
        self._tiny: Any = None
        self._spin: Any = None
        self._cfg_tiny: Any = None
        self._cfg_spin: Any = None

    def open(self) -> None:
        cc = self._cc = _import_cuda_core()
        dev = self._dev = cc.Device(self._device_ordinal)
        dev.set_current()
        cap = dev.compute_capability
        arch = f"sm_{cap[0]}{cap[1]}"
        self._program = cc.Program(_CXX_SOURCE, "c++", options=cc.ProgramOptions(arch=arch))
        module = self._program.compile("cubin")
        self._tiny = module.get_kernel("tiny")
        self._spin = module.get_kernel("spin")
        zero = module.get_kernel("zero")
        self._cfg_tiny = cc.LaunchConfig(grid=1, block=_TINY_ELEMENTS)
        self._cfg_spin = cc.LaunchConfig(grid=1, block=1)
        for _ in range(_POOL_STREAMS):
            self._streams.append(dev.create_stream(options=cc.StreamOptions(nonblocking=True)))
        self._event = dev.create_event()  # default options: timing off
        s = self._streams[0]
        self._x = dev.allocate(4 * _TINY_ELEMENTS, stream=s)
        cc.launch(s, self._cfg_tiny, zero, self._x)
        s.sync()

    def chain(self, k: int) -> None:
        launch, s, cfg, f, x = self._cc.launch, self._streams[0], self._cfg_tiny, self._tiny, self._x
        for _ in range(k):
            launch(s, cfg, f, x)

    def sync(self) -> None:
        self._streams[0].sync()

    def sync_each(self, k: int) -> None:
        launch, s, cfg, f, x = self._cc.launch, self._streams[0], self._cfg_tiny, self._tiny, self._x
        for _ in range(k):
            launch(s, cfg, f, x)
            s.sync()

    def roundtrip_ns(self, k: int) -> list[int]:
        launch, s, cfg, f, x, ev = self._cc.launch, self._streams[0], self._cfg_tiny, self._tiny, self._x, self._event
        out = []
        for _ in range(k):
            t0 = _now()
            launch(s, cfg, f, x)
            s.record(ev)
            while not ev.is_done:
                pass
            out.append(_now() - t0)
        return out

    def _spins(self, streams: Sequence[Any]) -> None:
        launch, cfg, f = self._cc.launch, self._cfg_spin, self._spin
        for i in range(_INDEPENDENT_KERNELS):
            launch(streams[i % len(streams)], cfg, f)
        for s in streams:
            s.sync()

    def read_x(self) -> list[float]:
        # cuda.core's own device-to-host copy needs a host Buffer, whose API moved
        # between releases; the driver call (cuda.core depends on cuda.bindings) is
        # the same everywhere and is not part of any figure.
        from cuda.bindings import driver as cu

        self._dev.sync()
        host = (ctypes.c_float * _TINY_ELEMENTS)()
        (err,) = cu.cuMemcpyDtoH(ctypes.addressof(host), int(self._x.handle), 4 * _TINY_ELEMENTS)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyDtoH failed: {err!r}")
        return [float(v) for v in host]

    def close(self) -> None:
        errors: list[str] = []
        if self._dev is not None:
            try:
                self._dev.sync()
            except Exception as exc:
                errors.append(_describe(exc))
        for obj in [self._x, self._event, *self._streams, self._program]:
            if obj is None:
                continue
            try:
                obj.close()
            except Exception as exc:
                errors.append(_describe(exc))
        self._x = self._event = self._program = None
        self._streams = []
        self._tiny = self._spin = None
        if errors:
            raise RuntimeError("; ".join(errors))


# -- CuPy -------------------------------------------------------------------------------


class _CupyPeer(_Peer):
    """CuPy: RawKernel on CUDA C++, non-blocking streams made current with ``with``."""

    name = "cupy"

    def __init__(self, device: int = 0) -> None:
        self._device_ordinal = device
        self._cp: Any = None
        self._dev: Any = None
        self._streams: list[Any] = []
        self._event: Any = None
        self._x: Any = None
        self._tiny: Any = None
        self._spin: Any = None

    def open(self) -> None:
        import cupy as cp

        self._cp = cp
        count = cp.cuda.runtime.getDeviceCount()
        if count <= self._device_ordinal:
            raise RuntimeError(f"no CUDA device {self._device_ordinal} ({count} found)")
        self._dev = cp.cuda.Device(self._device_ordinal)
        self._dev.use()
        self._tiny = cp.RawKernel(_CXX_SOURCE, "tiny")
        self._spin = cp.RawKernel(_CXX_SOURCE, "spin")
        self._streams = [cp.cuda.Stream(non_blocking=True) for _ in range(_POOL_STREAMS)]
        self._event = cp.cuda.Event(disable_timing=True)
        self._x = cp.zeros(_TINY_ELEMENTS, dtype=cp.float32)
        self._dev.synchronize()

    def chain(self, k: int) -> None:
        f, args, grid, block = self._tiny, (self._x,), (1,), (_TINY_ELEMENTS,)
        with self._streams[0]:
            for _ in range(k):
                f(grid, block, args)

    def sync(self) -> None:
        self._streams[0].synchronize()

    def sync_each(self, k: int) -> None:
        f, args, grid, block, s = self._tiny, (self._x,), (1,), (_TINY_ELEMENTS,), self._streams[0]
        with s:
            for _ in range(k):
                f(grid, block, args)
                s.synchronize()

    def roundtrip_ns(self, k: int) -> list[int]:
        f, args, grid, block = self._tiny, (self._x,), (1,), (_TINY_ELEMENTS,)
        s, ev = self._streams[0], self._event
        out = []
        with s:
            for _ in range(k):
                t0 = _now()
                f(grid, block, args)
                ev.record(s)
                while not ev.done:
                    pass
                out.append(_now() - t0)
        return out

    def _spins(self, streams: Sequence[Any]) -> None:
        f, grid, block = self._spin, (1,), (1,)
        for i in range(_INDEPENDENT_KERNELS):
            with streams[i % len(streams)]:
                f(grid, block, ())
        for s in streams:
            s.synchronize()

    def read_x(self) -> list[float]:
        self._dev.synchronize()
        return [float(v) for v in self._x.get()]

    def close(self) -> None:
        if self._dev is not None:
            self._dev.synchronize()
        self._x = self._event = self._tiny = self._spin = None
        self._streams = []  # CuPy destroys streams and events when they are collected


# -- PyTorch ----------------------------------------------------------------------------


class _TorchPeer(_Peer):
    """PyTorch eager: ``x.add_(1.0)``, torch.cuda streams and events, ``torch.cuda._sleep``."""

    name = "torch"

    def __init__(self, device: int = 0) -> None:
        self._device_ordinal = device
        self._torch: Any = None
        self._dev: Any = None
        self._streams: list[Any] = []
        self._event: Any = None
        self._x: Any = None
        self._sleep: Callable[[int], None] | None = None
        self._cycles = 0

    def open(self) -> None:
        import torch

        self._torch = torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        if torch.cuda.device_count() <= self._device_ordinal:
            raise RuntimeError(f"no CUDA device {self._device_ordinal} ({torch.cuda.device_count()} found)")
        self._dev = torch.device("cuda", self._device_ordinal)
        self._x = torch.zeros(_TINY_ELEMENTS, dtype=torch.float32, device=self._dev)
        self._streams = [torch.cuda.Stream(device=self._dev) for _ in range(_POOL_STREAMS)]
        self._event = torch.cuda.Event()  # timing off by default
        torch.cuda.synchronize(self._dev)
        sleep = getattr(torch.cuda, "_sleep", None)
        if callable(sleep):
            self._sleep = sleep
            self._cycles = self._calibrate(_TORCH_SPIN_TARGET_MS)
        else:
            self.spin_unavailable = "torch.cuda._sleep is not available in this PyTorch"

    def _calibrate(self, target_ms: float) -> int:
        """Cycles for ``torch.cuda._sleep`` to last about ``target_ms`` (timing events)."""
        torch, s, sleep = self._torch, self._streams[0], self._sleep
        assert sleep is not None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        cycles = int(1.98e9 * target_ms / 1e3)  # H200's boost clock as the first guess
        with torch.cuda.stream(s):
            for _ in range(4):  # the first is a warm-up; the guess converges quickly
                start.record(s)
                sleep(cycles)
                end.record(s)
                end.synchronize()
                ms = start.elapsed_time(end)
                if ms > 0:
                    cycles = max(1000, int(cycles * target_ms / ms))
        return cycles

    def chain(self, k: int) -> None:
        x = self._x
        with self._torch.cuda.stream(self._streams[0]):
            for _ in range(k):
                x.add_(1.0)

    def sync(self) -> None:
        self._streams[0].synchronize()

    def sync_each(self, k: int) -> None:
        x, s = self._x, self._streams[0]
        with self._torch.cuda.stream(s):
            for _ in range(k):
                x.add_(1.0)
                s.synchronize()

    def roundtrip_ns(self, k: int) -> list[int]:
        x, s, ev = self._x, self._streams[0], self._event
        out = []
        with self._torch.cuda.stream(s):
            for _ in range(k):
                t0 = _now()
                x.add_(1.0)
                ev.record(s)
                while not ev.query():
                    pass
                out.append(_now() - t0)
        return out

    def _spins(self, streams: Sequence[Any]) -> None:
        stream_ctx, sleep, cycles = self._torch.cuda.stream, self._sleep, self._cycles
        assert sleep is not None
        for i in range(_INDEPENDENT_KERNELS):
            with stream_ctx(streams[i % len(streams)]):
                sleep(cycles)
        for s in streams:
            s.synchronize()

    def read_x(self) -> list[float]:
        self._torch.cuda.synchronize(self._dev)
        return [float(v) for v in self._x.cpu().tolist()]

    def close(self) -> None:
        if self._dev is not None:
            self._torch.cuda.synchronize(self._dev)
        self._x = self._event = None
        self._streams = []


# -- public API -------------------------------------------------------------------------


PEERS: dict[str, type[_Peer]] = {
    "raw_cuda_bindings": _RawBindingsPeer,  # cuda.bindings.driver, numba PTX, params packed once
    "cuda_core": _CudaCorePeer,  # cuda.core (or cuda.core.experimental), C++ kernels
    "cupy": _CupyPeer,  # cupy.RawKernel, streams, events
    "torch": _TorchPeer,  # PyTorch eager x.add_(1.0); torch.cuda._sleep for the 1 ms kernels
}


def run_peer(
    name: str,
    n: int = DEFAULT_N,
    reps: int = DEFAULT_REPS,
    *,
    n_sync: int | None = None,
    n_roundtrip: int | None = None,
    device: int = 0,
) -> dict[str, Any]:
    """Measures the figures through one peer (a key of :data:`PEERS`).

    Args:
        name: The peer.
        n: Launches in the chain figure.
        reps: Repetitions of the repeated figures.
        n_sync: Launches in the synchronize-after-each figure (default ``min(n, 500)``).
        n_roundtrip: Round trips in the round-trip figure (default ``n``).
        device: The CUDA device ordinal.

    Returns:
        The result dict (keys :data:`FIELDS`); ``error`` says what failed, if anything.

    Raises:
        ValueError: If a count is not a positive int or the peer is unknown.
    """
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; one of {', '.join(PEERS)}")
    n, reps, n_sync, n_roundtrip = _resolve_counts(n, reps, n_sync, n_roundtrip)
    return _run_peer(PEERS[name](device), n, reps, n_sync, n_roundtrip)


def run_all(n: int = DEFAULT_N, reps: int = DEFAULT_REPS) -> list[dict[str, Any]]:
    """Runs every peer, one after another, and returns their results.

    The peers run in this order: raw_cuda_bindings, cuda_core, cupy, torch, each on
    device 0, each independent of the others (a missing library or a failure gives that
    peer's figures as None and its error string, and the next peer still runs).

    Args:
        n: Tiny launches in the chain figure (the synchronize-after-each figure uses
            ``min(n, 500)`` launches, the round-trip figure ``n`` round trips).
        reps: Repetitions of the chain, sync_each and independent16 figures (medians).

    Returns:
        One dict per peer, each with exactly the keys ``name``, ``chain_us_per_op``,
        ``sync_each_us_per_op``, ``roundtrip_us``, ``independent16_pool_ms``,
        ``independent16_one_stream_ms``, ``independent16_speedup`` and ``error``.

    Raises:
        ValueError: If ``n`` or ``reps`` is not a positive int.
    """
    _resolve_counts(n, reps, None, None)
    return [run_peer(name, n, reps) for name in PEERS]


if __name__ == "__main__":
    import json
    import sys

    _args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(run_all(*_args), indent=2))
