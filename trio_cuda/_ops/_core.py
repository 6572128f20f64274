"""What every op of the library shares: operands, dtypes, broadcasting, outputs, launches.

An op (:class:`TensorOp`) is a DeviceOp whose arguments may be tensors, partitions,
scalars or other ops. Arguments known when the op is made are checked at once; the rest
when the submission is planned, before anything of it runs. Its ``_build`` allocates the
output (or takes ``out=``) and appends the launches of its kernels to the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._checks import BFLOAT16, check_dtype, is_scalar, nbytes_of
from .._device import Device
from .._kernel import Kernel, _Launch
from .._op import DeviceOp
from .._submit import Lane, Plan
from .._tensor import Partition, Tensor, c_strides

__all__ = [
    "TensorOp",
    "alloc",
    "broadcast_shape",
    "broadcast_view",
    "check_out",
    "coalesce",
    "device_of",
    "launch",
    "one_stride",
    "operand",
    "promote",
    "tensor_arg",
]

THREADS = 256  # threads per block of the elementwise and row kernels
MAX_ROW_BLOCKS = 1 << 20  # row kernels loop over rows past this many blocks


# -- operands ---------------------------------------------------------------------------
def operand(x: Any, name: str, what: str = "argument") -> Any:
    """``x`` as an op operand: a Tensor, a DeviceOp, or a real scalar; else TypeError."""
    if isinstance(x, Partition):
        return x.tensor
    if isinstance(x, (Tensor, DeviceOp)):
        return x
    if is_scalar(x):
        if isinstance(x, (complex, np.complexfloating)):
            raise TypeError(f"{name}: complex {what}s are not supported by trio_cuda.ops ({x!r})")
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name}: the {what} is a numpy array (host memory); upload it with api.from_host(array), or pass a scalar"
        )
    raise TypeError(f"{name}: the {what} must be a Tensor, a DeviceOp or a scalar, not {type(x).__name__}")


def tensor_arg(x: Any, name: str, what: str = "argument") -> Tensor:
    """A resolved operand that must be a tensor."""
    if isinstance(x, Partition):
        return x.tensor
    if isinstance(x, Tensor):
        return x
    if isinstance(x, tuple):
        raise TypeError(f"{name}: the {what} is a tuple (the output of a kernel launch?); pick the tensor with .first()")
    raise TypeError(f"{name}: the {what} must be a tensor, not {type(x).__name__}")


def resolved(v: Any, name: str) -> Any:
    """The output of an input op, as an operand (tensors of partitions; tuples refused)."""
    as_tensor = getattr(v, "_as_tensor", None)
    if as_tensor is not None:
        return as_tensor()
    if is_scalar(v):
        return v
    if isinstance(v, tuple):
        raise TypeError(f"{name}: an input op's output is a tuple (a kernel launch?); pick the tensor with .first()")
    raise TypeError(f"{name}: an input op's output must be a tensor or a scalar, not {type(v).__name__}")


class TensorOp(DeviceOp[Tensor]):
    """An op of the library. Subclasses implement ``_check(*args)`` (argument checks that
    need no plan: run by the constructor when no argument is an op, else at planning
    once the inputs' values are known) and ``_build(plan, lane, *args)`` (allocate and
    launch on checked arguments; returns the output tensor)."""

    __slots__ = ("_args", "_at")
    name = "op"

    def __init__(self, args: tuple[Any, ...]) -> None:
        ops: list[DeviceOp[Any]] = []
        at: list[int] = []
        for i, a in enumerate(args):
            if isinstance(a, DeviceOp):
                ops.append(a)
                at.append(i)
        super().__init__(tuple(ops))
        self._args = args
        self._at = tuple(at)
        if not ops:
            self._check(*args)

    def _check(self, *args: Any) -> None:
        """Checks that need no plan (shapes, dtypes, devices); the build repeats them."""

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        raise NotImplementedError

    def _plan(self, plan: Plan, lane: Lane, values: Any) -> Tensor:
        args = self._args
        if values:
            merged = list(args)
            for i, v in zip(self._at, values, strict=True):
                merged[i] = resolved(v, self.name)
            args = tuple(merged)
            self._check(*args)  # without op inputs, the constructor checked them
        return self._build(plan, lane, *args)

    def __repr__(self) -> str:
        return f"<trio_cuda op {self.name} at {id(self):#x}>"


# -- dtypes ---------------------------------------------------------------------------------
def _proxy(dt: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(np.float16) if dt == BFLOAT16 else dt


def promote(name: str, operands: Sequence[Any], *, kinds: str = "biuf") -> np.dtype[Any]:
    """numpy's result dtype of ``operands`` (tensors strong, Python scalars weak as in
    NEP 50, numpy scalars strong); bfloat16 with bfloat16 stays bfloat16, with another
    float becomes float32 (as in PyTorch)."""
    parts: list[Any] = []
    bf16 = fp16 = False
    for x in operands:
        if isinstance(x, Tensor):
            dt = x.dtype
            if dt.kind not in kinds and dt != BFLOAT16:
                raise TypeError(f"{name}: tensors of dtype {dt} are not supported (kinds {kinds!r})")
            bf16 = bf16 or dt == BFLOAT16
            fp16 = fp16 or dt == np.float16
            parts.append(_proxy(dt))
        elif isinstance(x, np.generic):
            parts.append(x.dtype)
        else:
            parts.append(x)  # a Python scalar: weak
    try:
        dt = np.result_type(*parts)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: no common dtype for these operands ({err})") from None
    if bf16 and dt == np.float16:
        return np.dtype(np.float32) if fp16 else BFLOAT16  # type: ignore[return-value]
    return dt


def compute_dtype(dt: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype arithmetic runs in for results of ``dt`` (half types in float32)."""
    if dt == np.float16 or dt == BFLOAT16:
        return np.dtype(np.float32)
    return dt


# -- shapes ---------------------------------------------------------------------------------
def one_stride(shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """The one stride that walks ``shape`` in C order (size-1 dims skipped; 0 when no
    dim is longer than 1), or None if there is none."""
    st: int | None = None
    expect = 0
    for n, s in zip(reversed(shape), reversed(strides), strict=True):
        if n == 1:
            continue
        if st is None:
            st, expect = s, s * n
        elif s != expect:
            return None
        else:
            expect = s * n
    return st if st is not None else 0


def broadcast_shape(name: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"{name}: shapes {', '.join(str(s) for s in shapes)} cannot be broadcast together") from None


def broadcast_view(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t`` seen with ``shape`` (numpy broadcasting: zero strides, no copy)."""
    if t.shape == shape:
        return t
    lead = len(shape) - t.ndim
    strides = [0] * lead
    for n, have, st in zip(shape[lead:], t.shape, t.strides, strict=True):
        strides.append(0 if have == 1 and n != 1 else st)
    return Tensor._new(t._buffer, shape, t.dtype, t._offset, tuple(strides), t._tracked)


def coalesce(shape: tuple[int, ...], strides: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Merge dimensions that every operand walks as one (numpy's coalescing), dropping
    dimensions of size 1: the kernels index fewer dimensions. Returns at least one."""
    dims = [i for i, n in enumerate(shape) if n != 1]
    if not dims:
        return (1,), [(0,) for _ in strides]
    out_shape = [shape[dims[0]]]
    out_strides = [[s[dims[0]]] for s in strides]
    for i in dims[1:]:
        n = shape[i]
        if all(os[-1] == s[i] * n for os, s in zip(out_strides, strides, strict=True)):
            out_shape[-1] *= n
            for os, s in zip(out_strides, strides, strict=True):
                os[-1] = s[i]
        else:
            out_shape.append(n)
            for os, s in zip(out_strides, strides, strict=True):
                os.append(s[i])
    return tuple(out_shape), [tuple(s) for s in out_strides]


def view(t: Tensor, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype[Any] | None = None) -> Tensor:
    """Another view of ``t``'s memory (same first element)."""
    return Tensor._new(t._buffer, shape, dtype if dtype is not None else t.dtype, t._offset, strides, t._tracked)


# -- devices, outputs, launches ---------------------------------------------------------------
def device_of(name: str, tensors: Sequence[Tensor], lane: Lane | None = None) -> Device:
    """The one device of ``tensors`` (the lane's when there are none)."""
    dev: Device | None = None
    for t in tensors:
        if dev is None:
            dev = t.device
        elif t.device is not dev:
            raise ValueError(
                f"{name}: tensors on devices {dev.ordinal} and {t.device.ordinal}; copy one with api.dup(t, device=...)"
            )
    if dev is None:
        if lane is None:
            raise ValueError(f"{name}: needs at least one tensor")
        return lane.device
    return dev


def alloc(plan: Plan, lane: Lane, shape: tuple[int, ...], dtype: np.dtype[Any], name: str) -> Tensor:
    """A new C-contiguous tensor the submission allocates on ``lane``'s device."""
    buf = plan.new_buffer(lane, nbytes_of(shape, dtype), f"{name}: a {dtype} result of shape {shape}")
    return Tensor._new(buf, shape, dtype)


def check_out(name: str, out: Any, shape: tuple[int, ...], dtype: np.dtype[Any], device: Device | None) -> Tensor:
    """``out=``: a tensor of exactly ``shape``, on ``device``, that ``dtype`` casts to
    (numpy's same_kind rule)."""
    t = tensor_arg(out, name, "out= tensor")
    if t.shape != shape:
        raise ValueError(f"{name}: out= has shape {t.shape}, the result has shape {shape}")
    if t.dtype != dtype and not np.can_cast(_proxy(dtype), _proxy(t.dtype), "same_kind"):
        raise TypeError(f"{name}: cannot cast the {dtype} result to out= of dtype {t.dtype} (same_kind rule)")
    if device is not None and t.device is not device:
        raise ValueError(f"{name}: out= is on device {t.device.ordinal}, the inputs on device {device.ordinal}")
    return t


def _span(t: Tensor) -> tuple[int, int]:
    """The byte range [lo, hi) of the buffer that view ``t`` touches (empty: lo == hi)."""
    if 0 in t.shape:
        return t._offset, t._offset
    lo = hi = t._offset
    for n, s in zip(t.shape, t.strides, strict=True):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + t.dtype.itemsize


def overlaps(a: Tensor, b: Tensor) -> bool:
    """True if views ``a`` and ``b`` may share memory (same buffer, intersecting spans)."""
    if a._buffer is not b._buffer:
        return False
    (alo, ahi), (blo, bhi) = _span(a), _span(b)
    return alo < bhi and blo < ahi


def same_view(a: Tensor, b: Tensor) -> bool:
    return a._buffer is b._buffer and a._offset == b._offset and a.shape == b.shape and a.strides == b.strides


class Out:
    """Where an op computes: ``t`` is ``out=`` itself, a new tensor, or (when ``out=``
    shares memory with an input in a way the kernels cannot handle) a temporary that
    ``_elementwise.finish`` copies into ``back`` (``out=``) at the end, as numpy does for
    overlapping operands."""

    __slots__ = ("back", "t")

    def __init__(self, t: Tensor, back: Tensor | None) -> None:
        self.t = t
        self.back = back


def output(
    plan: Plan,
    lane: Lane,
    name: str,
    out: Any,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    device: Device,
    reads: Sequence[Tensor | None] = (),
    inplace_ok: bool = False,
    casts: bool = False,
) -> Out:
    """``out=`` checked, or a new tensor. ``reads``: the op's tensor inputs; with
    ``inplace_ok`` an input that is exactly ``out=`` (same view) is fine (elementwise).
    An ``out=`` of another dtype than the result gets a temporary of the result's dtype,
    cast into it at the end, unless the op's kernel casts as it stores (``casts``)."""
    if out is None:
        return Out(alloc(plan, lane, shape, dtype, name), None)
    t = check_out(name, out, shape, dtype, device)
    plan.use(t._buffer, t)
    if t.dtype != dtype and not casts:
        return Out(alloc(plan, lane, shape, dtype, name), t)
    for r in reads:
        if r is not None and overlaps(r, t) and not (inplace_ok and same_view(r, t)):
            return Out(alloc(plan, lane, shape, dtype, name), t)
    return Out(t, None)


def launch(plan: Plan, lane: Lane, kernel: Kernel, args: tuple[Any, ...]) -> None:
    """Plan a launch of ``kernel`` on ``lane`` (inside the op's own planning)."""
    _Launch(kernel, args, ())._plan(plan, lane, ())


def out_partition(t: Tensor) -> Partition:
    """``t`` as a launch output (the op's kernel sets the geometry, not the tiles)."""
    return Partition._new(t, t.shape)


def flat_geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One thread per element of the first (output) argument, 256 per block."""
    n = math.prod(args[0].shape)
    return (max(1, -(-n // THREADS)),), (THREADS,)


def unrolled_geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Four elements of the first (output) argument per thread, 256 threads per block."""
    n = math.prod(args[0].shape)
    return (max(1, -(-n // (4 * THREADS))),), (THREADS,)


def rows_geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One block of 256 threads per row: the number of rows is the last argument."""
    return (min(max(1, int(args[-1])), MAX_ROW_BLOCKS),), (THREADS,)


def as_dtype(dtype: Any) -> np.dtype[Any]:
    return check_dtype(dtype)


def contiguous_strides(t: Tensor) -> tuple[int, ...]:
    return c_strides(t.shape, t.dtype.itemsize)
