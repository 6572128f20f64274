"""The CUDA backend's driver results: every ``CUresult`` goes through :func:`check`, which
turns a bad one into the project's errors; sticky errors (illegal address, ...) mark the
device faulted, because after them its context is unusable."""

from __future__ import annotations

from typing import Any, Protocol

from cuda.bindings import driver as cu

from .._errors import DeviceError, DeviceFault, DeviceOutOfMemory, GraphCaptureError, LaunchError, fresh

__all__ = ["NOT_READY", "STICKY", "SUCCESS", "Faults", "check", "error", "result_code"]


class Faults(Protocol):
    """The device an error is about: it keeps the first fault (later calls see it)."""

    ordinal: int

    def set_fault(self, fault: DeviceFault) -> None: ...

    def fault(self) -> BaseException | None: ...


R = cu.CUresult
SUCCESS = R.CUDA_SUCCESS
NOT_READY = int(R.CUDA_ERROR_NOT_READY)  # compared with result codes as ints

# Errors after which the context is unusable: asynchronous device faults.
STICKY = {
    getattr(R, n)
    for n in (
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_TENSOR_MEMORY_LEAK",
    )
    if hasattr(R, n)
}
_CAPTURE = {getattr(R, n) for n in dir(R) if n.startswith(("CUDA_ERROR_STREAM_CAPTURE", "CUDA_ERROR_CAPTURED_EVENT"))}


def _name(err: Any) -> str:
    try:
        e, s = cu.cuGetErrorName(err)
        return s.decode() if e == SUCCESS else str(err)
    except Exception:
        return str(err)


def check(result: Any, what: str, device: Faults | None = None, *, launch: bool = False, op: str | None = None) -> Any:
    """Unpack a cuda.bindings result tuple; raise the project's error for a bad CUresult."""
    err = result[0]
    if err == SUCCESS:
        n = len(result)
        return None if n == 1 else result[1] if n == 2 else result[1:]
    raise error(err, what, device, launch=launch, op=op)


def error(err: Any, what: str, device: Faults | None, *, launch: bool = False, op: str | None = None) -> DeviceError:
    """The project's error for a bad CUresult (sticky errors also fault the device)."""
    ordinal = device.ordinal if device is not None else None
    msg = f"{what} failed: {_name(err)}"
    if err == R.CUDA_ERROR_OUT_OF_MEMORY:
        return DeviceOutOfMemory(msg, device=ordinal, op=op)
    if err in STICKY:
        fault = DeviceFault(msg, device=ordinal, op=op)
        if device is not None:
            device.set_fault(fault)
            first = device.fault()
            return fresh(first) if isinstance(first, DeviceFault) else fault  # type: ignore[return-value]
        return fault
    if err in _CAPTURE:
        return GraphCaptureError(msg, device=ordinal, op=op)
    if launch:
        return LaunchError(msg, device=ordinal, op=op)
    return DeviceError(msg, device=ordinal, op=op)


def result_code(err: int) -> Any:
    """A driver result code as cuda.bindings' CUresult (as is when this cuda-bindings
    does not know it, so the error still names the code)."""
    try:
        return R(err)
    except ValueError:
        return err
