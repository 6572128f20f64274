"""Reductions (sum, mean, prod, max, min, argmax, argmin, any, all), softmax / log_softmax
(layer_norm and rms_norm are in :mod:`._norm`).

All of them run one block of 256 threads per *row* of a ``(rows, cols)`` view: the
reduced axes are moved last (a view when the memory allows, else a contiguous copy),
each thread walks its columns with a stride of 256, and the block combines the partial
results in shared memory. Accumulation is in float32 for half types and float32, in
float64 for float64, and in int64/uint64 for integer sums (numpy's dtypes).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_int
from .._plan import Lane, Plan
from .._tensor import Tensor, normalize_axis
from ._codegen import bf16_to_f32, block_reduce, f32_to_bf16, half_view, row_kernel, row_loop, store_expr
from ._core import TensorOp, alloc, check_out, launch, operand, out_partition, output
from ._elementwise import contiguous, copy_into, finish
from ._layout import compute_dtype, one_stride, view

__all__ = ["Reduce", "Softmax"]

_MAX = "({p} if ({p} >= {q} or {p} != {p}) else {q})"
_MIN = "({p} if ({p} <= {q} or {p} != {p}) else {q})"


def _np_name(dt: np.dtype[Any]) -> str:
    if dt == BFLOAT16:
        return "uint16"  # kernels see bfloat16 as its bits (see _codegen.half_view)
    return "bool_" if dt == np.bool_ else dt.name


def _ld(src: str, bf16: bool) -> str:
    """Source loading element ``src`` into the accumulator type ``A``."""
    return f"A(BF16_IN({src}))" if bf16 else f"A({src})"


def _st(value: str, res: np.dtype[Any]) -> str:
    return store_expr(value, res)


def _unrolls(bf16: bool) -> tuple[int, int]:
    """Columns per thread per step of the row loops that only read, and that also write:
    8 and 4 (see _codegen.row_loop); twice as many for bfloat16, whose 2-byte loads would
    otherwise keep half the bytes in flight."""
    return (16, 8) if bf16 else (8, 4)


def _host_in(x: np.ndarray, bf16: bool, a_t: Any) -> Any:
    """A kernel argument's values (numpy twin), bfloat16 bits decoded, as ``a_t``."""
    return (bf16_to_f32(x) if bf16 else x).astype(a_t)


def _host_out(out: np.ndarray, r: Any, res: np.dtype[Any]) -> None:
    if res == BFLOAT16:
        np.copyto(out, f32_to_bf16(np.broadcast_to(r, out.shape)))
    else:
        np.copyto(out, r, casting="unsafe")


def _axes(name: str, axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    items = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    out = tuple(normalize_axis(a, ndim) for a in items)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: repeated axis in {axis!r}")
    return out


def _as_rows(plan: Plan, lane: Lane, x: Tensor, axes: Sequence[int]) -> tuple[Tensor, int, int]:
    """``x`` as a (rows, cols) view with the ``axes`` as the columns (C order within each
    part), copying to contiguous memory when the memory does not allow a view."""
    keep = [d for d in range(x.ndim) if d not in axes]
    perm = keep + list(axes)
    xt = x.transpose(perm)
    m = math.prod(xt.shape[: len(keep)])
    k = math.prod(xt.shape[len(keep) :])
    strides = (
        one_stride(xt.shape[: len(keep)], xt.strides[: len(keep)]),
        one_stride(xt.shape[len(keep) :], xt.strides[len(keep) :]),
    )
    if strides[0] is None or strides[1] is None:
        xt = contiguous(plan, lane, xt)
        isz = x.dtype.itemsize
        return view(xt, (m, k), (k * isz, isz)), m, k
    return view(xt, (m, k), (strides[0], strides[1])), m, k


def _check_float(name: str, x: Tensor) -> None:
    if x.dtype.kind != "f" and x.dtype != BFLOAT16:
        raise TypeError(f"{name}: needs a floating tensor, got {x.dtype}")


# -- sum, mean, prod, max, min, argmax, argmin, any, all ----------------------------------------------------------------
def _reduce_dtypes(kind: str, dt: np.dtype[Any]) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(accumulator dtype, result dtype) of reduction ``kind`` over ``dt`` (numpy's results)."""
    if dt == BFLOAT16:  # as numpy's float16: accumulated in float32, bfloat16 results
        f32 = np.dtype(np.float32)
        if kind in ("argmax", "argmin"):
            return f32, np.dtype(np.int64)
        if kind in ("any", "all"):
            return np.dtype(np.uint8), np.dtype(np.bool_)
        return f32, dt
    z = np.zeros(1, dt)
    if kind == "sum":
        res = z.sum().dtype
        acc = compute_dtype(res)
    elif kind == "mean":
        res = z.mean().dtype
        acc = np.dtype(np.float64) if res == np.float64 or dt.kind in "biu" else np.dtype(np.float32)
    elif kind == "prod":
        res = z.prod().dtype
        acc = compute_dtype(res)
    elif kind in ("any", "all"):
        res = np.dtype(np.bool_)
        acc = np.dtype(np.uint8)
    elif kind in ("argmax", "argmin"):
        res = np.dtype(np.int64)
        acc = compute_dtype(dt) if dt != np.bool_ else np.dtype(np.uint8)
    else:
        res = dt
        acc = compute_dtype(dt) if dt != np.bool_ else np.dtype(np.uint8)
    return acc, res


def _init(kind: str, acc: np.dtype[Any]) -> str:
    if kind in ("sum", "mean", "any"):
        return "A(0)"
    if kind in ("prod", "all"):
        return "A(1)"
    if acc.kind == "f":
        return "A(-math.inf)" if kind in ("max", "argmax") else "A(math.inf)"
    info = np.iinfo(acc)
    return f"A({info.min})" if kind in ("max", "argmax") else f"A({info.max})"


@functools.cache  # the kernel source is built once per key
def _reduce_kernel(kind: str, acc: np.dtype[Any], res: np.dtype[Any], bf16: bool = False) -> Any:
    """``bf16``: the input is bfloat16 (its bits)."""
    a_t, o_t = getattr(np, _np_name(acc)), getattr(np, _np_name(res))
    if kind in ("argmax", "argmin"):
        # argmin is argmax with the order reversed (NaN still wins, the first one)
        gt = ">" if kind == "argmax" else "<"
        body = [
            "sv = cuda.shared.array(256, A)",
            "si = cuda.shared.array(256, np.int64)",
            f"best = {_init(kind, acc)}",
            "bi = np.int64(-1)",
            "c = t_",
            "while c < k:",
            f"    v = {_ld('x[row, c]', bf16)}",
            f"    if bi < 0 or (best == best and (v {gt} best or v != v)):",
            "        best = v",
            "        bi = c",
            "    c += 256",
            "sv[t_] = best",
            "si[t_] = bi",
            "cuda.syncthreads()",
            "s_ = 128",
            "while s_ > 0:",
            "    if t_ < s_:",
            "        pv = sv[t_]",
            "        pi = si[t_]",
            "        qv = sv[t_ + s_]",
            "        qi = si[t_ + s_]",
            "        take = False",
            "        if qi >= 0:",
            "            if pi < 0:",
            "                take = True",
            "            elif pv != pv:",
            "                take = qv != qv and qi < pi",
            f"            elif qv != qv or qv {gt} pv:",
            "                take = True",
            "            elif qv == pv:",
            "                take = qi < pi",
            "        if take:",
            "            sv[t_] = qv",
            "            si[t_] = qi",
            "    cuda.syncthreads()",
            "    s_ //= 2",
            "if t_ == 0:",
            "    out[row] = O(si[0])",
        ]

        np_arg = np.argmax if kind == "argmax" else np.argmin

        def sim(out: np.ndarray, x: np.ndarray, k: int, m: int) -> None:
            np.copyto(out, np_arg(_host_in(x, bf16, a_t), axis=1), casting="unsafe")

    else:
        combine = {
            "sum": "{p} + {q}",
            "mean": "{p} + {q}",
            "prod": "{p} * {q}",
            "max": _MAX,
            "min": _MIN,
            "any": _MAX,
            "all": _MIN,
        }[kind]
        final = "acc / A(k)" if kind == "mean" else "acc"

        # any and all load truth values (NaN is true), as numpy's
        def load(src: str) -> str:
            if kind in ("any", "all"):
                return f"A(BF16_IN({src}) != 0)" if bf16 else f"A({src} != 0)"
            return _ld(src, bf16)

        body = [
            "sm = cuda.shared.array(256, A)",
            f"acc = {_init(kind, acc)}",
            *row_loop(
                lambda c, j: [f"v{j} = {load(f'x[row, {c}]')}"],
                lambda c, j: [f"acc = {combine.format(p='acc', q='v' + j)}"],
                8,
            ),
            *block_reduce("acc", combine),
            "if t_ == 0:",
            f"    out[row] = {_st(final, res)}",
        ]
        fns: dict[str, Callable[..., Any]] = {
            "sum": np.sum,
            "mean": np.sum,
            "prod": np.prod,
            "max": np.max,
            "min": np.min,
            "any": np.any,
            "all": np.all,
        }
        np_fn = fns[kind]

        def sim(out: np.ndarray, x: np.ndarray, k: int, m: int) -> None:
            with np.errstate(all="ignore"):
                if k == 0 and kind in ("sum", "mean", "prod", "any", "all"):
                    r = np.full(out.shape, 1 if kind in ("prod", "all") else 0, a_t)
                elif kind in ("any", "all"):
                    r = np_fn((bf16_to_f32(x) if bf16 else x) != 0, axis=1)
                else:
                    r = np_fn(_host_in(x, bf16, a_t), axis=1)
                if kind == "mean":
                    r = r / a_t(k)
            _host_out(out, r, res)

    return row_kernel(kind, ["out", "x", "k", "m"], body, {"A": a_t, "O": o_t}, sim, ("reduce", kind, acc.str, res.str, bf16))


class Reduce(TensorOp):
    __slots__ = ("_kind", "name")
    _cacheable = True

    def __init__(self, kind: str, args: tuple[Any, ...]) -> None:
        self._kind = kind
        self.name = f"ops.{kind}"
        super().__init__(args)

    def _shape(self, x: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(reduced axes, result shape)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{self.name}: needs a tensor, got {arg_type(x)}")
        if x.dtype != BFLOAT16 and x.dtype.kind not in "biuf":
            raise TypeError(f"{self.name}: tensors of dtype {x.dtype} are not supported (convert with astype)")
        if self._kind in ("argmax", "argmin") and isinstance(axis, (tuple, list)):
            raise TypeError(f"{self.name}: axis must be an int or None")
        axes = _axes(self.name, axis, x.ndim)
        if self._kind in ("max", "min", "argmax", "argmin") and any(x.shape[a] == 0 for a in axes):
            raise ValueError(f"{self.name}: a reduction over a zero-size axis has no identity")
        if keepdims:
            shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
        else:
            shape = tuple(n for d, n in enumerate(x.shape) if d not in axes)
        return axes, shape

    def _check(self, *args: Any) -> None:
        x, axis, keepdims, out = args
        _, shape = self._shape(x, axis, keepdims)
        if out is not None:
            check_out(self.name, out, shape, _reduce_dtypes(self._kind, x.dtype)[1], x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, axis, keepdims, out = args
        axes, shape = self._shape(x, axis, keepdims)
        acc, res = _reduce_dtypes(self._kind, x.dtype)
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        result = output(plan, ln, self.name, out, shape, res, x.device, (x,))
        dst = result.t
        if self._kind in ("argmax", "argmin") and axis is None:
            rows = view(contiguous(plan, ln, x), (1, x.size), (x.size * x.dtype.itemsize, x.dtype.itemsize))
            m, k = 1, x.size
        else:
            rows, m, k = _as_rows(plan, ln, x, axes)
        if m == 0:
            return finish(plan, ln, result, self.name)
        flat = dst if dst.is_contiguous else alloc(plan, ln, shape, res, self.name)
        o = half_view(view(flat, (m,), (res.itemsize,)))
        kernel = _reduce_kernel(self._kind, acc, res, x.dtype == BFLOAT16)
        launch(plan, ln, kernel, (out_partition(o), half_view(rows), k, m))
        if flat is not dst:
            copy_into(plan, ln, dst, flat, self.name)
        return finish(plan, ln, result, self.name)


def reduce(kind: str, x: Any, axis: Any = None, keepdims: bool = False, out: Any = None) -> Reduce:
    name = f"ops.{kind}"
    if axis is not None and not (is_int(axis) or (isinstance(axis, (tuple, list)) and all(is_int(a) for a in axis))):
        raise TypeError(f"{name}: axis must be an int, a tuple of ints or None, not {axis!r}")
    return Reduce(kind, (operand(x, name), axis, bool(keepdims), None if out is None else operand(out, name)))


# -- softmax, log_softmax ---------------------------------------------------------------------------
@functools.cache  # the kernel source is built once per key
def _softmax_kernel(log: bool, acc: np.dtype[Any], res: np.dtype[Any]) -> Any:
    a_t, o_t = getattr(np, _np_name(acc)), getattr(np, _np_name(res))
    bf16 = res == BFLOAT16  # the input's dtype too
    reads, writes = _unrolls(bf16)
    write = _st("v{j} - ls", res) if log else _st("math.exp(v{j}) * rs", res)
    body = [
        "sm = cuda.shared.array(256, A)",
        "mx = A(-math.inf)",
        *row_loop(
            lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)}"], lambda c, j: [f"mx = {_MAX.format(p='mx', q='v' + j)}"], reads
        ),
        *block_reduce("mx", _MAX),
        "s = A(0)",
        *row_loop(lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)} - mx"], lambda c, j: [f"s += math.exp(v{j})"], reads),
        *block_reduce("s", "{p} + {q}"),
        "ls = math.log(s)",
        "rs = A(1) / s",
        *row_loop(
            lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)} - mx"],
            lambda c, j: [f"out[row, {c}] = {write.format(j=j)}"],
            writes,
        ),
    ]

    def sim(out: np.ndarray, x: np.ndarray, k: int, m: int) -> None:
        with np.errstate(all="ignore"):
            v = _host_in(x, bf16, a_t)
            v = v - np.max(v, axis=1, keepdims=True)
            s = np.sum(np.exp(v), axis=1, keepdims=True)
            r = v - np.log(s) if log else np.exp(v) / s
        _host_out(out, r, res)

    return row_kernel(
        "log_softmax" if log else "softmax",
        ["out", "x", "k", "m"],
        body,
        {"A": a_t, "O": o_t},
        sim,
        ("softmax", log, acc.str, res.str),
    )


class Softmax(TensorOp):
    __slots__ = ("_log", "name")
    _cacheable = True

    def __init__(self, log: bool, args: tuple[Any, ...]) -> None:
        self._log = log
        self.name = "ops.log_softmax" if log else "ops.softmax"
        super().__init__(args)

    def _check(self, *args: Any) -> None:
        x, axis, out = args
        if not isinstance(x, Tensor):
            raise TypeError(f"{self.name}: needs a tensor, got {arg_type(x)}")
        _check_float(self.name, x)
        if x.ndim == 0:
            raise ValueError(f"{self.name}: needs at least one dimension")
        normalize_axis(axis, x.ndim)
        if out is not None:
            check_out(self.name, out, x.shape, x.dtype, x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, axis, out = args
        ax = normalize_axis(axis, x.ndim)
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        result = output(plan, ln, self.name, out, x.shape, x.dtype, x.device, (x,), inplace_ok=True)
        dst = result.t
        if x.size == 0:
            return finish(plan, ln, result, self.name)
        rows, m, k = _as_rows(plan, ln, x, (ax,))
        # The result is written in the rows' layout, then moved into place if needed.
        perm = [d for d in range(x.ndim) if d != ax] + [ax]
        moved_shape = tuple(x.shape[d] for d in perm)
        tmp = alloc(plan, ln, moved_shape, x.dtype, self.name) if (ax != x.ndim - 1 or not dst.is_contiguous) else dst
        isz = x.dtype.itemsize
        o = half_view(view(tmp, (m, k), (k * isz, isz)))
        acc = compute_dtype(x.dtype)
        launch(plan, ln, _softmax_kernel(self._log, acc, x.dtype), (out_partition(o), half_view(rows), k, m))
        if tmp is not dst:
            inverse = [perm.index(d) for d in range(x.ndim)]
            copy_into(plan, ln, dst, tmp.transpose(inverse), self.name)
        return finish(plan, ln, result, self.name)


def softmax(x: Any, axis: Any = -1, *, log: bool = False, out: Any = None) -> Softmax:
    name = "ops.log_softmax" if log else "ops.softmax"
    if not is_int(axis):
        raise TypeError(f"{name}: axis must be an int, not {axis!r}")
    return Softmax(log, (operand(x, name), int(axis), None if out is None else operand(out, name)))
