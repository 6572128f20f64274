"""The dtypes and shapes of the ops' operands: numpy's promotion (bfloat16 as PyTorch),
the dtype arithmetic runs in, broadcasting, coalesced dimensions and views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._checks import BFLOAT16
from .._tensor import Tensor

__all__ = [
    "bfloat16_promotion",
    "broadcast_shape",
    "broadcast_view",
    "coalesce",
    "compute_dtype",
    "half_proxy",
    "one_stride",
    "promote",
    "view",
]


# -- dtypes ---------------------------------------------------------------------------------
def half_proxy(dt: np.dtype[Any]) -> np.dtype[Any]:
    """numpy's stand-in for ``dt`` in promotion and casting rules (bfloat16 as float16)."""
    return np.dtype(np.float16) if dt == BFLOAT16 else dt


def bfloat16_promotion(dt: np.dtype[Any], other_float: bool) -> np.dtype[Any]:
    """PyTorch's dtype where numpy, with float16 standing in for bfloat16, resolved ``dt``:
    a float is bfloat16 beside bfloat16, integers, bools and Python scalars (where numpy's
    float16 widens beside int16 and wider integers), and float32 or wider beside another
    float (``other_float``: a float tensor or numpy float scalar)."""
    if dt.kind != "f":
        return dt
    if not other_float:
        return BFLOAT16  # type: ignore[return-value]
    return np.dtype(np.float32) if dt == np.float16 else dt


def promote(name: str, operands: Sequence[Any], *, kinds: str = "biuf") -> np.dtype[Any]:
    """numpy's result dtype of ``operands`` (tensors strong, Python scalars weak as in
    NEP 50, numpy scalars strong); bfloat16 as in PyTorch (see bfloat16_promotion)."""
    parts: list[Any] = []
    bf16 = other_float = False
    for x in operands:
        if isinstance(x, Tensor):
            dt = x.dtype
            if dt.kind not in kinds and dt != BFLOAT16:
                raise TypeError(f"{name}: tensors of dtype {dt} are not supported (kinds {kinds!r})")
            bf16 = bf16 or dt == BFLOAT16
            other_float = other_float or dt.kind == "f"
            parts.append(half_proxy(dt))
        elif isinstance(x, np.generic):
            other_float = other_float or x.dtype.kind == "f"
            parts.append(x.dtype)
        else:
            parts.append(x)  # a Python scalar: weak
    try:
        dt = np.result_type(*parts)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: no common dtype for these operands ({err})") from None
    return bfloat16_promotion(dt, other_float) if bf16 else dt


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
