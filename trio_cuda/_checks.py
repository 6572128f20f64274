"""Argument checks shared by every layer: dtypes, shapes, sizes, scalars.

Sizes are computed with Python integers (never a fixed-width type that can wrap) and
refused above what a device can address. numpy scalars are accepted wherever Python
scalars are.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

import numpy as np

__all__ = [
    "BFLOAT16",
    "MAX_BYTES",
    "SUPPORTED_DTYPES",
    "arg_type",
    "as_int",
    "check_dtype",
    "check_shape",
    "is_int",
    "is_scalar",
    "nbytes_of",
]

# The virtual address space of current NVIDIA GPUs is 49 bits; no single allocation
# can come close. Larger sizes are refused as bad input (ValueError) before any work.
MAX_BYTES = 1 << 48

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
try:  # bfloat16 has no numpy dtype of its own: ml_dtypes provides the one the field uses
    import ml_dtypes as _ml_dtypes

    _bf16: np.dtype[Any] = np.dtype(_ml_dtypes.bfloat16)
    BFLOAT16: np.dtype[Any] | None = _bf16
    SUPPORTED_DTYPES = (*SUPPORTED_DTYPES, _bf16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def check_dtype(dtype: Any) -> np.dtype[Any]:
    """Normalize ``dtype`` to a supported numpy dtype (native byte order), or raise TypeError."""
    if dtype is None:
        raise TypeError("dtype must not be None")
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16") and BFLOAT16 is not None:
        return BFLOAT16
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"not a dtype: {dtype!r}") from err
    if dt.byteorder not in ("=", "|"):
        dt = np.dtype(dt.newbyteorder("="))
    if dt not in _SUPPORTED:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"unsupported dtype {dt}; supported: {supported}")
    return dt


def is_int(x: Any) -> bool:
    """True for Python and numpy integers (not bools)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def as_int(x: Any, what: str, *, minimum: int | None = None) -> int:
    """``x`` as a Python int (numpy integers accepted), or raise TypeError/ValueError."""
    if not is_int(x):
        raise TypeError(f"{what} must be an int, not {type(x).__name__} ({x!r})")
    v = int(x)
    if minimum is not None and v < minimum:
        raise ValueError(f"{what} must be at least {minimum}, not {v}")
    return v


def check_shape(shape: Any, what: str = "shape") -> tuple[int, ...]:
    """Normalize ``shape`` (an int or a sequence of ints >= 0), or raise."""
    if type(shape) is tuple:  # the common case, first: a tuple of plain ints >= 0 is its own answer
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    if is_int(shape):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError as err:
        raise TypeError(f"{what} must be an int or a sequence of ints, not {shape!r}") from err
    for d in dims:
        if not is_int(d):
            raise TypeError(f"{what} must contain ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"{what} must not be negative: {shape!r}")
    return tuple(int(d) for d in dims)


def nbytes_of(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    """The size in bytes of a ``shape`` array of ``dtype``, refused above :data:`MAX_BYTES`."""
    n = math.prod(shape) * dtype.itemsize
    if n > MAX_BYTES:
        raise ValueError(f"a {dtype} array of shape {shape} needs {n} bytes, more than a device can address ({MAX_BYTES} bytes)")
    return n


def is_scalar(x: Any) -> bool:
    """True for Python and numpy numbers and bools (not arrays, not None)."""
    t = type(x)
    if t is float or t is int:
        return True
    return isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, np.ndarray)


def arg_type(x: Any) -> str:
    """The type of a refused argument, for its error message: named with its library
    (``torch.Tensor``, not ``Tensor``, which reads as trio-cuda's own), and for an array
    of numpy or of another library, with the call that makes it a trio-cuda tensor."""
    t = type(x)
    lib = t.__module__.partition(".")[0]
    name = t.__qualname__ if lib == "builtins" else f"{lib}.{t.__qualname__}"
    if lib == "trio_cuda":  # (its tensors export DLPack too)
        return name
    if isinstance(x, np.ndarray):
        return f"{name} (a numpy array is host memory: upload it with api.from_host(array))"
    # (looked up without running a property: a library may compute its interface on access)
    if any(inspect.getattr_static(x, p, None) is not None for p in ("__dlpack__", "__cuda_array_interface__")):
        return f"{name} (another library's array: api.asarray(x), or api.from_dlpack(x), makes it a tensor without a copy)"
    return name
