"""Zero-copy export of tensors to other libraries: DLPack and the CUDA Array Interface.

``Tensor.__dlpack__`` / ``__dlpack_device__`` (the DLPack Python protocol) and, on CUDA,
``Tensor.__cuda_array_interface__`` (version 3) hand other libraries the tensor's memory
without a copy. The export honours the DLPack stream contract: the consumer's stream (an
int: 1 the legacy default stream, 2 the per-thread default stream, -1 no
synchronization, otherwise a ``cudaStream_t``) is made to wait for the tensor's pending
write. The CUDA Array Interface names the stream of the pending write instead (or none
when the data is ready), and consumers wait on it.

An export never blocks the trio loop: one that needs the host to wait for the pending
write (DLPack on the simulated device; the CUDA Array Interface, whose consumers may
synchronize the stream on the host) refuses in a trio task while the write is pending,
naming ``await t.ready()``; in a worker thread or plain code it waits, as before.

On the simulated device a tensor's memory is host memory, so DLPack exports it as a CPU
tensor (``numpy.from_dlpack(t)`` is a view of the simulated device's memory, taken after
the pending write completed); there is no CUDA Array Interface there.

The other direction, ``api.from_dlpack(obj)`` / ``api.asarray(obj)``, makes a tensor of
another library's array without a copy: on CUDA of a DLPack producer (PyTorch, CuPy) or
a ``__cuda_array_interface__`` one (numba), on the simulated device of a CPU DLPack
producer (numpy). The tensor's stream of first use is ordered after the producer's
pending work (DLPack: the producer makes the stream wait; the CUDA Array Interface: an
event on its ``stream``), the owner is kept alive while trio-cuda uses the memory, and
let go once the last view is dropped and trio-cuda's accesses are done. Arrays whose
elements are not aligned to their size are refused before anything is done.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from . import _loop
from ._checks import BFLOAT16
from ._guard import LOCK, check_not_forked, loop_hint
from ._notifier import wait_event
from ._op import extensions
from ._tensor import Tensor, c_strides

__all__ = ["from_dlpack"]

_KDL_CPU, _KDL_CUDA = 1, 2
_KINDS = {"i": 0, "u": 1, "f": 2, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLBool


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_EMPTY = np.zeros(1, np.uint8)
_alive: dict[int, Any] = {}  # address of a managed tensor -> what keeps its memory alive
_alive_lock = threading.Lock()


def _delete_managed(managed: Any) -> None:
    with _alive_lock:
        _alive.pop(ctypes.cast(managed, ctypes.c_void_p).value or 0, None)


_delete = _DELETER(_delete_managed)


# The capsule's destructor gets the dying capsule as a raw pointer: touching it as a Python
# object there would resurrect it, so the capsule functions take void pointers.
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
# the same two on a live capsule object
_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))
_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_USED = ctypes.c_char_p(b"used_dltensor")
_NAME = ctypes.c_char_p(b"dltensor")  # capsules keep a pointer to their name: it lives as long as the module


def _capsule_gone(capsule: int) -> None:
    # Never consumed (a consumer renames it "used_dltensor" and calls the deleter itself).
    if _PyCapsule_IsValid(capsule, b"dltensor"):
        ptr = _PyCapsule_GetPointer(capsule, b"dltensor")
        with _alive_lock:  # what the deleter would do, without calling through the struct
            _alive.pop(ptr, None)


_capsule_destructor = _CAPSULE_DESTRUCTOR(_capsule_gone)


def _backend(t: Tensor) -> str:
    return str(t.device._backend_name)


def dlpack_device(t: Tensor) -> tuple[int, int]:
    if _backend(t) == "cuda":
        return (_KDL_CUDA, t.device.ordinal)
    return (_KDL_CPU, 0)


def _dtype(t: Tensor) -> _DLDataType:
    dt = t.dtype
    if dt == BFLOAT16:
        return _DLDataType(4, 16, 1)  # kDLBfloat
    code = _KINDS.get(dt.kind)
    if code is None:
        raise BufferError(f"DLPack: dtype {dt} has no DLPack type")
    return _DLDataType(code, dt.itemsize * 8, 1)


def _pending_write(t: Tensor, what: str = "DLPack", unusable: type[Exception] = BufferError) -> Any:
    """The event of the tensor's pending write, or None (under the runtime lock).

    A tensor without memory (of a reset device, or of an op that did not run) raises
    ``unusable``: an export's BufferError, or the ValueError any op taking it raises.
    """
    buf = t._buffer
    if buf.generation != t.device.generation:
        check_not_forked()  # (a forked child's devices are stale too)
        raise unusable(f"{what}: the tensor was allocated before device {t.device.ordinal} was reset; its memory is gone")
    if buf.ptr is None:
        if buf.owner is None:
            raise unusable(
                f"{what}: the tensor belongs to a submission that was cancelled or failed before it ran "
                "(or to an op of it that did not run); it has no memory"
            )
        raise BufferError(f"{what}: the tensor's submission has not allocated it yet; await it first")
    w = buf.writer
    if w is None:
        return None
    stream, seq = w
    if seq <= stream.done_seq or stream.generation != stream.device.generation:
        return None
    return stream.event_at(seq)


def _refuse_on_loop_thread(t: Tensor, ev: Any, what: str) -> None:
    """Raise if ``ev`` (the tensor's pending write) is still pending and the caller is a
    trio or asyncio task: the export would have the host wait for it, and on the loop's
    thread that wait would stall every task of the loop for as long as the write takes."""
    if ev is None:
        return
    loop = _loop.loop_name()
    if loop is None or t.device.poll(ev):  # (a non-blocking look)
        return
    raise BufferError(
        f"{what} of a tensor with a pending write would block the {loop} event loop until the "
        f"write completes; wait for it first with 'await t.ready()' (or export from a worker "
        f"thread: {loop_hint(loop)})"
    )


async def ready(t: Tensor) -> None:
    """``Tensor.ready()``: wait in trio until the tensor's pending write has completed.

    The same checkpoint as ``await op``: a cancellation check first, then a wait on the
    write's event (or, with nothing pending, a cancel-shielded schedule point).
    """
    await _loop.checkpoint_if_cancelled()
    with LOCK:
        ev = _pending_write(t, "Tensor.ready()", ValueError)
    if ev is None:
        await _loop.cancel_shielded_checkpoint()
    else:
        await wait_event(ev)


def dlpack(t: Tensor, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
    if copy:
        raise BufferError("DLPack: trio-cuda exports without copying (copy=True is not supported)")
    if dl_device is not None and tuple(dl_device) != dlpack_device(t):
        raise BufferError(f"DLPack: the tensor is on {dlpack_device(t)}, not {tuple(dl_device)}")
    dev = t.device
    cuda = _backend(t) == "cuda"
    if not cuda and stream is not None:
        raise BufferError("DLPack: the simulated device exports CPU tensors; stream must be None")
    with LOCK:
        ev = _pending_write(t)
        if ev is not None and cuda and stream != -1:  # the consumer's stream waits for the write
            dev._driver.wait_event(dev._driver.foreign_stream(1 if stream is None else int(stream)), ev.handle)
    if ev is not None and not cuda:
        # The simulated device: the host reads the memory itself, so the write must be
        # over; in a trio task only if it is already (a thread or plain code waits).
        _refuse_on_loop_thread(t, ev, "DLPack export")
        dev.wait_blocking(ev)
    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * max(t.ndim, 1))(*t.shape)
    strides = (ctypes.c_int64 * max(t.ndim, 1))(*(s // t.dtype.itemsize for s in t.strides))
    if cuda:
        holder: tuple[Any, ...]
        data, holder = t.ptr, (t,)
    elif not t._buffer.nbytes:  # nothing to point at: any valid address will do
        data, holder = _EMPTY.ctypes.data, (t, _EMPTY)
    else:
        driver: Any = dev._driver
        host = driver._bytes(t._buffer.ptr, t._buffer.nbytes)  # the simulated device's memory
        data, holder = host.ctypes.data + t._offset, (t, host)
    managed.dl_tensor = _DLTensor(data, _DLDevice(*dlpack_device(t)), t.ndim, _dtype(t), shape, strides if t.ndim else None, 0)
    managed.deleter = _delete
    with _alive_lock:
        _alive[ctypes.addressof(managed)] = (managed, shape, strides, holder)
    return _PyCapsule_New(ctypes.addressof(managed), _NAME, _capsule_destructor)


def cuda_array_interface(t: Tensor) -> dict[str, Any]:
    if _backend(t) != "cuda":
        raise AttributeError("the simulated device's tensors have no CUDA Array Interface (use numpy.from_dlpack)")
    with LOCK:
        ev = _pending_write(t, "__cuda_array_interface__")
        stream = None
        if ev is not None:
            w = t._buffer.writer
            assert w is not None
            stream = int(w[0].handle) or None
    # A consumer of the interface may synchronize the named stream on the host (numba
    # does by default): not on the trio thread.
    _refuse_on_loop_thread(t, ev, "__cuda_array_interface__")
    return {
        "shape": t.shape,
        "typestr": t.dtype.str if t.dtype != BFLOAT16 else "<V2",
        "data": (t.ptr, False),
        "version": 3,
        "strides": None if t.is_contiguous else t.strides,
        "stream": stream,
    }


_FROM_DL = {(0, 8): np.int8, (0, 16): np.int16, (0, 32): np.int32, (0, 64): np.int64, (1, 8): np.uint8,
             (1, 16): np.uint16, (1, 32): np.uint32, (1, 64): np.uint64, (2, 16): np.float16, (2, 32): np.float32,
             (2, 64): np.float64, (6, 8): np.bool_}  # fmt: skip


def _layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """(lowest byte offset, bytes spanned) of a strided array (0-size: (0, 0))."""
    if 0 in shape:
        return 0, 0
    lo = sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st > 0) + itemsize
    return lo, hi - lo


def _check_aligned(what: str, address: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """Refuse memory whose elements are not aligned to their size: the kernels access
    whole elements (a misaligned one faults on CUDA, and the simulated device, which
    maps adopted memory at an aligned address of its own, would hide it); cuBLASLt is
    told the operands' alignment from their addresses. An empty array has no element."""
    size = dtype.itemsize
    if 0 in shape:
        return
    if address % size:
        raise ValueError(
            f"{what}: the array's data pointer {address:#x} is not aligned to its dtype "
            f"{dtype} ({size} bytes); trio-cuda needs each element aligned to its size"
        )
    if any(st % size for st in strides):
        raise ValueError(f"{what}: the array's byte strides {strides} are not multiples of its dtype's size ({size} bytes)")


def _adopt(
    dev: Any, data: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype[Any], owner: Any, release: Any
) -> Tensor:
    from ._memory import ForeignBuffer

    lo, nbytes = _layout(shape, strides, dtype.itemsize)
    driver = dev._driver
    ptr = driver.adopt(data + lo, nbytes, owner) if nbytes else 0

    def let_go() -> None:
        if nbytes:
            driver.release_adopted(ptr)
        release()

    buf = ForeignBuffer(dev, nbytes, ptr, let_go)
    return Tensor._new(buf, shape, dtype, -lo, strides)


def from_dlpack(obj: Any, *, device: Any = None) -> Tensor:
    """A tensor of another library's array, without a copy (see the module doc)."""
    from ._registry import as_device

    dev = as_device(device)
    if isinstance(obj, Tensor):
        if device is not None and obj.device is not dev:
            raise ValueError(f"from_dlpack: the tensor is on device {obj.device.ordinal}, not {dev.ordinal}; use api.dup")
        return obj
    cuda = dev._backend_name == "cuda"
    if not hasattr(obj, "__dlpack__"):
        if cuda and hasattr(obj, "__cuda_array_interface__"):
            return _from_cai(obj, dev)
        raise TypeError(f"from_dlpack: {type(obj).__name__} has no __dlpack__ (nor __cuda_array_interface__)")
    kind, dev_id = obj.__dlpack_device__()
    if cuda and (kind != _KDL_CUDA or dev_id != dev.ordinal):
        raise ValueError(f"from_dlpack: the array is on DLPack device {(kind, dev_id)}, not CUDA device {dev.ordinal}")
    if not cuda and kind != _KDL_CPU:
        raise ValueError("from_dlpack: the simulated device adopts CPU arrays (numpy); this one is not on the CPU")
    stream = None
    if cuda:
        stream = dev.policy.next_stream()
        with LOCK:
            dev._current_stream(stream)
        capsule = obj.__dlpack__(stream=int(stream.handle))  # the producer makes our stream wait
    else:
        capsule = obj.__dlpack__()
    ptr = _GetPointer(capsule, b"dltensor")
    if not ptr:
        raise BufferError("from_dlpack: not a DLPack capsule")
    managed = ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensor))
    dl = managed.contents.dl_tensor
    code, bits, lanes = dl.dtype.code, dl.dtype.bits, dl.dtype.lanes
    if lanes != 1 or ((code, bits) not in _FROM_DL and (code, bits) != (4, 16)):
        raise TypeError(f"from_dlpack: DLPack type (code {code}, {bits} bits, {lanes} lanes) is not supported")
    dtype = np.dtype(BFLOAT16) if (code, bits) == (4, 16) else np.dtype(_FROM_DL[(code, bits)])
    shape = tuple(int(dl.shape[i]) for i in range(dl.ndim))
    # Before the capsule is taken: refused, it stays the producer's (its destructor frees it).
    _check_aligned("from_dlpack", int(dl.data or 0) + int(dl.byte_offset), shape, (), dtype)
    if dl.strides:
        strides = tuple(int(dl.strides[i]) * dtype.itemsize for i in range(dl.ndim))
    else:
        strides = c_strides(shape, dtype.itemsize)
    _SetName(capsule, _USED)  # ours now: its deleter runs when trio-cuda lets the memory go
    deleter = managed.contents.deleter

    def release() -> None:
        if deleter:
            deleter(managed)

    # the owner: the producer itself too, so that memory a simulated stream thread still
    # touches after a reset stays alive through its views
    t = _adopt(dev, int(dl.data or 0) + int(dl.byte_offset), shape, strides, dtype, (obj, capsule), release)
    if stream is not None:
        with LOCK:
            t._buffer.writer = (stream, stream.mark())  # the producer's work is before this point
    return t


def _from_cai(obj: Any, dev: Any) -> Tensor:
    cai = obj.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = tuple(cai["strides"]) if cai.get("strides") else c_strides(shape, dtype.itemsize)
    _check_aligned("asarray", int(cai["data"][0] or 0), shape, strides, dtype)
    t = _adopt(dev, int(cai["data"][0]), shape, strides, dtype, obj, lambda: None)
    producer = cai.get("stream")
    if producer:
        stream = dev.policy.next_stream()
        with LOCK:
            dev._current_stream(stream)
            dev._driver.wait_foreign(stream.handle, dev._driver.foreign_stream(int(producer)))
            t._buffer.writer = (stream, stream.mark())
    return t


extensions.update(
    {"dlpack": dlpack, "dlpack_device": dlpack_device, "cuda_array_interface": cuda_array_interface, "ready": ready}
)
