"""Sorting along an axis: sort, argsort, topk.

One block of 256 threads per row of the ``(rows, cols)`` view (the axis moved last), in
place in the result: a bitonic network of compare-exchanges that always put the first
of the two entries first (each merge begins by comparing mirrored pairs), so the
entries past the row's end, virtually last, never move and need no memory. ``sort``
sorts the values themselves; ``argsort`` sorts column indices, comparing the values they
point at; ``topk`` sorts the indices of the whole row into scratch memory and gathers
the first ``k`` values.

The order is total and stable: by value, ties by index (numpy's ``kind="stable"``),
NaN after every number; ``topk`` orders largest first (NaN first, as the largest, ties
by index). bfloat16 and float16 values are compared as float32 (exactly their values)
and moved as they are. ``sort`` and ``argsort`` with ``out=`` along the last axis allocate nothing,
so they can be captured into a graph.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_int
from .._op import TensorValuedOp
from .._plan import Lane, Plan
from .._tensor import Tensor, normalize_axis
from ._codegen import bf16_to_f32, half_view, row_kernel
from ._core import LibraryOp, alloc, check_out, launch, operand, out_partition, output
from ._elementwise import contiguous, copy_into, finish
from ._gather import gather_kernel
from ._layout import view
from ._reduce import _as_rows

__all__ = ["Sort", "sort", "topk"]

_I64 = np.dtype(np.int64)


def _before(r: str, va: str, ia: str | None, vb: str, ib: str | None, desc: bool) -> list[str]:
    """Statements setting ``r`` to whether the entry of value ``va`` and index ``ia``
    comes before the entry (``vb``, ``ib``) (``ia``/``ib`` None: values only)."""
    tie = f"{ia} < {ib}" if ia is not None else "False"
    if desc:
        nan, order = f"({vb} == {vb}) or ({va} != {va} and {tie})", f"{va} > {vb}"
    else:
        nan, order = f"({va} == {va}) or ({vb} != {vb} and {tie})", f"{va} < {vb}"
    return [
        f"if {va} != {va} or {vb} != {vb}:",
        f"    {r} = {nan}",
        f"elif {va} == {vb}:",
        f"    {r} = {tie}",
        "else:",
        f"    {r} = {order}",
    ]


def _exchange(indices: bool, desc: bool, half: str | None) -> list[str]:
    """The compare-exchange of positions ``pa < pb`` of the row (``pb < k``); ``half``:
    ``"bf16"`` (the values are bfloat16 bits) or ``"f16"``, compared as float32 and moved
    as they are."""
    if not indices:
        return [
            "ua = buf[row, pa]",
            "ub = buf[row, pb]",
            f"va = {_value('ua', half)}",
            f"vb = {_value('ub', half)}",
            *_before("ba", "vb", None, "va", None, desc),
            "if ba:",
            "    buf[row, pa] = ub",
            "    buf[row, pb] = ua",
        ]
    return [
        "ja = buf[row, pa]",
        "jb = buf[row, pb]",
        f"va = {_value('x[row, ja]', half)}",
        f"vb = {_value('x[row, jb]', half)}",
        *_before("ba", "vb", "jb", "va", "ja", desc),
        "if ba:",
        "    buf[row, pa] = jb",
        "    buf[row, pb] = ja",
    ]


def _value(src: str, half: str | None) -> str:
    # float16 compared as float16 would call numba's C++ half operators, which a kernel
    # linked from its PTX alone cannot resolve; as float32 the order is the same
    if half == "bf16":
        return f"BF16_IN({src})"
    return f"np.float32({src})" if half == "f16" else src


@functools.cache  # the kernel source is built once per key
def _sort_kernel(dtype: np.dtype[Any], indices: bool, desc: bool) -> Any:
    """Sort each row of ``buf`` (m, k) in place: the values of ``x`` (``indices``
    False), or the indices 0..k-1 by the values of ``x`` they point at. ``hp`` is half
    the power of two >= k: the pairs of one step of the network. bfloat16 values come
    as their bits (see half_view)."""
    bf16 = dtype == BFLOAT16
    exchange = _exchange(indices, desc, "bf16" if bf16 else "f16" if dtype == np.float16 else None)
    body = [
        "c = t_",
        "while c < k:",
        f"    buf[row, c] = {'c' if indices else 'x[row, c]'}",
        "    c += 256",
        "cuda.syncthreads()",
        "size = 2",
        "while size // 2 < k:",
        "    half = size // 2",
        "    c = t_",
        "    while c < hp:",  # the merge's first step: mirrored pairs of each block of size
        "        blk = c // half",
        "        off = c - blk * half",
        "        pa = blk * size + off",
        "        pb = blk * size + size - 1 - off",
        "        if pb < k:",
        *(f"            {line}" for line in exchange),
        "        c += 256",
        "    cuda.syncthreads()",
        "    st = half // 2",
        "    while st > 0:",
        "        c = t_",
        "        while c < hp:",
        "            pa = (c // st) * 2 * st + (c % st)",
        "            pb = pa + st",
        "            if pb < k:",
        *(f"                {line}" for line in exchange),
        "            c += 256",
        "        cuda.syncthreads()",
        "        st //= 2",
        "    size *= 2",
    ]

    def sim(buf: np.ndarray, x: np.ndarray, k: int, hp: int, m: int) -> None:
        v = bf16_to_f32(x) if bf16 else x
        if desc:  # stable descending: the stable ascending order of the reversed row, reversed
            order = (k - 1 - np.argsort(v[:, ::-1], axis=1, kind="stable"))[:, ::-1]
        else:
            order = np.argsort(v, axis=1, kind="stable")
        np.copyto(buf, order if indices else np.take_along_axis(x, order, 1))

    key = ("sort", dtype.str, indices, desc)
    return row_kernel("sort", ["buf", "x", "k", "hp", "m"], body, {}, sim, key)


def _rows_out(plan: Plan, lane: Lane, dst: Tensor, perm: list[int], m: int, k: int, name: str) -> tuple[Tensor, Tensor | None]:
    """A (m, k) view to write the rows' results into: ``dst`` itself when it is
    contiguous in the rows' order, else a temporary (returned second, to copy back)."""
    moved = dst.transpose(perm)
    if moved.is_contiguous:
        isz = dst.dtype.itemsize
        return view(moved, (m, k), (k * isz, isz)), None
    tmp = alloc(plan, lane, (m, k), dst.dtype, name)
    return tmp, tmp


class _Sorting(LibraryOp):
    """sort / argsort along ``axis`` (None: the flattened tensor), and topk along the
    last axis: arguments ``(x, axis, count, out)`` (count: topk's k, else None)."""

    __slots__ = ("_desc", "_kind", "name")

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
        if x.dtype != BFLOAT16 and x.dtype.kind not in "biuf":
            raise TypeError(f"{name}: tensors of dtype {x.dtype} are not supported (convert with astype)")
        if axis is None:
            return (x.size,), None, x.size
        if x.ndim == 0:
            raise ValueError(
                f"{name}: a 0-d tensor has no axis to sort along" + ("; use axis=None" if name != "ops.topk" else "")
            )
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
        kind = self._kind
        vres = output(plan, ln, name, vo, shape, x.dtype, x.device, (x,)) if kind != "argsort" else None
        ires = output(plan, ln, name, io, shape, _I64, x.device, (x,)) if kind != "sort" else None
        if math.prod(shape) != 0:
            if ax is None:
                xc = contiguous(plan, ln, x)
                rows, m, k = view(xc, (1, x.size), (x.size * x.dtype.itemsize, x.dtype.itemsize)), 1, x.size
                perm = [0]
            else:
                rows, m, k = _as_rows(plan, ln, x, (ax,))
                perm = [d for d in range(x.ndim) if d != ax] + [ax]
            hp = 1 << max(0, (k - 1).bit_length() - 1)  # half the power of two >= k
            rows = half_view(rows)
            lead = tuple(shape[d] for d in perm[:-1])
            if kind == "sort":
                assert vres is not None
                buf, tmp = _rows_out(plan, ln, vres.t, perm, m, k, name)
                launch(plan, ln, _sort_kernel(x.dtype, False, False), (out_partition(half_view(buf)), rows, k, hp, m))
                if tmp is not None:
                    copy_into(plan, ln, vres.t.transpose(perm), tmp.reshape(*lead, k), name)
            elif kind == "argsort":
                assert ires is not None
                buf, tmp = _rows_out(plan, ln, ires.t, perm, m, k, name)
                launch(plan, ln, _sort_kernel(x.dtype, True, False), (out_partition(buf), rows, k, hp, m))
                if tmp is not None:
                    copy_into(plan, ln, ires.t.transpose(perm), tmp.reshape(*lead, k), name)
            else:  # topk: the whole row's order in scratch, then its first kout columns
                assert vres is not None and ires is not None
                order = alloc(plan, ln, (m, k), _I64, name)
                launch(plan, ln, _sort_kernel(x.dtype, True, self._desc), (out_partition(order), rows, k, hp, m))
                first = view(order, (m, kout), (k * 8, 8))
                vals, tmp = _rows_out(plan, ln, vres.t, perm, m, kout, name)
                gather = gather_kernel(2, 1, rows.dtype, _I64, False)  # (bfloat16: its bits)
                launch(plan, ln, gather, (out_partition(half_view(vals)), rows, first, m * kout))
                if tmp is not None:
                    copy_into(plan, ln, vres.t.transpose(perm), tmp.reshape(*lead, kout), name)
                steps, acc = [], k * 8
                for n in reversed(lead):
                    steps.append(acc)
                    acc *= n
                copy_into(plan, ln, ires.t.transpose(perm), view(order, (*lead, kout), (*reversed(steps), 8)), name)
        v = finish(plan, ln, vres, name) if vres is not None else None
        i = finish(plan, ln, ires, name) if ires is not None else None
        if kind == "topk":
            return (v, i)
        return v if kind == "sort" else i


class Sort(_Sorting, TensorValuedOp[Tensor]):
    """sort and argsort: a tensor."""

    __slots__ = ()
    _cacheable = True


class _TopK(_Sorting):
    """topk: a tuple (values, indices), no tensor methods."""

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


def topk(x: Any, k: Any, largest: bool = True, out: Any = None) -> _TopK:
    name = "ops.topk"
    if not is_int(k) or isinstance(k, bool):
        raise TypeError(f"{name}: k must be an int, not {k!r}")
    if out is not None:
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
            raise TypeError(f"{name}: out= must be a tuple of two tensors (values, indices), not {arg_type(out)}")
    return _TopK("topk", bool(largest), (operand(x, name), -1, int(k), out))
