"""The backend boundary: the only interface through which the runtime talks to a device.

Two backends implement it: :mod:`._cuda` (the CUDA driver through ``cuda.bindings``)
and :mod:`._sim` (a simulated device that runs anywhere). Everything above this
module (ops, combinators, scheduling, dependency tracking, cancellation, the
notifier) is backend-free.

The interface is deliberately small and driver-shaped: opaque stream and event
handles, integer device pointers, numpy arrays for host memory. Handles are
whatever the backend likes; the runtime never looks inside them.

Threading contract: the runtime makes *fast* calls (everything but those named slow)
under its lock, never concurrently with :meth:`DeviceDriver.reset`; *slow* calls
(``load_kernel``, ``host_alloc``, ``host_free``, ``reset``) are made under the
device's slow lock, without the runtime lock. No call blocks waiting for the device
except the slow ones; waiting is done through :meth:`DeviceDriver.arm` and a
:class:`Waker`.

Errors: a backend raises :class:`~trio_cuda.LaunchError` when it refuses to enqueue
work, :class:`~trio_cuda.DeviceOutOfMemory` when an allocation fails and
:class:`~trio_cuda.DeviceFault` from ``query`` (and every later call) once the device
has faulted asynchronously, or from ``query`` of an event whose preceding work failed
(the simulated device's failed cross-device wait).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "ArrayArg",
    "AttentionDesc",
    "Backend",
    "CollectiveCall",
    "DeviceDriver",
    "GemmDesc",
    "GemmOperand",
    "KernelSource",
    "Waker",
    "gemm_dtype",
    "signature_of",
]


class ArrayArg:
    """A device array passed to a kernel: where it lives and how it is laid out.

    Strides are in bytes, as numpy and numba count them. Tensors cache their
    ArrayArgs, so per-argument work done here is done once per tensor view.
    """

    __slots__ = ("_params", "contiguous", "dtype", "ptr", "shape", "strides", "writable")

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype[Any], writable: bool) -> None:
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.writable = writable
        self.contiguous = _is_c_contiguous(shape, strides, dtype.itemsize)
        self._params: tuple[int, ...] | None = None

    def numba_params(self) -> tuple[int, ...]:
        """The array flattened as numba passes it to a kernel.

        (meminfo, parent, nitems, itemsize, data, *shape, *strides); meminfo and parent
        are unused on the device and passed as null.
        """
        p = self._params
        if p is None:
            nitems = 1
            for n in self.shape:
                nitems *= n
            p = self._params = (0, 0, nitems, self.dtype.itemsize, self.ptr, *self.shape, *self.strides)
        return p

    def __repr__(self) -> str:
        return f"ArrayArg(ptr={self.ptr:#x}, shape={self.shape}, strides={self.strides}, dtype={self.dtype}, writable={self.writable})"


@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """A (batch of) matrix operand(s) of a GEMM: ``rows x cols``, stored row-major
    (element ``(i, j)`` at ``i * ld + j``) or, with ``col_major``, at ``i + j * ld``;
    consecutive matrices of the batch ``batch_stride`` elements apart (0: shared)."""

    rows: int
    cols: int
    ld: int
    col_major: bool
    batch_stride: int


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One rank's part of a collective: its device, the stream it runs on, its send and
    receive buffers (device addresses; equal for in-place) and NCCL's count (elements:
    of the whole buffer for all_reduce and broadcast, per rank for all_gather's send and
    reduce_scatter's receive)."""

    rank: int
    driver: DeviceDriver
    stream: Any
    send: int
    recv: int
    count: int


@dataclasses.dataclass(frozen=True)
class GemmDesc:
    """``D[b] = act(A[b] @ B[b] + bias)`` for ``b < batch``: A is ``m x k``, B ``k x n``,
    D ``m x n`` row-major and contiguous (``ld = n``, ``batch_stride = m * n``); bias has
    ``n`` elements (one per output column) when ``has_bias``.

    Attributes:
        dtype: numpy dtype name of A, B, D and the bias ("float16", "bfloat16",
            "float32", "float64").
        activation: "none", "relu" or "gelu" (tanh approximation), after the bias.
        allow_tf32: float32 inputs may run on TF32 tensor cores (10-bit mantissas).
    """

    m: int
    n: int
    k: int
    batch: int
    a: GemmOperand
    b: GemmOperand
    dtype: str
    has_bias: bool = False
    activation: str = "none"
    allow_tf32: bool = False
    align: int = 256  # the smallest alignment (bytes) of the pointers, up to 256

    def __hash__(self) -> int:
        # Computed once: a GEMM's plan is looked up by its desc at every launch.
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash(dataclasses.astuple(self))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict[str, Any]:
        # The cached hash stays behind: string hashes differ between processes.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}


@dataclasses.dataclass(frozen=True)
class AttentionDesc:
    """``O = softmax(scale * Q @ K^T + bias, causal mask) @ V`` for every (batch, head):
    Q is ``(batch, heads, seq_q, head_dim)``, K ``(batch, heads, seq_k, head_dim)``, V
    ``(batch, heads, seq_k, head_dim_v)``, O ``(batch, heads, seq_q, head_dim_v)``, each
    with its strides in elements (the last one 1); the bias, when ``bias_shape`` is set,
    is C-contiguous of that shape, ``(1 or batch, 1 or heads, seq_q, seq_k)``, and is
    added to the scaled scores. All of dtype ``dtype`` ("float16", "bfloat16", or on
    a device whose :attr:`DeviceDriver.attention_dtypes` says so, "float32").

    ``causal``: query ``i`` attends to keys ``j <= i`` only (the top-left-aligned mask
    of ``torch.nn.functional.scaled_dot_product_attention``'s ``is_causal``).
    """

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    scale: float
    causal: bool
    q_strides: tuple[int, int, int, int]
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    o_strides: tuple[int, int, int, int]
    bias_shape: tuple[int, int, int, int] | None = None

    def __hash__(self) -> int:
        # Computed once: the plan is looked up by its desc at every call (as GemmDesc's).
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash(dataclasses.astuple(self))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def shapes(self) -> tuple[tuple[int, int, int, int], ...]:
        """The shapes of Q, K, V and O."""
        b, h = self.batch, self.heads
        return (
            (b, h, self.seq_q, self.head_dim),
            (b, h, self.seq_k, self.head_dim),
            (b, h, self.seq_k, self.head_dim_v),
            (b, h, self.seq_q, self.head_dim_v),
        )


def gemm_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a GemmDesc dtype name."""
    if name == "bfloat16":
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    return np.dtype(name)


def _is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    expect = itemsize
    for n, s in zip(reversed(shape), reversed(strides), strict=False):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def signature_of(args: Sequence[Any]) -> tuple[Any, ...]:
    """The compile signature of kernel arguments: what numba specializes on.

    Arrays contribute (dtype, ndim, layout, writable); scalars their numpy dtype.
    """
    key: list[Any] = []
    for a in args:
        if type(a) is ArrayArg:
            key.append((a.dtype.str, len(a.shape), "C" if a.contiguous else "A", a.writable))
        else:
            key.append(scalar_dtype(a).str)
    return tuple(key)


def scalar_dtype(v: Any) -> np.dtype[Any]:
    """The numpy dtype a kernel scalar is passed as."""
    if isinstance(v, np.generic):
        return v.dtype
    if isinstance(v, bool):
        return np.dtype(np.bool_)
    if isinstance(v, int):
        return np.dtype(np.int64)
    if isinstance(v, float):
        return np.dtype(np.float64)
    if isinstance(v, complex):
        return np.dtype(np.complex128)
    raise TypeError(f"unsupported kernel scalar {v!r}")


class KernelSource(Protocol):
    """What a backend needs to build a kernel.

    Attributes:
        name: For errors and traces.
        py_func: The numba-cuda Python function.
        host_impl: On the simulated device, run this instead of simulating the kernel.
        key: The content key (a hex digest): equal keys compile to the same code.
        cacheable: True if ``key`` depends on content only (safe to cache on disk).
    """

    name: str
    py_func: Callable[..., Any]
    host_impl: Callable[..., Any] | None

    @property
    def key(self) -> str: ...

    @property
    def cacheable(self) -> bool: ...


class Waker(abc.ABC):
    """A counting wake-up that a helper thread blocks on without holding the GIL.

    Wakers live for the whole process: a pending device-side post must never write
    into freed memory.
    """

    @abc.abstractmethod
    def wait(self, timeout: float | None) -> bool:
        """Block until posted at least once or ``timeout`` seconds pass; True if posted.
        Every post made before it returns is consumed: the waiter re-examines everything
        after each wake-up, so posts that piled up while it was busy are one wake-up,
        not one each."""

    @abc.abstractmethod
    def post(self) -> None:
        """Wake one ``wait``."""


class DeviceDriver(abc.ABC):
    """One device as the driver sees it (see the module docstring for threading)."""

    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    _fault: BaseException | None  # what fault() returns (read directly on hot paths)

    # -- streams and events -------------------------------------------------
    @abc.abstractmethod
    def create_stream(self) -> Any: ...

    @abc.abstractmethod
    def destroy_stream(self, stream: Any) -> None:
        """Release a stream; work already enqueued on it still completes."""

    @abc.abstractmethod
    def create_event(self) -> Any: ...

    @abc.abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``: it completes when the work enqueued so far does."""

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any, *, ordering_only: bool = False) -> None:
        """Make future work on ``stream`` wait until ``event`` (possibly of another device)
        completes. Where a backend fails the waiting work when the work before ``event``
        failed (the simulated device), ``ordering_only`` waits without that."""

    @abc.abstractmethod
    def query(self, event: Any) -> bool:
        """True when ``event`` has completed. Raises DeviceFault if its work failed."""

    @abc.abstractmethod
    def arm(self, event: Any, stream: Any, waker: Waker) -> None:
        """Post ``waker`` once ``event`` (last recorded on ``stream``; None if that driver
        stream was destroyed since) completes, or at once if it has; a faulted device may
        never post (callers re-poll)."""

    # -- memory ---------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, nbytes: int, stream: Any) -> int:
        """Stream-ordered allocation of ``nbytes`` (> 0); returns a device pointer."""

    @abc.abstractmethod
    def free(self, ptr: int, stream: Any) -> None:
        """Stream-ordered free: the memory is reusable once ``stream`` reaches this point."""

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> np.ndarray:
        """(Slow.) Host memory that copies can use asynchronously (pinned on CUDA); uint8."""

    @abc.abstractmethod
    def host_free(self, buf: np.ndarray) -> None:
        """(Slow.) Release memory from :meth:`host_alloc` (no copy may still use it)."""

    @abc.abstractmethod
    def fill(self, ptr: int, nbytes: int, pattern: bytes, stream: Any) -> None:
        """Fill ``nbytes`` at ``ptr`` with the repeated ``pattern`` (1, 2, 4 or 8 bytes)."""

    @abc.abstractmethod
    def copy_h2d(self, dst: int, src: np.ndarray, stream: Any) -> None:
        """Copy the bytes of the contiguous host array ``src`` to ``dst``."""

    @abc.abstractmethod
    def copy_d2h(self, dst: np.ndarray, src: int, stream: Any) -> None:
        """Copy ``dst.nbytes`` bytes at ``src`` into the contiguous host array ``dst``."""

    @abc.abstractmethod
    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None: ...

    @abc.abstractmethod
    def copy_peer(self, dst: int, src_driver: DeviceDriver, src: int, nbytes: int, stream: Any) -> None:
        """Copy from another device's memory into this device's memory."""

    @abc.abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) as the device reports them."""

    # -- kernels --------------------------------------------------------------
    @abc.abstractmethod
    def loaded_kernel(self, source: KernelSource, signature: tuple[Any, ...]) -> Any:
        """The kernel loaded for ``signature`` if it is loaded already, else None (fast)."""

    @abc.abstractmethod
    def load_kernel(self, source: KernelSource, signature: tuple[Any, ...], args: Sequence[Any]) -> Any:
        """(Slow.) Compile (cached by content on disk where possible) and load the kernel
        for ``signature`` (made from ``args``); returns what :meth:`prepare_launch` takes.
        Thread-safe and idempotent. Raises LaunchError if the kernel cannot be built."""

    @abc.abstractmethod
    def prepare_launch(
        self,
        loaded: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[ArrayArg | int | float | bool | complex | np.generic],
    ) -> Any:
        """Everything a launch needs but the stream: the loaded kernel and its packed
        parameters. The runtime caches the result per (kernel, arguments), so a hot
        launch is one driver call. Raises LaunchError for an invalid configuration."""

    @abc.abstractmethod
    def launch(self, prepared: Any, stream: Any) -> None:
        """Enqueue a prepared launch. Raises LaunchError if the launch is refused."""

    def adopt(self, address: int, nbytes: int, owner: Any) -> int:
        """Memory another library owns (at ``address``, ``owner`` keeps it alive) as a
        device address of this driver, without a copy. On CUDA the address itself."""
        return address

    def release_adopted(self, ptr: int) -> None:
        """Forget memory :meth:`adopt` made visible (the owner lets it go next)."""
        del ptr  # on CUDA the address was the library's own: nothing to forget

    def foreign_stream(self, handle: int) -> Any:
        """Another library's stream (an int handle) as this driver takes streams."""
        raise TypeError(f"device {self.ordinal} has no CUDA streams (the simulated device)")

    def wait_foreign(self, stream: Any, foreign: Any) -> None:
        """Order ``stream`` after the work enqueued so far on a foreign stream."""
        raise TypeError(f"device {self.ordinal} has no CUDA streams (the simulated device)")

    # -- tracing (trio_cuda.trace) ----------------------------------------------------
    @abc.abstractmethod
    def trace_clock(self) -> Any:
        """A reference point that timestamps are measured from (may block briefly)."""

    @abc.abstractmethod
    def timestamp(self, stream: Any) -> Any:
        """Enqueue a timestamp on ``stream``: it is taken when the stream reaches it."""

    @abc.abstractmethod
    def timestamp_seconds(self, reference: Any, stamp: Any) -> float | None:
        """The time of ``stamp`` on the host's ``time.perf_counter`` clock, or None if the
        stream has not reached it (never blocks)."""

    # -- libraries ------------------------------------------------------------
    @abc.abstractmethod
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
        """Enqueue ``D = epilogue(A @ B + bias)`` as ``desc`` describes it (row-major
        terms; pointers are device addresses; ``bias`` is 0 without one). ``capturing``
        says whether ``stream`` is recording a graph (None: unknown, the backend asks the
        driver); ``foreign``: another library's stream (no per-stream state is kept for
        it: that library may destroy it and reuse its handle). ``reuse``: the caller will
        likely make this exact call (desc, pointers, stream) again, as a replayed recipe
        does; the backend may keep a prepared form of it (the CUDA backend captures the
        library's call at the first such call and replays it as a graph). Raises
        LaunchError if the library refuses the problem."""

    # The dtype names :meth:`attention` takes (see attention_check).
    attention_dtypes: tuple[str, ...] = ("float16", "bfloat16")

    def attention_check(self) -> None:  # noqa: B027 (a hook: nothing to check by default)
        """Raise ImportError, saying what to install, where :meth:`attention` needs a
        library this process does not have (called before any work is planned)."""

    @abc.abstractmethod
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
        """Enqueue the fused attention ``desc`` describes (pointers are device
        addresses; ``bias`` is 0 without one). ``capturing`` and ``foreign`` as for
        :meth:`matmul`. Raises GraphCaptureError if the library cannot run it inside a
        capture, LaunchError if it refuses the problem."""

    # -- graphs ---------------------------------------------------------------
    @abc.abstractmethod
    def begin_capture(self, stream: Any) -> None: ...

    @abc.abstractmethod
    def end_capture(self, stream: Any) -> Any:
        """End the capture and return an instantiated, launchable graph."""

    @abc.abstractmethod
    def abort_capture(self, stream: Any) -> None:
        """End a capture whose graph is not wanted (releases what it recorded)."""

    @abc.abstractmethod
    def graph_launch(self, graph: Any, stream: Any) -> None: ...

    @abc.abstractmethod
    def graph_nodes(self, graph: Any) -> int: ...

    @abc.abstractmethod
    def graph_destroy(self, graph: Any) -> None: ...

    # -- faults ---------------------------------------------------------------
    @abc.abstractmethod
    def fault(self) -> BaseException | None:
        """The sticky asynchronous fault of this device, if any."""

    @abc.abstractmethod
    def reset(self) -> None:
        """(Slow.) Discard all state of the device (memory, streams, events, fault)."""

    def at_exit(self) -> None:  # noqa: B027 (a hook: nothing to do unless overridden)
        """The process exits (called under the runtime lock, before the interpreter's
        teardown): release what must not be left to it. Nothing by default."""


class Backend(abc.ABC):
    """The process-wide backend: how many devices, and a driver for each."""

    name: str
    description: str
    poll_budget_us: float  # default fast-path polling budget of an await (see _notifier)
    spin_us: float = 0.0  # how long an await polls without yielding while few tasks run (see _notifier)

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def driver(self, ordinal: int) -> DeviceDriver: ...

    @abc.abstractmethod
    def new_waker(self) -> Waker:
        """A waker that lives for the rest of the process."""

    # -- collectives (NCCL on CUDA, emulated on the simulated device) -----------------
    @abc.abstractmethod
    def communicators(self, drivers: Sequence[DeviceDriver]) -> Any:
        """Communicators for collectives among ``drivers`` in this process (rank ``i`` is
        ``drivers[i]``)."""

    @abc.abstractmethod
    def process_communicator(self, driver: DeviceDriver, unique_id: bytes, nranks: int, rank: int, channel: Any = None) -> Any:
        """This process's communicator as ``rank`` of ``nranks`` processes that share
        ``unique_id`` (blocks until every rank has joined). ``channel``: the launcher's
        (trio_cuda._rendezvous), which the simulated device moves the data through; NCCL
        has networking of its own."""

    @abc.abstractmethod
    def unique_id(self) -> bytes:
        """A new id for process_communicator, to hand to every rank."""

    @abc.abstractmethod
    def collective(
        self, kind: str, comms: Any, calls: Sequence[CollectiveCall], dtype: np.dtype[Any], op: str, root: int
    ) -> None:
        """Enqueue one collective (``all_reduce``, ``broadcast``, ``all_gather``,
        ``reduce_scatter``), every call of this process on its stream, as one group."""

    @abc.abstractmethod
    def close_communicators(self, comms: Any) -> None:
        """Release communicators whose devices' contexts are live (the runtime drops, and
        never passes here, those of a device reset since they were made)."""
