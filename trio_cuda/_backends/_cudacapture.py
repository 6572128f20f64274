"""A library's call (a cuBLASLt GEMM) captured once into a CUDA graph and kept
instantiated, so that repeating it on the same memory is one graph launch: less host
time than the library's own call.

While a capture runs (once per key, under the runtime lock), a device- or context-wide
synchronize by another library in another thread fails (CUDA forbids it during any
capture in the context); see docs/ops.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from cuda.bindings import driver as cu

from ._cudaerrors import STICKY, SUCCESS, Faults, error

__all__ = ["ReplayCache", "capture_call"]


class ReplayCache(Protocol):
    """Where the captured calls are kept (trio_cuda._backends._cublaslt.Gemms)."""

    capture_stream: Any

    def keep(self, key: tuple[Any, ...], graph: tuple[int, Any], destroy: Any) -> tuple[int, Any]: ...

    def refuse(self, key: tuple[Any, ...]) -> None: ...


def capture_call(
    cache: ReplayCache, key: tuple[Any, ...], run: Callable[[int], None], device: Faults, what: str, op: str
) -> tuple[int, Any] | None:
    """Capture ``run(stream)`` on the cache's capture stream and keep it under ``key``:
    the instantiated graph (its handle as an int, and the handle), or None, and never
    again for this key, if the call cannot be captured (the caller then makes the call
    itself, which raises the library's error if it has one). A sticky error on the way
    faults the device and is raised."""
    cs = cache.capture_stream
    if cs is None:
        err, cs = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        if err != SUCCESS:
            _refuse(cache, key, device, what, op, err, "cuStreamCreate")
            return None
        cache.capture_stream = cs
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    err = cu.cuStreamBeginCapture(cs, mode)[0]
    if err != SUCCESS:
        _refuse(cache, key, device, what, op, err, "cuStreamBeginCapture")
        return None
    graph = exec_ = None
    try:
        ran = False
        try:
            run(int(cs))
            ran = True
        except Exception:  # refused: the caller's own call says why
            pass
        err, graph = cu.cuStreamEndCapture(cs)
        if err != SUCCESS:
            graph = None
            _refuse(cache, key, device, what, op, err, "cuStreamEndCapture")
            return None
        if not ran:
            _refuse(cache, key, device, what, op, SUCCESS, "the library's call")
            return None
        err, exec_ = cu.cuGraphInstantiate(graph, 0)
        if err != SUCCESS:
            exec_ = None
            _refuse(cache, key, device, what, op, err, "cuGraphInstantiate")
            return None
        kept: tuple[int, Any] = cache.keep(key, (int(exec_), exec_), cu.cuGraphExecDestroy)
        exec_ = None  # the cache's now
        return kept
    finally:
        # Whatever happened (a KeyboardInterrupt anywhere above too): the stream does
        # not stay capturing, and nothing made here is left undestroyed.
        err, status = cu.cuStreamIsCapturing(cs)
        if err == SUCCESS and status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            err, left = cu.cuStreamEndCapture(cs)
            if err == SUCCESS and left is not None and int(left):
                cu.cuGraphDestroy(left)
        if graph is not None:
            cu.cuGraphDestroy(graph)
        if exec_ is not None:
            cu.cuGraphExecDestroy(exec_)


def _refuse(cache: ReplayCache, key: tuple[Any, ...], device: Faults, what: str, op: str, err: Any, step: str) -> None:
    """A capture step failed with ``err``: a sticky error faults the device and is
    raised; anything else refuses the key (the library makes its calls)."""
    if err != SUCCESS and err in STICKY:
        raise error(err, f"{step} (capturing {what})", device, launch=True, op=op)
    cache.refuse(key)
