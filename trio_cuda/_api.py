"""Tensor constructors and copies, as DeviceOps (re-exported as ``trio_cuda.api``).

Every function here validates its arguments at once (bad input never reaches the
device) and returns a lazy op. Constructors default to ``float32``, the GPU's
natural type, and to the current device of the submission.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._device import Device, _as_device
from ._errors import GraphCaptureError
from ._execution import LOCK, Lane, Pending
from ._op import DeviceOp, _tensor_of
from ._tensor import Buffer, Partition, Tensor, check_dtype, check_shape

__all__ = ["arange", "dup", "empty", "from_host", "full", "memcpy", "ones", "zeros"]


class _Staging:
    """Host staging memory for one copy, returned to the device's pool after its last holder.

    A host-to-device copy has one holder (the stream, until the copy completes); a
    device-to-host copy has two (the stream, and the pending host value that copies
    the data out), so the buffer is recycled only when both are done with it.
    """

    __slots__ = ("device", "buf", "size", "holds", "generation")

    def __init__(self, device: Device, nbytes: int, holds: int) -> None:
        size = 1 << max(12, (nbytes - 1).bit_length())
        if not device._staging_pool:
            _prefill(device)
        pool = device._staging_pool[size]
        if not pool:
            # Staging buffers come back when their stream is seen past the copy; look at
            # every stream of the device before pinning more memory (which would stall).
            for s in list(device._streams):
                if s._keep and s._generation == device._generation:
                    s.retire()
        self.device = device
        self.buf = pool.pop() if pool else device._driver.host_alloc(size)
        self.size = size
        self.holds = holds
        self.generation = device._generation

    def release(self) -> None:
        with LOCK:
            self.holds -= 1
            if self.holds == 0 and self.buf is not None:
                # Host memory pinned before a device reset went away with the context.
                if self.generation == self.device._generation:
                    self.device._staging_pool[self.size].append(self.buf)
                self.buf = None  # type: ignore[assignment]


# Pinned host allocation (cuMemHostAlloc) waits for the device to be idle: allocated in
# the middle of a submission it would stall the trio loop behind running kernels (seen on
# an H200: a 20 ms read-back waited for a 300 ms kernel on another stream). So the first
# staging request of a device allocates a set of buffers at once (about 9 MiB pinned);
# only larger or more numerous concurrent copies allocate later.
_PREFILL = ((1 << 12, 32), (1 << 16, 8), (1 << 20, 4), (1 << 22, 1))


def _prefill(device: Device) -> None:
    pool = device._staging_pool
    for size, count in _PREFILL:
        pool[size].extend(device._driver.host_alloc(size) for _ in range(count))


class _HostResult(Pending):
    """The pending numpy array of a device-to-host copy."""

    __slots__ = ("_staging",)

    def __init__(self, staging: _Staging, out: np.ndarray, nbytes: int) -> None:
        def copy_out() -> np.ndarray:
            out.reshape(-1).view(np.uint8)[:] = staging.buf[:nbytes]
            staging.release()
            self._staging = None
            return out

        super().__init__(copy_out)
        self._staging: _Staging | None = staging

    def __del__(self) -> None:
        st = self._staging
        if st is not None:  # never resolved (cancelled): give up the host hold
            st.release()


def _no_capture(lane: Lane, what: str) -> None:
    if lane.capture is not None:
        raise GraphCaptureError(
            f"{what} inside a graph capture: allocate tensors before capturing and capture "
            "only kernel launches and copies into them",
            device=lane.device.ordinal,
        )


def _new_tensor(lane: Lane, shape: tuple[int, ...], dtype: np.dtype, device: Device | None) -> tuple[Lane, Tensor]:
    dev = device or lane.device
    ln = lane.on(dev)
    _no_capture(ln, "allocating a tensor")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    ptr = dev._alloc(nbytes, ln.stream, f"allocating a {dtype} tensor of shape {shape}") if nbytes else 0
    return ln, Tensor._new(Buffer(dev, ptr, nbytes), shape, dtype)


def _h2d(ln: Lane, dst_ptr: int, data: np.ndarray) -> None:
    """Copy host ``data`` (snapshotted now) to ``dst_ptr`` through staging memory."""
    dev = ln.device
    nbytes = data.nbytes
    if not nbytes:
        return
    st = _Staging(dev, nbytes, 1)
    st.buf[:nbytes] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    dev._driver.copy_h2d(dst_ptr, st.buf[:nbytes], ln.stream.handle)
    ln.keep(st)
    dev._stats.copies += 1


class _Alloc(DeviceOp[Tensor]):
    __slots__ = ("_shape", "_dtype", "_pattern", "_host", "_device")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, pattern: bytes | None, host: np.ndarray | None, device: Device | None) -> None:
        super().__init__()
        self._shape = shape
        self._dtype = dtype
        self._pattern = pattern
        self._host = host
        self._device = device

    def _run(self, lane: Lane, args: Any) -> Tensor:
        ln, t = _new_tensor(lane, self._shape, self._dtype, self._device)
        buf = t._buffer
        s = ln.stream
        if buf.nbytes:
            if self._pattern is not None:
                ln.device._driver.fill(buf.ptr, buf.nbytes, self._pattern, s.handle)
                ln.device._stats.copies += 1
            elif self._host is not None:
                _h2d(ln, buf.ptr, self._host)
        # Even an uninitialized tensor is "written" by its stream-ordered allocation.
        ln.wrote(buf, ln.end())
        return t


def _fill_pattern(value: Any, dtype: np.dtype) -> bytes | None:
    raw = np.array(value, dtype=dtype).tobytes()
    if raw == raw[:1] * len(raw):
        return raw[:1]
    if len(raw) in (2, 4, 8):
        return raw
    return None  # e.g. complex128: fill from the host


def _explicit_device(device: Device | int | None) -> Device | None:
    """The device asked for, or None: the op then runs on its submission's device."""
    return _as_device(device) if device is not None else None


def _constructor(shape: Any, dtype: Any, value: Any, device: Device | int | None) -> DeviceOp[Tensor]:
    shp = check_shape(shape)
    dt = check_dtype(dtype)
    dev = _explicit_device(device)
    if value is None:
        return _Alloc(shp, dt, None, None, dev)
    try:
        pattern = _fill_pattern(value, dt)
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(f"cannot fill a {dt} tensor with {value!r}") from err
    if pattern is None:
        return _Alloc(shp, dt, None, np.full(shp, value, dtype=dt), dev)
    return _Alloc(shp, dt, pattern, None, dev)


def empty(shape: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> DeviceOp[Tensor]:
    """A new uninitialized tensor."""
    return _constructor(shape, dtype, None, device)


def zeros(shape: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> DeviceOp[Tensor]:
    """A new tensor of zeros."""
    return _constructor(shape, dtype, 0, device)


def ones(shape: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> DeviceOp[Tensor]:
    """A new tensor of ones."""
    return _constructor(shape, dtype, 1, device)


def full(shape: Any, fill_value: Any, dtype: Any = np.float32, *, device: Device | int | None = None) -> DeviceOp[Tensor]:
    """A new tensor filled with ``fill_value``."""
    return _constructor(shape, dtype, fill_value, device)


def arange(start: Any, stop: Any = None, step: Any = 1, dtype: Any = np.float32, *, device: Device | int | None = None) -> DeviceOp[Tensor]:
    """A new 1-D tensor of evenly spaced values, as ``numpy.arange`` (default dtype float32)."""
    dt = check_dtype(dtype)
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise ValueError("arange() step must not be zero")
    host = np.arange(start, stop, step, dtype=dt)
    return _Alloc(host.shape, dt, None, host, _explicit_device(device))


def from_host(array: Any, *, device: Device | int | None = None) -> DeviceOp[Tensor]:
    """A new tensor holding a copy of a numpy array (taken when the op is submitted)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_host() needs a numpy array, got {type(array).__name__}")
    dt = check_dtype(array.dtype)
    return _Alloc(array.shape, dt, None, array, _explicit_device(device))


class _ToHost(DeviceOp[np.ndarray]):
    __slots__ = ()

    def __init__(self, src: DeviceOp[Any]) -> None:
        super().__init__((src,))

    def _run(self, lane: Lane, args: Any) -> Pending:
        t = _tensor_of(args[0], "to_host()")
        return _d2h(lane, t, np.empty(t.shape, dtype=t.dtype))


def _d2h(lane: Lane, t: Tensor, out: np.ndarray) -> Pending:
    t._check_live()
    ln = lane.on(t.device)
    _no_capture(ln, "copying to host memory")
    nbytes = t.nbytes
    lane.pending += 1
    if not nbytes:
        return Pending(lambda: out)
    buf = t._buffer
    if t._tracked:
        ln.read(buf)
    dev = ln.device
    st = _Staging(dev, nbytes, 2)
    s = ln.stream
    dev._driver.copy_d2h(st.buf[:nbytes], t.ptr, s.handle)
    ln.keep(st)
    seq = ln.end()
    if t._tracked:
        ln.was_read(buf, seq)
    dev._stats.copies += 1
    return _HostResult(st, out, nbytes)


def _check_same(dst_shape: tuple[int, ...], dst_dtype: np.dtype, src_shape: tuple[int, ...], src_dtype: np.dtype) -> None:
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
    raise TypeError(f"memcpy() {what} must be a Tensor, a numpy array or a DeviceOp, got {type(x).__name__}")


class _Memcpy(DeviceOp[Any]):
    __slots__ = ("_dst", "_src")

    def __init__(self, dst: Any, src: Any) -> None:
        ops = tuple(x for x in (dst, src) if isinstance(x, DeviceOp))
        super().__init__(ops)
        self._dst = dst
        self._src = src

    def _run(self, lane: Lane, args: Any) -> Any:
        it = iter(args)
        dst = next(it) if isinstance(self._dst, DeviceOp) else self._dst
        src = next(it) if isinstance(self._src, DeviceOp) else self._src
        dst = _as_copy_end(dst, "destination")
        src = _as_copy_end(src, "source")
        if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
            raise TypeError("memcpy() between two host arrays: use numpy")
        _check_same(dst.shape, dst.dtype, src.shape, src.dtype)
        if isinstance(dst, np.ndarray):
            if not (dst.flags.c_contiguous and dst.flags.writeable):
                raise ValueError("memcpy() into a host array needs a writable C-contiguous array")
            return _d2h(lane, src, dst)
        dst._check_live()
        ln = lane.on(dst.device)
        s = ln.stream
        dbuf = dst._buffer
        if isinstance(src, np.ndarray):
            if dst._tracked:
                ln.write(dbuf)
            _h2d(ln, dst.ptr, src)
        else:
            src._check_live()
            sbuf = src._buffer
            if src._tracked:
                ln.read(sbuf)
            if dst._tracked:
                ln.write(dbuf)
            if dst.nbytes:
                drv = ln.device._driver
                if src.device is dst.device:
                    drv.copy_d2d(dst.ptr, src.ptr, dst.nbytes, s.handle)
                else:
                    drv.copy_peer(dst.ptr, src.device._driver, src.ptr, dst.nbytes, s.handle)
                ln.device._stats.copies += 1
        seq = ln.end()
        if dst._tracked:
            ln.wrote(dbuf, seq)
        if not isinstance(src, np.ndarray) and src._tracked:
            ln.was_read(src._buffer, seq)
        return dst


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
        if isinstance(dst, np.ndarray) and not (dst.flags.c_contiguous and dst.flags.writeable):
            raise ValueError("memcpy() into a host array needs a writable C-contiguous array")
    return _Memcpy(dst, src)


class _Dup(DeviceOp[Tensor]):
    __slots__ = ("_src", "_device")

    def __init__(self, src: Any, device: Device | None) -> None:
        super().__init__((src,) if isinstance(src, DeviceOp) else ())
        self._src = src
        self._device = device

    def _run(self, lane: Lane, args: Any) -> Tensor:
        src = _tensor_of(args[0] if args else self._src, "dup()")
        src._check_live()
        target = self._device or src.device
        ln, t = _new_tensor(lane, src.shape, src.dtype, target)
        s = ln.stream
        if src._tracked:
            ln.read(src._buffer)
        if t.nbytes:
            drv = target._driver
            if src.device is target:
                drv.copy_d2d(t.ptr, src.ptr, t.nbytes, s.handle)
            else:
                drv.copy_peer(t.ptr, src.device._driver, src.ptr, t.nbytes, s.handle)
            target._stats.copies += 1
        seq = ln.end()
        ln.wrote(t._buffer, seq)
        if src._tracked:
            ln.was_read(src._buffer, seq)
        return t


def dup(tensor: Any, *, device: Device | int | None = None) -> DeviceOp[Tensor]:
    """A copy of ``tensor`` (a tensor, partition or op producing one) on ``device`` (default: its own)."""
    if not isinstance(tensor, (Tensor, Partition, DeviceOp)):
        raise TypeError(f"dup() needs a Tensor or a DeviceOp, got {type(tensor).__name__}")
    return _Dup(tensor, _explicit_device(device))
