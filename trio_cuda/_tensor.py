"""Tensors and partitions: typed views of device buffers.

A :class:`Tensor` is a view (shape, dtype, byte offset, byte strides) of a device
:class:`~trio_cuda._memory.Buffer`. Dependency tracking and lifetime belong to the
buffer, so every view of it orders and keeps alive the same memory.

A :class:`Partition` is a tensor cut into tiles; a kernel launch takes its grid
from the tile grid and treats a partition argument as written.
"""

from __future__ import annotations

import math
from collections.abc import Coroutine
from types import EllipsisType
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex, overload

import numpy as np

from ._backends._boundary import ArrayArg
from ._checks import check_shape, is_int
from ._errors import DeviceReset, GraphCaptureError
from ._memory import Buffer
from ._op import DeviceOp, TensorMath, TensorValuedOp, _ext, array_index, item_of
from ._pending import Pending
from ._plan import Lane, Plan
from ._zip import value

if TYPE_CHECKING:
    from ._device import Device
    from ._plan import _StagingSlot
    from ._staging import Staging

__all__ = ["Partition", "Tensor", "plan_read_to_host"]

# One item of a basic index (a view): what numpy's basic indexing takes.
_Basic = SupportsIndex | slice | EllipsisType | None


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array."""
    strides = []
    acc = itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _in_place(oper: str, op: str) -> str:
    return (
        f"'t {oper} v' on a trio_cuda.Tensor: ops are lazy, so this would rebind t to an op and leave the "
        f"tensor unchanged; write into it with 'await ops.{op}(t, v, out=t)' (or rebind on purpose: t = t {oper[:-1]} v)"
    )


class Tensor(TensorMath):
    """A device array: shape, numpy dtype, strides, on one device.

    Tensors come from ops (``await api.zeros(...)``, kernel outputs, ...), never from
    the constructor.

    Attributes:
        shape: The shape.
        dtype: The numpy dtype.
    """

    __slots__ = ("_args", "_buffer", "_offset", "_strides", "_tracked", "dtype", "shape")

    _buffer: Buffer
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    _offset: int
    _strides: tuple[int, ...]
    _tracked: bool
    _args: tuple[ArrayArg, ArrayArg] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Tensor cannot be constructed directly; use trio_cuda.api (zeros, from_host, ...)")

    @classmethod
    def _new(
        cls,
        buffer: Buffer,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        offset: int = 0,
        strides: tuple[int, ...] | None = None,
        tracked: bool = True,
    ) -> Tensor:
        self = cls.__new__(cls)  # (not object.__new__: compiled, this is an extension type)
        self._buffer = buffer
        self.shape = shape
        self.dtype = dtype
        self._offset = offset
        self._strides = strides if strides is not None else c_strides(shape, dtype.itemsize)
        self._tracked = tracked
        self._args = None
        return self

    # -- properties -------------------------------------------------------------
    @property
    def device(self) -> Device:
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
        """Strides in bytes."""
        return self._strides

    @property
    def is_contiguous(self) -> bool:
        """True for a C-contiguous view."""
        return self._strides == c_strides(self.shape, self.dtype.itemsize) or self.size <= 1

    @property
    def ptr(self) -> int:
        """The device address of the first element (for interop; the memory is owned by the tensor).

        Raises:
            RuntimeError: The memory is not allocated yet (inside a then() callback of the
                submission that allocates it), or never will be.
        """
        p = self._buffer.ptr
        if p is None:
            raise RuntimeError(f"{self!r} has no memory yet: it is allocated when its submission enqueues")
        return p + self._offset

    @property
    def is_tracked(self) -> bool:
        """False for a view made by :meth:`untracked`."""
        return self._tracked

    def __repr__(self) -> str:
        extra = "" if self._tracked else " untracked"
        return f"<trio_cuda.Tensor shape={self.shape} dtype={self.dtype} device={self.device.ordinal}{extra}>"

    def ready(self) -> Coroutine[Any, Any, None]:
        """Wait in trio until the tensor's pending write (the last op that wrote its
        memory) has completed: ``await t.ready()``. A checkpoint, like ``await op``
        (cancellable; cancelling it leaves the write running). Needed before exporting a
        tensor on the trio thread where the export would make the host wait for the
        write: ``numpy.from_dlpack(t)`` on the simulated device, the CUDA Array
        Interface (see docs/interop.md).

        Raises:
            DeviceFault: The write failed.
            DeviceReset: The device was reset while the write was pending.
            ValueError: The tensor has no memory (it was allocated before a reset of its
                device, or belongs to an op that did not run), as for any op taking it.
        """
        return _ext("ready")(self)  # type: ignore[no-any-return]

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
        """DLPack export without a copy (see trio_cuda._interop): ``torch.from_dlpack(t)``,
        ``cupy.from_dlpack(t)``; on the simulated device ``numpy.from_dlpack(t)``. The
        consumer's ``stream`` waits for the tensor's pending write. An export that would
        make the host wait for that write (the simulated device's) refuses in a trio
        task while it is pending (``BufferError``): ``await t.ready()`` first."""
        return _ext("dlpack")(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return _ext("dlpack_device")(self)  # type: ignore[no-any-return]

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface, version 3 (CUDA only), with the stream of the pending
        write (consumers wait on it), or None when the data is ready. In a trio task it
        refuses while a write is pending (``BufferError``; consumers may wait for the
        stream on the host): ``await t.ready()`` first."""
        return _ext("cuda_array_interface")(self)  # type: ignore[no-any-return]

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "a trio_cuda.Tensor lives in device memory; copy it to the host with "
            "'await tensor.to_host()' (or tensor.to_host().sync() outside trio)"
        )

    # In-place habits: Python's ``t += v`` would rebind ``t`` to a lazy op and leave the
    # tensor as it was, silently; a tensor refuses, naming the op that writes into it.
    def __iadd__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("+=", "add"))

    def __isub__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("-=", "subtract"))

    def __imul__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("*=", "multiply"))

    def __itruediv__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("/=", "divide"))

    def __imatmul__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("@=", "matmul"))

    def __ipow__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("**=", "power"))

    def __iand__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("&=", "bitwise_and"))

    def __ior__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("|=", "bitwise_or"))

    def __ixor__(self, other: Any) -> NoReturn:
        raise TypeError(_in_place("^=", "bitwise_xor"))

    def __setitem__(self, key: Any, v: Any) -> None:
        raise TypeError(
            "a trio_cuda.Tensor is written by ops, not by assignment: for a tensor or op v, "
            "'await ops.copy(v, out=t[key])'; for a scalar, "
            "'await ops.copy(ops.full_like(t[key], v), out=t[key])'"
        )

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # -- the tensor protocol of DeviceOp ------------------------------------------
    def _as_tensor(self) -> Tensor:
        return self

    def _arg(self, writable: bool) -> ArrayArg:
        """The kernel argument descriptor of this view (needs the memory allocated)."""
        args = self._args
        if args is None:
            cache = self._buffer.args
            key = (self._offset, self.shape, self._strides, self.dtype.str, self._tracked)
            args = cache.get(key)
            if args is None:
                ptr = self.ptr
                args = cache[key] = (
                    ArrayArg(ptr, self.shape, self._strides, self.dtype, False),
                    ArrayArg(ptr, self.shape, self._strides, self.dtype, True),
                )
            self._args = args
        return args[writable]

    def _proto_arg(self, writable: bool) -> ArrayArg:
        """A descriptor with this view's layout but no address (for compile signatures)."""
        return ArrayArg(0, self.shape, self._strides, self.dtype, writable)

    def _plan_to_host(self, plan: Plan, lane: Lane) -> Pending:
        return plan_read_to_host(plan, lane, self, np.empty(self.shape, dtype=self.dtype))

    # -- views --------------------------------------------------------------------
    # (an integer tensor in the key makes a gather, an op; anything else a view)
    @overload
    def __getitem__(self, key: TensorMath) -> TensorValuedOp[Tensor]: ...
    @overload
    def __getitem__(self, key: _Basic | tuple[_Basic, ...]) -> Tensor: ...
    @overload
    def __getitem__(self, key: tuple[Any, ...]) -> TensorValuedOp[Tensor]: ...
    def __getitem__(self, key: Any) -> Any:
        """A view by basic indexing, as numpy's: ints, slices (any step, negative too),
        ``...`` and ``None``. Free and immediate; it shares the memory (and its ordering).

        With an integer tensor (or an op producing one) in ``key`` (``t[idx]``,
        ``t[:, idx]``, ``t[..., idx]``) it is a gather instead: an op, as
        :func:`trio_cuda.ops.take` along that axis."""
        if array_index(key):
            return _ext("index")(self, key)
        shape, strides, offset = index_view(self.shape, self._strides, key)
        return Tensor._new(self._buffer, shape, self.dtype, self._offset + offset, strides, self._tracked)

    @property
    def T(self) -> Tensor:
        """The view with the axes reversed."""
        return self.transpose()

    def transpose(self, *axes: Any) -> Tensor:
        """A view with the axes permuted (reversed by default), as ``numpy.transpose``."""
        if len(axes) == 1 and not is_int(axes[0]) and axes[0] is not None:
            axes = tuple(axes[0])
        n = self.ndim
        if not axes or axes == (None,):
            perm = tuple(range(n - 1, -1, -1))
        else:
            perm = tuple(normalize_axis(a, n) for a in axes)
            if sorted(perm) != list(range(n)):
                raise ValueError(f"axes {tuple(axes)} are not a permutation of the {n} axes of shape {self.shape}")
        shape = tuple(self.shape[i] for i in perm)
        strides = tuple(self._strides[i] for i in perm)
        return Tensor._new(self._buffer, shape, self.dtype, self._offset, strides, self._tracked)

    def reshape(self, *shape: Any) -> Tensor:
        """A view with another shape and the same number of elements (one dim may be -1)."""
        if len(shape) == 1 and not is_int(shape[0]):
            shape = tuple(shape[0])
        dims = list(shape)
        if sum(1 for d in dims if is_int(d) and d == -1) > 1:
            raise ValueError(f"can only infer one dimension: {tuple(shape)}")
        if any(is_int(d) and d == -1 for d in dims):
            known = math.prod(d for d in dims if not (is_int(d) and d == -1))
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape {self.shape} into {tuple(shape)}")
            dims[next(i for i, d in enumerate(dims) if is_int(d) and d == -1)] = self.size // known
        new = check_shape(dims)
        if math.prod(new) != self.size:
            raise ValueError(f"cannot reshape {self.shape} ({self.size} elements) into {new}")
        if not self.is_contiguous:
            raise ValueError(f"reshape() of a non-contiguous view of shape {self.shape}; copy it first")
        return Tensor._new(self._buffer, new, self.dtype, self._offset, None, self._tracked)

    def partition(self, tile_shape: Any) -> Partition:
        """Cut the tensor into tiles of ``tile_shape`` (one per dimension); a tile need not
        divide the shape: the last tile along a dimension is then partial."""
        return Partition._new(self, tile_shape)

    def untracked(self) -> Tensor:
        """A view that opts out of automatic cross-stream ordering (experts only).

        Ops through this view neither wait for other streams' pending accesses nor
        order later ops after themselves: ordering is then the caller's job. The
        memory is still kept alive for them: it is freed only after every access,
        tracked or not, has completed.
        """
        return Tensor._new(self._buffer, self.shape, self.dtype, self._offset, self._strides, False)

    # -- ops ----------------------------------------------------------------------
    def to_host(self) -> DeviceOp[np.ndarray]:
        """An op that copies the data into a new numpy array."""
        return value(self).to_host()

    def item(self) -> DeviceOp[Any]:
        """An op giving the one element as a Python scalar: ``loss = await t.item()``
        (numpy's ``item``). A tensor of more or fewer elements is refused at once."""
        n = math.prod(self.shape)
        if n != 1:
            raise ValueError(f"item(): the tensor has {n} elements (shape {self.shape}); only one element converts to a scalar")
        return item_of(value(self))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a trio_cuda.Tensor lives in device memory and does not pickle: "
            "pickle its data instead ('await tensor.to_host()' gives a numpy array)"
        )


class Partition:
    """A tensor seen as a grid of tiles; the output of a kernel launch.

    Attributes:
        tensor: The partitioned tensor.
        tile_shape: The shape of one tile.
        grid: Tiles along each dimension (``ceil(shape[i] / tile_shape[i])``; edge tiles
            may be partial).
    """

    __slots__ = ("_k", "grid", "tensor", "tile_shape")

    tensor: Tensor
    tile_shape: tuple[int, ...]
    grid: tuple[int, ...]
    _k: tuple[Any, ...] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Partition cannot be constructed directly; use tensor.partition(tile_shape)")

    @classmethod
    def _new(cls, tensor: Tensor, tile_shape: Any) -> Partition:
        tile = check_shape(tile_shape, "tile_shape")
        shape = tensor.shape
        if len(tile) != len(shape):
            raise ValueError(f"tile_shape {tile} has {len(tile)} dims, the tensor {shape} has {len(shape)}")
        # Ragged: the last tile along a dimension may be partial (the grid is the ceiling).
        if len(tile) == 1:  # the common case, without the loop (most of a build's cost)
            if tile[0] == 0:
                raise ValueError(f"tile_shape must be positive: {tile}")
            grid: tuple[int, ...] = (-(-shape[0] // tile[0]),)
        else:
            dims = []
            for n, t in zip(shape, tile, strict=True):
                if t == 0:
                    raise ValueError(f"tile_shape must be positive: {tile}")
                dims.append(-(-n // t))
            grid = tuple(dims)
        self = cls.__new__(cls)  # (not object.__new__: compiled, this is an extension type)
        self.tensor = tensor
        self.tile_shape = tile
        self.grid = grid
        self._k = None
        return self

    def _key(self) -> tuple[Any, ...]:
        """This partition as a launch argument: its tensor's descriptor and its tiles
        (needs the memory allocated; cached)."""
        k = self._k
        if k is None:
            k = self._k = (self.tensor._arg(True), self.tile_shape)
        return k

    @property
    def device(self) -> Device:
        return self.tensor.device

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.tensor.dtype

    @property
    def ndim(self) -> int:
        return self.tensor.ndim

    def _as_tensor(self) -> Tensor:
        return self.tensor

    def unpartition(self) -> Tensor:
        """The whole tensor again."""
        return self.tensor

    def to_host(self) -> DeviceOp[np.ndarray]:
        """An op that copies the whole tensor into a new numpy array."""
        return self.tensor.to_host()

    def __repr__(self) -> str:
        return f"<trio_cuda.Partition shape={self.shape} tile={self.tile_shape} grid={self.grid} dtype={self.dtype}>"


# -- basic indexing ------------------------------------------------------------------------------
def normalize_axis(axis: Any, ndim: int) -> int:
    """``axis`` (negative counts from the end) as an index into ``ndim`` axes, or raise."""
    if not is_int(axis):
        raise TypeError(f"an axis must be an int, not {type(axis).__name__}")
    a = int(axis)
    if not -ndim <= a < ndim:
        raise ValueError(f"axis {a} is out of range for {ndim} dimensions")
    return a % ndim


def index_view(shape: tuple[int, ...], strides: tuple[int, ...], key: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(shape, strides, byte offset) of the view ``key`` selects, by numpy's basic indexing."""
    if not isinstance(key, tuple):
        key = (key,)
    for k in key:
        if not (k is None or k is Ellipsis or isinstance(k, slice) or is_int(k)):
            raise TypeError(
                f"only basic indexing is supported on device tensors (ints, slices, ..., None), not {type(k).__name__}; "
                "for a selection by a mask or an index array, use trio_cuda.ops"
            )
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > len(shape):
        raise IndexError(f"too many indices: {used} for a tensor of {len(shape)} dimensions")
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - used) + key[i + 1 :]
    else:
        key = key + (slice(None),) * (len(shape) - used)
    out_shape: list[int] = []
    out_strides: list[int] = []
    offset = 0
    dim = 0
    for k in key:
        if k is None:
            out_shape.append(1)
            out_strides.append(0)
            continue
        n, st = shape[dim], strides[dim]
        dim += 1
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            length = len(range(start, stop, step))
            if length:
                offset += start * st
            out_shape.append(length)
            out_strides.append(st * step)
        else:
            i = int(k)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for an axis of size {n}")
            offset += (i % n) * st
    return tuple(out_shape), tuple(out_strides), offset


# -- reading back to the host ---------------------------------------------------------------
class _HostResult(Pending):
    """The pending numpy array of a device-to-host copy (no reference cycle: a
    finalizer must run as soon as an abandoned result is dropped)."""

    __slots__ = ("_nbytes", "_out", "_slot")

    def __init__(self, slot: _StagingSlot, out: np.ndarray, nbytes: int) -> None:
        super().__init__(_no_fn)
        self._slot: _StagingSlot | None = slot
        self._out = out
        self._nbytes = nbytes

    def _compute(self) -> Any:
        slot = self._slot
        assert slot is not None
        self._slot = None
        st = slot.staging
        assert st is not None
        try:
            _copy_out(st, self._out, self._nbytes)
        finally:
            st.host_done()
        return self._out

    def __del__(self) -> None:
        slot = self._slot
        if slot is not None and slot.staging is not None:  # never resolved (cancelled)
            slot.staging.host_done()


def _no_fn() -> Any:
    raise AssertionError("resolved through _HostResult.resolve")


def _copy_out(st: Staging, out: np.ndarray, nbytes: int) -> None:
    dev = st.pool.device
    if not dev.begin_host_read(st.generation):
        raise DeviceReset("the device was reset before this read-back was copied out; its data is gone", device=dev.ordinal)
    try:
        out.reshape(-1).view(np.uint8)[:] = st.buf[:nbytes]
    finally:
        dev.end_host_read()


def _d2h_step(lane: Lane, arg: tuple[Tensor, _StagingSlot]) -> None:
    t, slot = arg
    st = slot.staging
    assert st is not None
    buf = t._buffer
    tracked = t._tracked
    lane.read(buf, tracked)
    dev = lane.device
    dev._driver.copy_d2h(st.buf[: slot.nbytes], t.ptr, lane.stream.handle)
    lane.keep(st)
    lane.was_read(buf, lane.end(), tracked)
    dev._stats.copies += 1


def plan_read_to_host(plan: Plan, lane: Lane, t: Tensor, out: np.ndarray) -> Pending:
    """Plan a copy of ``t`` into the host array ``out`` (a pending value: ``out`` once done)."""
    plan.use(t._buffer, t)
    if not t.is_contiguous:  # a view: gathered into contiguous memory on the device first
        t = _ext("contiguous")(plan, lane, t)
    ln = lane.on(t.device)
    if plan.capture is not None:
        raise GraphCaptureError(
            "copying to host memory inside a graph capture: read results back after launching the graph",
            device=ln.device.ordinal,
        )
    plan.pending += 1
    nbytes = t.nbytes
    if not nbytes:
        return Pending(lambda: out)
    slot = plan.need_staging(ln, nbytes, True)
    plan.step(ln, _d2h_step, (t, slot))
    return _HostResult(slot, out, nbytes)
