"""Reductions of two passes over each row: var and std (with ``ddof``), logsumexp.

They reduce as :class:`~._reduce.Reduce` does (the axes moved last, one block of 256
threads per row, the same argument rules), but each row is read twice: the mean (or
the maximum) first, then the squared deviations from it (or the exponentials shifted
by it), which keeps the result exact where one pass would cancel or overflow.
Integers and bools give float64, floats keep their dtype (numpy's ``var``, scipy's
``logsumexp``); half types accumulate in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .._checks import BFLOAT16, is_int, is_scalar
from .._plan import Lane, Plan
from .._tensor import Tensor
from ._codegen import block_reduce, half_view, row_kernel, row_loop
from ._core import alloc, check_out, launch, operand, out_partition, output
from ._elementwise import copy_into, finish
from ._layout import compute_dtype, view
from ._reduce import Reduce, _as_rows, _host_in, _host_out, _ld, _np_name, _st

__all__ = ["Stat", "logsumexp", "stat"]

_MAX = "({p} if ({p} >= {q} or {p} != {p}) else {q})"


def _dtypes(dt: np.dtype[Any]) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(accumulator dtype, result dtype)."""
    if dt == BFLOAT16:  # accumulated in float32, rounded once into bfloat16
        return np.dtype(np.float32), dt
    res = dt if dt.kind == "f" else np.dtype(np.float64)
    return compute_dtype(res), res


@functools.cache  # the kernel source is built once per key
def _stat_kernel(kind: str, acc: np.dtype[Any], res: np.dtype[Any]) -> Any:
    a_t, o_t = getattr(np, acc.name), getattr(np, _np_name(res))
    bf16 = res == BFLOAT16  # the input's dtype too
    if kind in ("var", "std"):
        body = [
            "sm = cuda.shared.array(256, A)",
            "s = A(0)",
            *row_loop(lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)}"], lambda c, j: [f"s += v{j}"], 8),
            *block_reduce("s", "{p} + {q}"),
            "mean = s / A(k) if k > 0 else A(math.nan)",
            "q = A(0)",
            *row_loop(lambda c, j: [f"d{j} = {_ld(f'x[row, {c}]', bf16)} - mean"], lambda c, j: [f"q += d{j} * d{j}"], 8),
            *block_reduce("q", "{p} + {q}"),
            # numpy divides by max(k - ddof, 0): by zero, inf (or NaN for a zero sum)
            "dn = A(k) - A(dd)",
            "if dn > A(0):",
            "    r = q / dn",
            "elif q > A(0):",
            "    r = A(math.inf)",
            "else:",
            "    r = A(math.nan)",
            *(["r = math.sqrt(r)"] if kind == "std" else []),
            "if t_ == 0:",
            f"    out[row] = {_st('r', res)}",
        ]

        def sim(out: np.ndarray, x: np.ndarray, dd: float, k: int, m: int) -> None:
            with np.errstate(all="ignore"):
                if k == 0:
                    r = np.full(out.shape, np.nan, a_t)
                else:
                    v = _host_in(x, bf16, a_t)
                    d = v - v.mean(axis=1, keepdims=True)
                    r = (d * d).sum(axis=1) / a_t(max(k - dd, 0))
                    if kind == "std":
                        r = np.sqrt(r)
            _host_out(out, r, res)

    else:  # logsumexp
        body = [
            "sm = cuda.shared.array(256, A)",
            "mx = A(-math.inf)",
            *row_loop(
                lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)}"], lambda c, j: [f"mx = {_MAX.format(p='mx', q='v' + j)}"], 8
            ),
            *block_reduce("mx", _MAX),
            # shifted by a finite maximum (an infinite or NaN one gives itself below)
            "sh = mx if (mx - mx) == (mx - mx) else A(0)",
            "s = A(0)",
            *row_loop(lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)} - sh"], lambda c, j: [f"s += math.exp(v{j})"], 8),
            *block_reduce("s", "{p} + {q}"),
            "r = sh + math.log(s) if s > A(0) else A(-math.inf)",
            "if mx != mx:",
            "    r = mx",
            "if t_ == 0:",
            f"    out[row] = {_st('r', res)}",
        ]

        def sim(out: np.ndarray, x: np.ndarray, dd: float, k: int, m: int) -> None:
            with np.errstate(all="ignore"):
                v = _host_in(x, bf16, a_t)
                mx = np.max(v, axis=1, keepdims=True) if k else np.full((m, 1), -np.inf, a_t)
                sh = np.where(np.isfinite(mx), mx, a_t(0))
                s = np.sum(np.exp(v - sh), axis=1, keepdims=True)
                r = np.where(s > 0, sh + np.log(s), a_t(-np.inf))
                r = np.where(np.isnan(mx), mx, r)[:, 0]
            _host_out(out, r, res)

    return row_kernel(kind, ["out", "x", "dd", "k", "m"], body, {"A": a_t, "O": o_t}, sim, ("stat", kind, acc.str, res.str))


class Stat(Reduce):
    """var / std / logsumexp: arguments ``(x, axis, keepdims, out, ddof)``."""

    __slots__ = ()

    def _check(self, *args: Any) -> None:
        x, axis, keepdims, out, _ddof = args
        _, shape = self._shape(x, axis, keepdims)
        if out is not None:
            check_out(self.name, out, shape, _dtypes(x.dtype)[1], x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, axis, keepdims, out, ddof = args
        axes, shape = self._shape(x, axis, keepdims)
        acc, res = _dtypes(x.dtype)
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        result = output(plan, ln, self.name, out, shape, res, x.device, (x,))
        dst = result.t
        rows, m, k = _as_rows(plan, ln, x, axes)
        if m == 0:
            return finish(plan, ln, result, self.name)
        flat = dst if dst.is_contiguous else alloc(plan, ln, shape, res, self.name)
        o = half_view(view(flat, (m,), (res.itemsize,)))
        launch(plan, ln, _stat_kernel(self._kind, acc, res), (out_partition(o), half_view(rows), float(ddof), k, m))
        if flat is not dst:
            copy_into(plan, ln, dst, flat, self.name)
        return finish(plan, ln, result, self.name)


def _axis(name: str, axis: Any) -> Any:
    if axis is not None and not (is_int(axis) or (isinstance(axis, (tuple, list)) and all(is_int(a) for a in axis))):
        raise TypeError(f"{name}: axis must be an int, a tuple of ints or None, not {axis!r}")
    return tuple(axis) if isinstance(axis, list) else axis


def stat(kind: str, x: Any, axis: Any = None, ddof: Any = 0, keepdims: bool = False, out: Any = None) -> Stat:
    name = f"ops.{kind}"
    if not is_scalar(ddof) or isinstance(ddof, (bool, np.bool_, complex, np.complexfloating)):
        raise TypeError(f"{name}: ddof must be a real number, not {ddof!r}")
    if not math.isfinite(float(ddof)):
        raise ValueError(f"{name}: ddof must be finite, not {ddof!r}")
    d = float(ddof)
    return Stat(kind, (operand(x, name), _axis(name, axis), bool(keepdims), None if out is None else operand(out, name), d))


def logsumexp(x: Any, axis: Any = None, keepdims: bool = False, out: Any = None) -> Stat:
    name = "ops.logsumexp"
    return Stat(
        "logsumexp", (operand(x, name), _axis(name, axis), bool(keepdims), None if out is None else operand(out, name), 0.0)
    )
