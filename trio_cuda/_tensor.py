"""Tensors, partitions, and the pending accesses of their memory.

A :class:`Tensor` is a C-contiguous view (shape, dtype, offset) of a device
:class:`Buffer`. The buffer remembers its last writer and its readers since, as
markers ``(stream, seq)``; an op on another stream waits for them before touching
the memory (automatic cross-stream ordering), and the buffer's memory is freed,
when the last view is dropped, only after all of them (stream-ordered free). So
nothing is freed under the GPU, cancelled or not.

A :class:`Partition` is a tensor cut into equal tiles; a kernel launch takes its
grid from the tile grid and treats a partition argument as written.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ._backends._boundary import ArrayArg

if TYPE_CHECKING:
    from ._device import Device
    from ._op import DeviceOp
    from ._stream import Stream

__all__ = ["Buffer", "Partition", "Tensor", "SUPPORTED_DTYPES", "check_dtype", "check_shape"]

SUPPORTED_DTYPES = tuple(
    np.dtype(t)
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)


def check_dtype(dtype: Any) -> np.dtype:
    """Normalize ``dtype`` to a supported numpy dtype, or raise TypeError."""
    try:
        dt = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"not a dtype: {dtype!r}") from err
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dt}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    return dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt


def check_shape(shape: Any, what: str = "shape") -> tuple[int, ...]:
    """Normalize ``shape`` (an int or a sequence of ints >= 0), or raise."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError as err:
        raise TypeError(f"{what} must be an int or a sequence of ints, not {shape!r}") from err
    for d in dims:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
            raise TypeError(f"{what} must contain ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"{what} must not be negative: {shape!r}")
    return tuple(int(d) for d in dims)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    acc = itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


class Buffer:
    """One device allocation and its pending accesses. Internal."""

    __slots__ = ("device", "ptr", "nbytes", "generation", "writer", "readers", "args", "__weakref__")

    def __init__(self, device: "Device", ptr: int, nbytes: int) -> None:
        self.device = device
        self.ptr = ptr
        self.nbytes = nbytes
        self.generation = device._generation
        self.writer: tuple[Stream, int] | None = None
        self.readers: dict[Stream, int] = {}
        # Kernel argument descriptors of the views of this buffer, by geometry: views
        # made anew (reshape, partition) share them, so launch plans stay cached.
        self.args: dict[tuple[Any, ...], ArrayArg] = {}

    def accesses(self) -> list[tuple["Stream", int]]:
        acc = list(self.readers.items())
        if self.writer is not None:
            acc.insert(0, self.writer)
        return acc

    def __del__(self) -> None:
        if self.ptr:
            try:
                self.device._defer_free(self.ptr, self.nbytes, self.generation, self.accesses())
            except Exception:  # interpreter shutdown
                pass


class Tensor:
    """A device array: shape, numpy dtype, C-contiguous, on one device.

    Tensors come from ops (``await api.zeros(...)``, kernel outputs, ...), never from
    the constructor.

    Attributes:
        shape: The shape.
        dtype: The numpy dtype.
    """

    __slots__ = ("_buffer", "shape", "dtype", "_offset", "_tracked", "_args")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Tensor cannot be constructed directly; use trio_cuda.api (zeros, from_host, ...)")

    @classmethod
    def _new(cls, buffer: Buffer, shape: tuple[int, ...], dtype: np.dtype, offset: int = 0, tracked: bool = True) -> "Tensor":
        self = object.__new__(cls)
        self._buffer = buffer
        self.shape = shape
        self.dtype = dtype
        self._offset = offset
        self._tracked = tracked
        self._args: tuple[ArrayArg, ArrayArg] | None = None
        return self

    # -- properties -------------------------------------------------------------
    @property
    def device(self) -> "Device":
        """The device holding the data."""
        return self._buffer.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in bytes (C order)."""
        return _c_strides(self.shape, self.dtype.itemsize)

    @property
    def ptr(self) -> int:
        """The device address of the first element (for interop; the memory is owned by the tensor)."""
        return self._buffer.ptr + self._offset

    @property
    def is_tracked(self) -> bool:
        """False for a view made by :meth:`untracked`."""
        return self._tracked

    def __repr__(self) -> str:
        return f"<trio_cuda.Tensor shape={self.shape} dtype={self.dtype} device={self.device.ordinal}>"

    def _arg(self, writable: bool) -> ArrayArg:
        args = self._args
        if args is None:
            cache = self._buffer.args
            key = (self._offset, self.shape, self.dtype.str)
            args = cache.get(key)
            if args is None:
                ptr = self.ptr
                strides = self.strides
                args = cache[key] = (
                    ArrayArg(ptr, self.shape, strides, self.dtype, False),
                    ArrayArg(ptr, self.shape, strides, self.dtype, True),
                )
            self._args = args
        return args[writable]

    def _check_live(self) -> None:
        buf = self._buffer
        if buf.generation != buf.device._generation:
            raise ValueError(f"{self!r} was allocated before device {buf.device.ordinal} was reset; its memory is gone")

    # -- views --------------------------------------------------------------------
    def reshape(self, *shape: Any) -> "Tensor":
        """A view with another shape and the same number of elements (one dim may be -1)."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        dims = list(shape)
        if dims.count(-1) > 1:
            raise ValueError(f"can only infer one dimension: {tuple(shape)}")
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape {self.shape} into {tuple(shape)}")
            dims[dims.index(-1)] = self.size // known
        new = check_shape(dims)
        if math.prod(new) != self.size:
            raise ValueError(f"cannot reshape {self.shape} ({self.size} elements) into {new}")
        return Tensor._new(self._buffer, new, self.dtype, self._offset, self._tracked)

    def partition(self, tile_shape: Any) -> "Partition":
        """Cut the tensor into tiles of ``tile_shape``, which must divide its shape."""
        return Partition._new(self, tile_shape)

    def untracked(self) -> "Tensor":
        """A view that opts out of automatic cross-stream ordering (experts only).

        Ops through this view neither wait for other streams' pending accesses nor
        register their own: ordering is then the caller's job. The memory stays
        owned by the original buffer.
        """
        return Tensor._new(self._buffer, self.shape, self.dtype, self._offset, False)

    # -- ops ----------------------------------------------------------------------
    def to_host(self) -> "DeviceOp[np.ndarray]":
        """An op that copies the data into a new numpy array."""
        from ._api import _ToHost
        from ._op import value

        return _ToHost(value(self))


class Partition:
    """A tensor seen as a grid of equal tiles; the output of a kernel launch.

    Attributes:
        tensor: The partitioned tensor.
        tile_shape: The shape of one tile.
        grid: Tiles along each dimension (``shape[i] // tile_shape[i]``).
    """

    __slots__ = ("tensor", "tile_shape", "grid", "_k")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Partition cannot be constructed directly; use tensor.partition(tile_shape)")

    def _key(self) -> tuple[Any, ...]:
        k = self._k
        if k is None:
            k = self._k = (self.tensor._arg(True), self.tile_shape)
        return k

    @classmethod
    def _new(cls, tensor: Tensor, tile_shape: Any) -> "Partition":
        tile = check_shape(tile_shape, "tile_shape")
        if len(tile) != tensor.ndim:
            raise ValueError(f"tile_shape {tile} has {len(tile)} dims, the tensor {tensor.shape} has {tensor.ndim}")
        if any(t == 0 for t in tile):
            raise ValueError(f"tile_shape must be positive: {tile}")
        bad = [i for i, (n, t) in enumerate(zip(tensor.shape, tile)) if n % t]
        if bad:
            raise ValueError(f"tile_shape {tile} does not divide the tensor shape {tensor.shape} (dims {bad})")
        self = object.__new__(cls)
        self.tensor = tensor
        self.tile_shape = tile
        self.grid = tuple(n // t for n, t in zip(tensor.shape, tile))
        self._k: tuple[Any, ...] | None = None
        return self

    @property
    def device(self) -> "Device":
        return self.tensor.device

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    @property
    def dtype(self) -> np.dtype:
        return self.tensor.dtype

    @property
    def ndim(self) -> int:
        return self.tensor.ndim

    def unpartition(self) -> Tensor:
        """The whole tensor again."""
        return self.tensor

    def to_host(self) -> "DeviceOp[np.ndarray]":
        """An op that copies the whole tensor into a new numpy array."""
        return self.tensor.to_host()

    def __repr__(self) -> str:
        return f"<trio_cuda.Partition shape={self.shape} tile={self.tile_shape} grid={self.grid} dtype={self.dtype}>"

