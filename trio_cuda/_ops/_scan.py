"""Scans: cumsum along an axis (or of the flattened tensor), numpy's result dtypes.

One block of 256 threads per row of the ``(rows, cols)`` view (the axis moved last, as
the reductions do): the row is scanned 256 columns at a time, each chunk by a scan in
shared memory plus the running total of the chunks before it. Integers and bools sum
in int64 (uint64), floats in their compute dtype (float16 and bfloat16 in float32, each
result rounded once); the order of the float additions is the scan's, not numpy's left
to right (results agree to rounding).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_int
from .._plan import Lane, Plan
from .._tensor import Tensor, normalize_axis
from ._codegen import bf16_to_f32, f32_to_bf16, half_view, row_kernel, store_expr
from ._core import TensorOp, alloc, as_dtype, check_out, launch, operand, out_partition, output
from ._elementwise import contiguous, copy_into, finish
from ._layout import compute_dtype, view
from ._reduce import _as_rows

__all__ = ["Cumsum", "cumsum"]


def _np_name(dt: np.dtype[Any]) -> str:
    if dt == BFLOAT16:
        return "uint16"  # kernels see bfloat16 as its bits (see _codegen.half_view)
    return "bool_" if dt == np.bool_ else dt.name


@functools.cache  # the kernel source is built once per key
def _cumsum_kernel(acc: np.dtype[Any], res: np.dtype[Any], src: np.dtype[Any]) -> Any:
    """``src``: the input's dtype (bfloat16 comes as its bits, decoded when loaded)."""
    a_t, o_t = getattr(np, _np_name(acc)), getattr(np, _np_name(res))
    bf16_in = src == BFLOAT16
    body = [
        "sm = cuda.shared.array(256, A)",
        "carry = A(0)",
        "base = 0",
        "while base < k:",
        "    c = base + t_",
        "    v = A(0)",
        "    if c < k:",
        f"        v = A({'BF16_IN(x[row, c])' if bf16_in else 'x[row, c]'})",
        "    sm[t_] = v",
        "    cuda.syncthreads()",
        "    s_ = 1",
        "    while s_ < 256:",  # an inclusive scan of the chunk (Hillis-Steele)
        "        w = A(0)",
        "        if t_ >= s_:",
        "            w = sm[t_ - s_]",
        "        cuda.syncthreads()",
        "        v += w",
        "        sm[t_] = v",
        "        cuda.syncthreads()",
        "        s_ *= 2",
        "    if c < k:",
        f"        out[row, c] = {store_expr('carry + v', res)}",
        "    carry += sm[255]",
        "    cuda.syncthreads()",
        "    base += 256",
    ]

    def sim(out: np.ndarray, x: np.ndarray, k: int, m: int) -> None:
        with np.errstate(all="ignore"):
            r = np.cumsum((bf16_to_f32(x) if bf16_in else x).astype(a_t), axis=1)
        if res == BFLOAT16:
            np.copyto(out, f32_to_bf16(r))
        else:
            np.copyto(out, r, casting="unsafe")

    key = ("cumsum", acc.str, res.str, bf16_in, res == BFLOAT16)
    return row_kernel("cumsum", ["out", "x", "k", "m"], body, {"A": a_t, "O": o_t}, sim, key)


def _result(x: Tensor, dtype: np.dtype[Any] | None) -> np.dtype[Any]:
    if dtype is not None:
        return dtype
    return np.cumsum(np.zeros(1, x.dtype)).dtype


class Cumsum(TensorOp):
    __slots__ = ()
    _cacheable = True
    name = "ops.cumsum"

    def _shape(self, x: Any, axis: int | None, dtype: np.dtype[Any] | None) -> tuple[tuple[int, ...], np.dtype[Any]]:
        if not isinstance(x, Tensor):
            raise TypeError(f"{self.name}: needs a tensor, got {arg_type(x)}")
        for dt in (x.dtype, dtype):
            if dt is not None and dt != BFLOAT16 and dt.kind not in "biuf":
                raise TypeError(f"{self.name}: dtype {dt} is not supported (convert with astype)")
        if axis is None:
            return (x.size,), _result(x, dtype)
        if x.ndim == 0:
            raise ValueError(f"{self.name}: axis {axis} of a 0-d tensor; use axis=None")
        normalize_axis(axis, x.ndim)
        return x.shape, _result(x, dtype)

    def _check(self, *args: Any) -> None:
        x, axis, dtype, out = args
        shape, res = self._shape(x, axis, dtype)
        if out is not None:
            check_out(self.name, out, shape, res, x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, axis, dtype, out = args
        shape, res = self._shape(x, axis, dtype)
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        result = output(plan, ln, self.name, out, shape, res, x.device, (x,))
        dst = result.t
        if x.size == 0:
            return finish(plan, ln, result, self.name)
        isz = res.itemsize
        acc = compute_dtype(res)
        if axis is None:
            xc = contiguous(plan, ln, x)
            rows = view(xc, (1, x.size), (x.size * x.dtype.itemsize, x.dtype.itemsize))
            m, k = 1, x.size
            tmp = dst if dst.is_contiguous else alloc(plan, ln, shape, res, self.name)
            o = half_view(view(tmp, (m, k), (k * isz, isz)))
            launch(plan, ln, _cumsum_kernel(acc, res, x.dtype), (out_partition(o), half_view(rows), k, m))
            if tmp is not dst:
                copy_into(plan, ln, dst, tmp, self.name)
            return finish(plan, ln, result, self.name)
        ax = normalize_axis(axis, x.ndim)
        rows, m, k = _as_rows(plan, ln, x, (ax,))
        # written in the rows' layout (the axis last), then moved into place if needed
        perm = [d for d in range(x.ndim) if d != ax] + [ax]
        moved = tuple(x.shape[d] for d in perm)
        tmp = alloc(plan, ln, moved, res, self.name) if (ax != x.ndim - 1 or not dst.is_contiguous) else dst
        o = half_view(view(tmp, (m, k), (k * isz, isz)))
        launch(plan, ln, _cumsum_kernel(acc, res, x.dtype), (out_partition(o), half_view(rows), k, m))
        if tmp is not dst:
            inverse = [perm.index(d) for d in range(x.ndim)]
            copy_into(plan, ln, dst, tmp.transpose(inverse), self.name)
        return finish(plan, ln, result, self.name)


def cumsum(x: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> Cumsum:
    name = "ops.cumsum"
    if axis is not None and not is_int(axis):
        raise TypeError(f"{name}: axis must be an int or None, not {axis!r}")
    dt = None if dtype is None else as_dtype(dtype)
    return Cumsum((operand(x, name), None if axis is None else int(axis), dt, None if out is None else operand(out, name)))
