"""Sorting along an axis: sort, argsort, topk.

One block of 256 threads per row of the ``(rows, cols)`` view (the axis moved last): the
row's values and their column indices are copied into scratch memory padded to a power
of two and sorted there by a bitonic network (each stage one pass of the block over
the row, a barrier between stages); the first columns are then copied into place.

The order is total and stable: by value, ties by index (numpy's ``kind="stable"``),
NaN after every number; ``topk`` orders largest first (NaN first, as the largest,
ties by index). Scratch: ``rows * 2**ceil(log2(n)) * (itemsize + 8)`` bytes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_int
from .._plan import Lane, Plan
from .._tensor import Tensor, normalize_axis
from ._codegen import row_kernel
from ._core import TensorOp, alloc, check_out, launch, operand, out_partition, output, view
from ._elementwise import contiguous, copy_into, finish
from ._reduce import _as_rows

__all__ = ["Sort", "sort", "topk"]

_I64 = np.dtype(np.int64)


def _np_name(dt: np.dtype[Any]) -> str:
    return "bool_" if dt == np.bool_ else dt.name


def _before(r: str, va: str, ia: str, vb: str, ib: str, desc: bool) -> list[str]:
    """Statements setting ``r`` to whether the entry of value ``va`` and index ``ia``
    comes before the entry (``vb``, ``ib``); index -1 is padding, always last."""
    if desc:
        nan, order = f"({vb} == {vb}) or ({va} != {va} and {ia} < {ib})", f"{va} > {vb}"
    else:
        nan, order = f"({va} == {va}) or ({vb} != {vb} and {ia} < {ib})", f"{va} < {vb}"
    return [
        f"if {ia} < 0:",
        f"    {r} = False",
        f"elif {ib} < 0:",
        f"    {r} = True",
        f"elif {va} != {va} or {vb} != {vb}:",
        f"    {r} = {nan}",
        f"elif {va} == {vb}:",
        f"    {r} = {ia} < {ib}",
        "else:",
        f"    {r} = {order}",
    ]


@functools.cache  # the kernel source is built once per key
def _sort_kernel(dtype: np.dtype[Any], desc: bool) -> Any:
    body = [
        "c = t_",
        "while c < p:",
        "    if c < k:",
        "        sv[row, c] = x[row, c]",
        "        si[row, c] = c",
        "    else:",
        "        si[row, c] = -1",
        "    c += 256",
        "cuda.syncthreads()",
        "size = 2",
        "while size <= p:",
        "    st = size // 2",
        "    while st > 0:",
        "        c = t_",
        "        while c < p // 2:",
        "            ia = (c // st) * 2 * st + (c % st)",
        "            ib = ia + st",
        "            va = sv[row, ia]",
        "            vb = sv[row, ib]",
        "            ja = si[row, ia]",
        "            jb = si[row, ib]",
        *(f"            {line}" for line in _before("ab", "va", "ja", "vb", "jb", desc)),
        *(f"            {line}" for line in _before("ba", "vb", "jb", "va", "ja", desc)),
        "            up = (ia & size) == 0",
        "            if (up and ba) or ((not up) and ab):",
        "                sv[row, ia] = vb",
        "                sv[row, ib] = va",
        "                si[row, ia] = jb",
        "                si[row, ib] = ja",
        "            c += 256",
        "        cuda.syncthreads()",
        "        st //= 2",
        "    size *= 2",
    ]

    def sim(sv: np.ndarray, si: np.ndarray, x: np.ndarray, k: int, p: int, m: int) -> None:
        if desc:  # stable descending: the stable ascending order of the reversed row, reversed
            order = (k - 1 - np.argsort(x[:, ::-1], axis=1, kind="stable"))[:, ::-1]
        else:
            order = np.argsort(x, axis=1, kind="stable")
        si[:, :k] = order
        si[:, k:] = -1
        sv[:, :k] = np.take_along_axis(x, order, 1)

    key = ("sort", dtype.str, desc)
    return row_kernel("sort", ["sv", "si", "x", "k", "p", "m"], body, {}, sim, key)


class Sort(TensorOp):
    """sort / argsort along ``axis`` (None: the flattened tensor), and topk along the
    last axis: arguments ``(x, axis, count, out)`` (count: topk's k, else None)."""

    __slots__ = ("_desc", "_kind", "name")
    _cacheable = True

    def __init__(self, kind: str, desc: bool, args: tuple[Any, ...]) -> None:
        self._kind = kind
        self._desc = desc
        self.name = f"ops.{kind}"
        super().__init__(args)
        if kind == "topk":
            self._arity = 2  # (values, indices): op.unzip() needs no count

    def _layout(self, x: Any, axis: int | None, count: int | None) -> tuple[tuple[int, ...], int | None, int]:
        """(result shape, axis normalized, number of results along it)."""
        name = self.name
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: needs a tensor, got {arg_type(x)}")
        if x.dtype == BFLOAT16 or x.dtype.kind not in "biuf":
            raise TypeError(f"{name}: tensors of dtype {x.dtype} are not supported (convert with astype)")
        if axis is None:
            return (x.size,), None, x.size
        if x.ndim == 0:
            raise ValueError(f"{name}: a 0-d tensor has no axis to sort along; use axis=None")
        ax = normalize_axis(axis, x.ndim)
        n = x.shape[ax]
        if count is None:
            return x.shape, ax, n
        if not 0 <= count <= n:
            raise ValueError(f"{name}: k={count} is out of range for an axis of size {n}")
        return (*x.shape[:ax], count, *x.shape[ax + 1 :]), ax, count

    def _outs(self, out: Any) -> tuple[Any, Any]:
        """(values out=, indices out=) of the op."""
        if self._kind == "topk":
            if out is None:
                return None, None
            return out[0], out[1]
        return (out, None) if self._kind == "sort" else (None, out)

    def _check(self, *args: Any) -> None:
        x, axis, count, out = args
        shape, _, _ = self._layout(x, axis, count)
        vo, io = self._outs(out)
        if vo is not None:
            check_out(self.name, vo, shape, x.dtype, x.device)
        if io is not None:
            check_out(self.name, io, shape, _I64, x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Any:
        x, axis, count, out = args
        name = self.name
        shape, ax, kout = self._layout(x, axis, count)
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        vo, io = self._outs(out)
        want_v = self._kind in ("sort", "topk")
        want_i = self._kind in ("argsort", "topk")
        vres = output(plan, ln, name, vo, shape, x.dtype, x.device, (x,)) if want_v else None
        ires = output(plan, ln, name, io, shape, _I64, x.device, (x,)) if want_i else None
        if math.prod(shape) != 0:
            if ax is None:
                xc = contiguous(plan, ln, x)
                rows, m, k = view(xc, (1, x.size), (x.size * x.dtype.itemsize, x.dtype.itemsize)), 1, x.size
                perm = [0]
            else:
                rows, m, k = _as_rows(plan, ln, x, (ax,))
                perm = [d for d in range(x.ndim) if d != ax] + [ax]
            p = 1 << max(0, (k - 1).bit_length())
            isz = x.dtype.itemsize
            sv = alloc(plan, ln, (m, p), x.dtype, name)
            si = alloc(plan, ln, (m, p), _I64, name)
            launch(plan, ln, _sort_kernel(x.dtype, self._desc), (out_partition(sv), out_partition(si), rows, k, p, m))
            lead = tuple(shape[d] for d in perm[:-1])
            for res, scratch, size in ((vres, sv, isz), (ires, si, 8)):
                if res is None:
                    continue
                # the first kout columns of the scratch rows, seen in the result's moved order
                steps, acc = [], p * size
                for n in reversed(lead):
                    steps.append(acc)
                    acc *= n
                src = view(scratch, (*lead, kout), (*reversed(steps), size))
                copy_into(plan, ln, res.t.transpose(perm), src, name)
        v = finish(plan, ln, vres, name) if vres is not None else None
        i = finish(plan, ln, ires, name) if ires is not None else None
        if self._kind == "topk":
            return (v, i)
        return v if self._kind == "sort" else i


class _TopK(Sort):
    __slots__ = ()
    _cacheable = False  # its output is a tuple (a recipe replays one tensor)


def _axis_arg(name: str, axis: Any) -> int | None:
    if axis is None:
        return None
    if not is_int(axis):
        raise TypeError(f"{name}: axis must be an int or None, not {axis!r}")
    return int(axis)


def sort(kind: str, x: Any, axis: Any = -1, out: Any = None) -> Sort:
    name = f"ops.{kind}"
    return Sort(kind, False, (operand(x, name), _axis_arg(name, axis), None, None if out is None else operand(out, name)))


def topk(x: Any, k: Any, largest: bool = True, out: Any = None) -> Sort:
    name = "ops.topk"
    if not is_int(k) or isinstance(k, bool):
        raise TypeError(f"{name}: k must be an int, not {k!r}")
    if out is not None:
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
            raise TypeError(f"{name}: out= must be a tuple of two tensors (values, indices), not {arg_type(out)}")
    return _TopK("topk", bool(largest), (operand(x, name), -1, int(k), out))
