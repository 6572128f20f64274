"""Tensor constructors and copies, as DeviceOps (re-exported as ``trio_cuda.api``).

Every function here validates what it can at once (bad input never reaches the
device) and returns a lazy op; what depends on other ops' outputs is validated when
the submission is planned, before anything of it is enqueued. Constructors default to
``float32``, the GPU's natural type, and to the current device of the submission.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, overload

import numpy as np

from ._checks import arg_type, check_dtype, check_shape, is_scalar, nbytes_of
from ._device import Device
from ._memory import Buffer
from ._op import DeviceOp, TensorMath, TensorValuedOp, _ext, _tensor_of
from ._plan import Lane, Plan, _StagingSlot
from ._registry import as_device
from ._tensor import Partition, Tensor, plan_read_to_host

__all__ = ["arange", "dup", "empty", "from_host", "full", "memcpy", "ones", "zeros"]


# -- steps (enqueue time) ---------------------------------------------------------------------
def _fill_step(lane: Lane, arg: tuple[Buffer, bytes]) -> None:
    buf, pattern = arg
    assert buf.ptr is not None
    lane.write(buf)
    lane.device._driver.fill(buf.ptr, buf.nbytes, pattern, lane.stream.handle)
    lane.wrote(buf, lane.end())
    lane.device._stats.copies += 1


def _h2d_step(lane: Lane, arg: tuple[Tensor, Any, _StagingSlot]) -> None:
    """Copy host data (snapshotted now, at submission) into ``t`` through staging memory."""
    t, host, slot = arg
    st = slot.staging
    assert st is not None
    data = host() if callable(host) else host
    nbytes = slot.nbytes
    st.buf[:nbytes] = np.ascontiguousarray(data, dtype=t.dtype).reshape(-1).view(np.uint8)
    buf = t._buffer
    tracked = t._tracked
    lane.write(buf, tracked)
    lane.device._driver.copy_h2d(t.ptr, st.buf[:nbytes], lane.stream.handle)
    lane.keep(st)
    lane.wrote(buf, lane.end(), tracked)
    lane.device._stats.copies += 1


def _plan_h2d(plan: Plan, lane: Lane, t: Tensor, host: Any) -> None:
    if t.nbytes:
        slot = plan.need_staging(lane, t.nbytes, False)
        plan.step(lane, _h2d_step, (t, host, slot))


# -- constructors ----------------------------------------------------------------------------------
class _Alloc(TensorValuedOp[Tensor]):
    __slots__ = ("_device", "_dtype", "_host", "_nbytes", "_pattern", "_shape")

    def __init__(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], pattern: bytes | None, host: Any, device: Device | None
    ) -> None:
        super().__init__()
        self._shape = shape
        self._dtype = dtype
        self._nbytes = nbytes_of(shape, dtype)
        self._pattern = pattern
        self._host = host
        self._device = device

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Tensor:
        ln = lane.on(self._device) if self._device is not None else lane
        buf = plan.new_buffer(ln, self._nbytes, f"allocating a {self._dtype} tensor of shape {self._shape}")
        t = Tensor._new(buf, self._shape, self._dtype)
        if self._nbytes:
            if self._pattern is not None:
                plan.step(ln, _fill_step, (buf, self._pattern))
            elif self._host is not None:
                _plan_h2d(plan, ln, t, self._host)
        return t


def _fill_pattern(value: np.ndarray) -> bytes | None:
    """The repeating byte pattern of a 0-d array, if a device fill can write it."""
    raw = value.tobytes()
    if raw == raw[:1] * len(raw):
        return raw[:1]
    if len(raw) in (2, 4, 8):
        return raw
    return None  # e.g. complex128: filled from the host


def _fill_value(fill: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """``fill`` as an array of ``dtype`` that broadcasts to ``shape`` (numpy's rules), or raise."""
    if fill is None:
        raise TypeError("full() needs a fill value, not None")
    if isinstance(fill, (Tensor, Partition, DeviceOp)):
        raise TypeError("full() takes a host scalar or array as fill value; copy device data with api.memcpy()")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", np.exceptions.ComplexWarning)
            warnings.simplefilter("error", RuntimeWarning)
            if isinstance(fill, int) and not isinstance(fill, bool) and dtype.kind in "iu":
                info = np.iinfo(dtype)
                if not info.min <= fill <= info.max:
                    raise OverflowError(f"out of range of {dtype}")
            arr = np.asarray(fill)
            if arr.dtype == object:
                raise TypeError(f"not a number: {fill!r}")
            cast = arr.astype(dtype, casting="unsafe")
    except (TypeError, ValueError, OverflowError, np.exceptions.ComplexWarning, RuntimeWarning) as err:
        raise ValueError(f"cannot fill a {dtype} tensor with {fill!r}: {err}") from None
    if dtype.kind in "iu" and arr.dtype.kind in "iu" and arr.size:
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"cannot fill a {dtype} tensor with {fill!r}: out of range of {dtype}")
    try:
        np.broadcast_shapes(cast.shape, shape)
    except ValueError:
        raise ValueError(f"fill value of shape {cast.shape} does not broadcast to the tensor shape {shape}") from None
    if np.broadcast_shapes(cast.shape, shape) != shape:
        raise ValueError(f"fill value of shape {cast.shape} does not broadcast to the tensor shape {shape}")
    return cast


def _explicit_device(device: Device | int | None) -> Device | None:
    """The device asked for, or None: the op then runs on its submission's device."""
    return as_device(device) if device is not None else None


def _constructor(shape: Any, dtype: Any, fill: Any, device: Device | int | None) -> TensorValuedOp[Tensor]:
    shp = check_shape(shape)
    dt = check_dtype(dtype)
    nbytes_of(shp, dt)
    dev = _explicit_device(device)
    value = _fill_value(fill, shp, dt)
    if value.ndim == 0:
        pattern = _fill_pattern(value)
        if pattern is not None:
            return _Alloc(shp, dt, pattern, None, dev)
    return _Alloc(shp, dt, None, lambda: np.broadcast_to(value, shp), dev)


def empty(shape: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> TensorValuedOp[Tensor]:
    """A new uninitialized tensor."""
    shp = check_shape(shape)
    dt = check_dtype(dtype)
    return _Alloc(shp, dt, None, None, _explicit_device(device))


def zeros(shape: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> TensorValuedOp[Tensor]:
    """A new tensor of zeros."""
    return _constructor(shape, dtype, 0, device)


def ones(shape: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> TensorValuedOp[Tensor]:
    """A new tensor of ones."""
    return _constructor(shape, dtype, 1, device)


def full(shape: Any, fill_value: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> TensorValuedOp[Tensor]:
    """A new tensor filled with ``fill_value``: a scalar, or an array that broadcasts to
    ``shape`` (numpy's rules, as ``numpy.full``); None is refused."""
    return _constructor(shape, dtype, fill_value, device)


def arange(
    start: Any, stop: Any = None, step: Any = 1, dtype: Any = np.float32, *, device: Device | int | None = None
) -> TensorValuedOp[Tensor]:
    """A new 1-D tensor of evenly spaced values, as ``numpy.arange`` (default dtype float32)."""
    dt = check_dtype(dtype)
    if stop is None:
        start, stop = 0, start
    for name, v in (("start", start), ("stop", stop), ("step", step)):
        if not is_scalar(v) or isinstance(v, (complex, np.complexfloating)):
            raise TypeError(f"arange() {name} must be a real number, not {v!r}")
    if step == 0:
        raise ValueError("arange() step must not be zero")
    if not all(math.isfinite(float(v)) for v in (start, stop, step)):
        raise ValueError(f"arange() needs finite start, stop and step, got {start!r}, {stop!r}, {step!r}")
    n = max(0, math.ceil((float(stop) - float(start)) / float(step)))
    nbytes_of((n,), dt)
    try:
        probe = np.arange(start, start + 2 * step, step, dtype=dt)  # refuses what numpy refuses
    except (TypeError, ValueError) as err:
        raise TypeError(f"arange() cannot make {dt} values: {err}") from None
    del probe
    # The host values are made when the op enqueues, after its allocation succeeded.
    return _Alloc((n,), dt, None, lambda: np.arange(start, stop, step, dtype=dt)[:n], _explicit_device(device))


def from_host(array: Any, *, device: Device | int | None = None) -> TensorValuedOp[Tensor]:
    """A new tensor holding a copy of a numpy array (read when the op is submitted), or
    of anything ``np.asarray`` takes (a list, a scalar: converted at once, with numpy's
    dtypes: Python floats give float64)."""
    if not isinstance(array, np.ndarray):
        given = array
        if isinstance(array, DeviceOp) and not isinstance(array, TensorMath):
            raise TypeError(f"from_host() takes host data, not {arg_type(array)} (an op: await it first, and upload its value)")
        if isinstance(array, (TensorMath, Partition)):
            raise TypeError(
                f"from_host() takes host data, not {arg_type(array)} (already on the device: use it as it is, or ops.copy)"
            )
        # another library's device array is adopted, not copied through the host
        kind = type(array)  # (the type's attributes: a property is not evaluated)
        if hasattr(kind, "__cuda_array_interface__") or (
            hasattr(kind, "__dlpack__") and not hasattr(kind, "__array__") and not hasattr(kind, "__array_interface__")
        ):
            raise TypeError(f"from_host() needs host data, got {arg_type(array)}")
        try:
            array = np.asarray(array)
        except (TypeError, ValueError) as err:
            raise TypeError(f"from_host() needs a numpy array or what np.asarray takes, got {arg_type(given)} ({err})") from None
        if array.dtype == object:
            raise TypeError(f"from_host() needs a numpy array or numbers np.asarray makes one of, got {arg_type(given)}")
    dt = check_dtype(array.dtype)
    return _Alloc(array.shape, dt, None, array, _explicit_device(device))


# -- copies -------------------------------------------------------------------------------------------
def _check_same(
    dst_shape: tuple[int, ...], dst_dtype: np.dtype[Any], src_shape: tuple[int, ...], src_dtype: np.dtype[Any]
) -> None:
    if dst_dtype != src_dtype:
        raise TypeError(f"memcpy() dtype mismatch: destination {dst_dtype}, source {src_dtype}")
    if dst_shape != src_shape:
        raise ValueError(f"memcpy() shape mismatch: destination {dst_shape}, source {src_shape}")


def _as_copy_end(x: Any, what: str) -> Any:
    if isinstance(x, Partition):
        return x.tensor
    if isinstance(x, (Tensor, DeviceOp)):
        return x
    if isinstance(x, np.ndarray):
        check_dtype(x.dtype)
        return x
    raise TypeError(f"memcpy() {what} must be a Tensor, a numpy array or a DeviceOp, got {arg_type(x)}")


def _check_host_dst(dst: np.ndarray) -> None:
    if not (dst.flags.c_contiguous and dst.flags.writeable):
        raise ValueError("memcpy() into a host array needs a writable C-contiguous array")


def _d2d_step(lane: Lane, arg: tuple[Tensor, Tensor]) -> None:
    dst, src = arg
    dbuf, sbuf = dst._buffer, src._buffer
    lane.read(sbuf, src._tracked)
    lane.write(dbuf, dst._tracked)
    if dst.nbytes:
        drv = lane.device._driver
        if src.device is dst.device:
            drv.copy_d2d(dst.ptr, src.ptr, dst.nbytes, lane.stream.handle)
        else:
            lane.device._cross_device = True  # see Device.poll
            drv.copy_peer(dst.ptr, src.device._driver, src.ptr, dst.nbytes, lane.stream.handle)
        lane.device._stats.copies += 1
    seq = lane.end()
    lane.wrote(dbuf, seq, dst._tracked)
    lane.was_read(sbuf, seq, src._tracked)


def _plan_copy(plan: Plan, lane: Lane, dst: Any, src: Any) -> Any:
    """Plan ``dst <- src`` (tensors or host arrays, shapes and dtypes checked)."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        raise TypeError("memcpy() between two host arrays: use numpy")
    _check_same(dst.shape, dst.dtype, src.shape, src.dtype)
    if isinstance(dst, np.ndarray):
        _check_host_dst(dst)
        return plan_read_to_host(plan, lane, src, dst)
    plan.use(dst._buffer, dst)
    ln = lane.on(dst.device)
    if isinstance(src, np.ndarray):
        if dst.is_contiguous:
            _plan_h2d(plan, ln, dst, src)
        else:  # into a view: through contiguous device memory, then a copy kernel
            tmp = _new_tensor(plan, ln, dst.shape, dst.dtype, "memcpy() into a view")
            _plan_h2d(plan, ln, tmp, src)
            _ext("copy_into")(plan, ln, dst, tmp, "memcpy")
        return dst
    plan.use(src._buffer, src)
    if src.device is dst.device and not (src.is_contiguous and dst.is_contiguous):
        _ext("copy_into")(plan, ln, dst, src, "memcpy")  # strided views: a copy kernel
        return dst
    if src.device is not dst.device:
        src = _ext("contiguous")(plan, lane, src)
        plan.read_from(src.device, src._buffer.generation)
        if not dst.is_contiguous:
            tmp = _new_tensor(plan, ln, dst.shape, dst.dtype, "memcpy() into a view")
            plan.step(ln, _d2d_step, (tmp, src))
            _ext("copy_into")(plan, ln, dst, tmp, "memcpy")
            return dst
    plan.step(ln, _d2d_step, (dst, src))
    return dst


def _new_tensor(plan: Plan, lane: Lane, shape: tuple[int, ...], dtype: np.dtype[Any], what: str) -> Tensor:
    return Tensor._new(plan.new_buffer(lane, nbytes_of(shape, dtype), what), shape, dtype)


class _Memcpy(DeviceOp[Any]):
    __slots__ = ("_dst", "_src")

    def __init__(self, dst: Any, src: Any) -> None:
        ops = tuple(x for x in (dst, src) if isinstance(x, DeviceOp))
        super().__init__(ops)
        self._dst = dst
        self._src = src

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Any:
        it = iter(args)
        dst = next(it) if isinstance(self._dst, DeviceOp) else self._dst
        src = next(it) if isinstance(self._src, DeviceOp) else self._src
        return _plan_copy(plan, lane, _as_copy_end(dst, "destination"), _as_copy_end(src, "source"))


class _MemcpyToDevice(_Memcpy, TensorValuedOp[Any]):
    __slots__ = ()


@overload
def memcpy(dst: np.ndarray, src: Any) -> DeviceOp[np.ndarray]: ...
@overload
def memcpy(dst: Any, src: Any) -> TensorValuedOp[Any]: ...
def memcpy(dst: Any, src: Any) -> DeviceOp[Any]:
    """Copy ``src`` into ``dst``; the output is ``dst``.

    Either end may be a tensor (or partition), a numpy array (host), or an op
    producing a tensor; shapes and dtypes must match exactly. A host source is read
    when the op is submitted; a host destination is written when the op completes.
    """
    dst = _as_copy_end(dst, "destination")
    src = _as_copy_end(src, "source")
    if not isinstance(dst, DeviceOp) and not isinstance(src, DeviceOp):
        if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
            raise TypeError("memcpy() between two host arrays: use numpy")
        _check_same(dst.shape, dst.dtype, src.shape, src.dtype)
        if isinstance(dst, np.ndarray):
            _check_host_dst(dst)
    if isinstance(dst, np.ndarray):
        return _Memcpy(dst, src)  # (its output is the host array: no tensor methods)
    return _MemcpyToDevice(dst, src)


class _Dup(TensorValuedOp[Tensor]):
    __slots__ = ("_device", "_src")

    def __init__(self, src: Any, device: Device | None) -> None:
        super().__init__((src,) if isinstance(src, DeviceOp) else ())
        self._src = src
        self._device = device

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Tensor:
        src = _tensor_of(args[0] if args else self._src, "dup()")
        plan.use(src._buffer, src)
        target = self._device or src.device
        if not src.is_contiguous:  # a view: gathered by a copy kernel on its device
            c = _ext("contiguous")(plan, lane, src)
            if target is src.device:
                return c  # type: ignore[no-any-return]
            src = c
        if target is not src.device:
            plan.read_from(src.device, src._buffer.generation)
        ln = lane.on(target)
        t = Tensor._new(
            plan.new_buffer(ln, src.nbytes, f"copying a {src.dtype} tensor of shape {src.shape}"), src.shape, src.dtype
        )
        plan.step(ln, _d2d_step, (t, src))
        return t


def dup(tensor: Any, *, device: Device | int | None = None) -> TensorValuedOp[Tensor]:
    """A copy of ``tensor`` (a tensor, partition or op producing one) on ``device`` (default: its own)."""
    if not isinstance(tensor, (Tensor, Partition, DeviceOp)):
        raise TypeError(f"dup() needs a Tensor or a DeviceOp, got {arg_type(tensor)}")
    return _Dup(tensor, _explicit_device(device))
