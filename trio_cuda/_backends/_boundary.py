"""The backend boundary: the only interface through which the runtime talks to a device.

Two backends implement it: :mod:`._cuda` (the CUDA driver through ``cuda.bindings``)
and :mod:`._sim` (a simulated device that runs anywhere). Everything above this
module (ops, combinators, scheduling, dependency tracking, cancellation, the
notifier) is backend-free.

The interface is deliberately small and driver-shaped: opaque stream and event
handles, integer device pointers, numpy arrays for host memory. Handles are
whatever the backend likes; the runtime never looks inside them.

Errors: a backend raises :class:`~trio_cuda.LaunchError` when it refuses to enqueue
work, :class:`~trio_cuda.DeviceOutOfMemory` when an allocation fails and
:class:`~trio_cuda.DeviceFault` from ``query``/``synchronize`` (and every later call)
once the device has faulted asynchronously.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["ArrayArg", "Backend", "DeviceDriver", "KernelSource", "Waker"]


class ArrayArg:
    """A device array passed to a kernel: where it lives and how it is laid out.

    Strides are in bytes, as numpy and numba count them. Tensors cache their
    ArrayArgs, so per-argument work done here is done once per tensor.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "writable", "_params")

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype, writable: bool) -> None:
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.writable = writable
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
        return f"ArrayArg(ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype}, writable={self.writable})"


class KernelSource(abc.ABC):
    """What a backend needs to build a kernel: the Python function and launch hints."""

    name: str
    py_func: Callable[..., Any]
    host_impl: Callable[..., Any] | None  # simulated device: run this instead of the simulator


class Waker(abc.ABC):
    """A counting wake-up that a helper thread blocks on without holding the GIL."""

    @abc.abstractmethod
    def wait(self, timeout: float | None) -> bool:
        """Block until posted at least once or ``timeout`` seconds pass; True if posted."""

    @abc.abstractmethod
    def post(self) -> None:
        """Wake one ``wait``."""


class DeviceDriver(abc.ABC):
    """One device as the driver sees it. All methods may be called from any thread."""

    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int

    # -- streams and events -------------------------------------------------
    @abc.abstractmethod
    def create_stream(self) -> Any: ...

    @abc.abstractmethod
    def create_event(self) -> Any: ...

    @abc.abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``: it completes when the work enqueued so far does."""

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make future work on ``stream`` wait until ``event`` (possibly of another device) completes."""

    @abc.abstractmethod
    def query(self, event: Any) -> bool:
        """True when ``event`` has completed. Raises DeviceFault if the device faulted."""

    @abc.abstractmethod
    def synchronize(self, event: Any) -> None:
        """Block the calling thread (without the GIL) until ``event`` completes."""

    @abc.abstractmethod
    def arm(self, event: Any, stream: Any, waker: Waker) -> None:
        """Post ``waker`` once ``event`` (last recorded on ``stream``) completes."""

    # -- memory ---------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, nbytes: int, stream: Any) -> int:
        """Stream-ordered allocation of ``nbytes`` (> 0); returns a device pointer."""

    @abc.abstractmethod
    def free(self, ptr: int, stream: Any) -> None:
        """Stream-ordered free: the memory is reusable once ``stream`` reaches this point."""

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Host memory that copies can use asynchronously (pinned on CUDA); a uint8 array."""

    @abc.abstractmethod
    def host_free(self, buf: np.ndarray) -> None: ...

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
    def copy_peer(self, dst: int, src_driver: "DeviceDriver", src: int, nbytes: int, stream: Any) -> None:
        """Copy from another device's memory into this device's memory."""

    @abc.abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) as the device reports them."""

    # -- kernels --------------------------------------------------------------
    @abc.abstractmethod
    def prepare_launch(
        self,
        source: KernelSource,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[ArrayArg | int | float | bool | np.generic],
    ) -> Any:
        """Everything a launch needs but the stream: the loaded kernel and its packed
        parameters. The runtime caches the result per (kernel, arguments), so a hot
        launch is one driver call. Raises LaunchError for an invalid configuration."""

    @abc.abstractmethod
    def launch(self, prepared: Any, stream: Any) -> None:
        """Enqueue a prepared launch. Raises LaunchError if the launch is refused."""

    # -- graphs ---------------------------------------------------------------
    @abc.abstractmethod
    def begin_capture(self, stream: Any) -> None: ...

    @abc.abstractmethod
    def end_capture(self, stream: Any) -> Any:
        """End the capture and return an instantiated, launchable graph."""

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
        """Discard all state of the device (memory, streams, events, fault)."""


class Backend(abc.ABC):
    """The process-wide backend: how many devices, and a driver for each."""

    name: str
    description: str
    poll_budget_us: float  # default fast-path polling budget of an await (see _notifier)

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def driver(self, ordinal: int) -> DeviceDriver: ...

    @abc.abstractmethod
    def new_waker(self) -> Waker: ...
