"""Gathers: take, take_along_axis, embedding, and indexing by an integer tensor.

Every gather is one kernel: ``out[I] = x[I with I[axis] replaced by idx[I]]``, over the
output's shape, with ``x`` and ``idx`` seen as views of the output's rank (broadcast
where numpy broadcasts, an index of ``take`` flattened and broadcast along the other
axes). Negative indices wrap once, as numpy's (``-1`` is the last).

Indices live on the device, so only the device can check them: the kernel clamps an
index out of range to 0 (it never reads outside ``x``) and sets a flag with the index
in a small buffer of the submission; the flag is read back with the submission's
results, and a set flag fails the submission with ``IndexError`` naming the op, the
index and the axis. Inside a graph capture nothing can be read back: there the index
is clamped and not reported (check indices before capturing, or in the graph with
``ops.all((idx >= -n) & (idx < n))``).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_int
from .._op import DeviceOp, is_device_value
from .._plan import Lane, Plan
from .._tensor import Tensor, normalize_axis, plan_read_to_host
from ._codegen import _unravel, cached, elementwise_kernel, make_kernel
from ._core import TensorOp, alloc, check_out, flat_geometry, launch, operand, out_partition, output
from ._elementwise import contiguous, copy_into, finish
from ._layout import broadcast_shape, one_stride, view

__all__ = ["Gather", "embedding", "gather_kernel", "index", "take", "take_along_axis"]

_I64 = np.dtype(np.int64)


def gather_kernel(rank: int, axis: int, dtype: np.dtype[Any], idx_dtype: np.dtype[Any], flag: bool) -> Any:
    """``out[I] = x[I with I[axis] = wrap(ix[I])]`` over ``out``'s shape; an index out of
    range reads element 0 of the axis instead, and (``flag``) sets ``err = (1, index)``."""
    key = ("gather", rank, axis, dtype.str, idx_dtype.str, flag)

    def build() -> Any:
        fname = f"gather__{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"
        unravel, idx = _unravel(rank)
        lead = "0, " * (rank - 1)  # err is seen with out's rank: (1, ..., 1, 2)
        src_idx = ", ".join("v" if d == axis else f"i{d}" for d in range(rank)) if rank > 1 else "v"
        body = [
            *unravel,
            f"v = np.int64(ix[{idx}])",
            f"k = x.shape[{axis}]",
            "if v < 0:",
            "    v += k",
            "if v < 0 or v >= k:",
            *([f"    err[{lead}0] = 1", f"    err[{lead}1] = np.int64(ix[{idx}])"] if flag else []),
            "    v = 0",
            f"out[{idx}] = x[{src_idx}]",
        ]
        params = "out, err, x, ix, n" if flag else "out, x, ix, n"
        src = f"def {fname}({params}):\n    i = cuda.grid(1)\n    if i < n:\n"
        src += "".join(f"        {line}\n" for line in body)

        def sim(out: np.ndarray, *args: Any) -> None:
            err, x, ix, _ = args if flag else (None, *args)
            k = x.shape[axis]
            raw = np.asarray(ix)
            v = raw.astype(np.int64)
            v = np.where(v < 0, v + k, v)
            bad = (v < 0) | (v >= k)
            if bad.any():
                if err is not None:
                    e = err.reshape(2)
                    e[0] = 1
                    e[1] = raw[bad].flat[0]
                v = np.where(bad, 0, v)
            np.copyto(out, np.take_along_axis(x, v, axis))

        return make_kernel(fname, src, {}, sim, flat_geometry)

    return cached(key, build)


def _check_indices(name: str, idx: Any) -> Tensor:
    if not isinstance(idx, Tensor):
        raise TypeError(f"{name}: the indices must be a tensor (or an op producing one), not {arg_type(idx)}")
    dt = idx.dtype
    if dt == np.bool_:
        raise TypeError(f"{name}: boolean indices (a mask) are not supported; select with ops.where")
    if dt.kind not in "iu":
        raise TypeError(f"{name}: the indices must be integers, not {dt}")
    if dt == np.uint64:
        raise TypeError(f"{name}: uint64 indices are not supported; convert them with .astype(np.int64)")
    return idx


class Gather(TensorOp):
    """``take`` (``along=False``) and ``take_along_axis`` (``along=True``)."""

    __slots__ = ("_along", "name")
    # not recorded as a recipe: the read-back of its flag and the check after the
    # submission are not replayable steps
    _cacheable = False

    def __init__(self, name: str, along: bool, args: tuple[Any, ...]) -> None:
        self.name = name
        self._along = along
        super().__init__(args)

    def _layout(self, x: Any, idx: Any, axis: int | None) -> tuple[tuple[int, ...], int | None]:
        """(result shape, the axis normalized) after the argument checks."""
        name = self.name
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: needs a tensor to gather from, not {arg_type(x)}")
        _check_indices(name, idx)
        if idx.device is not x.device:
            raise ValueError(f"{name}: the indices are on device {idx.device.ordinal}, the tensor on {x.device.ordinal}")
        if axis is None:
            if self._along and idx.ndim != 1:
                raise ValueError(f"{name}: with axis=None the indices must be 1-D, not of shape {idx.shape}")
            k = x.size
            shape = idx.shape
        else:
            if x.ndim == 0:
                raise ValueError(f"{name}: axis {axis} of a 0-d tensor; use axis=None")
            axis = normalize_axis(axis, x.ndim)
            k = x.shape[axis]
            if self._along:
                if idx.ndim != x.ndim:
                    raise ValueError(f"{name}: the indices ({idx.ndim}-D) and the tensor ({x.ndim}-D) differ in rank")
                dims = [
                    idx.shape[d] if d == axis else broadcast_shape(name, (x.shape[d],), (idx.shape[d],))[0] for d in range(x.ndim)
                ]
                shape = tuple(dims)
                broadcast_shape(name, idx.shape, shape)  # the indices reach the result's shape
            else:
                shape = x.shape[:axis] + idx.shape + x.shape[axis + 1 :]
        if k == 0 and math.prod(shape) != 0:
            raise IndexError(f"{name}: cannot take from an empty axis (of size 0) into a non-empty result of shape {shape}")
        return shape, axis

    def _check(self, *args: Any) -> None:
        x, idx, axis, out = args
        shape, _ = self._layout(x, idx, axis)
        if out is not None:
            check_out(self.name, out, shape, x.dtype, x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, idx, axis, out = args
        shape, ax = self._layout(x, idx, axis)
        name = self.name
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        plan.use(idx._buffer, idx)
        result = output(plan, ln, name, out, shape, x.dtype, x.device, (x, idx))
        dst = result.t
        n = math.prod(shape)
        if n == 0:
            return finish(plan, ln, result, name)
        if ax is None or not self._along:
            xv, iv, rank, gax, k = self._take_views(plan, ln, x, idx, ax)
            oshape = xv.shape[:gax] + iv.shape[gax : gax + 1] + xv.shape[gax + 1 :]
        else:
            xv, iv, rank, gax, k = self._along_views(x, idx, ax, shape)
            oshape = shape
        flat = dst if dst.is_contiguous else alloc(plan, ln, shape, x.dtype, name)
        isz = x.dtype.itemsize
        ostrides = tuple(s * isz for s in _c_steps(oshape))
        dt = x.dtype
        if dt == BFLOAT16:  # moved as its bits: the kernels have no bfloat16 type
            dt = np.dtype(np.uint16)
            xv = view(xv, xv.shape, xv.strides, dt)
        o = out_partition(view(flat, oshape, ostrides, dt))
        if plan.capture is not None:
            # nothing can be read back from a graph: the kernel clamps, unreported
            launch(plan, ln, gather_kernel(rank, gax, dt, idx.dtype, False), (o, xv, iv, n))
        else:
            err = alloc(plan, ln, (2,), _I64, name)
            zero = elementwise_kernel("fill", "C(0)", (), 1, _I64, _I64, lambda: 0)
            launch(plan, ln, zero, (out_partition(err), 2))
            # (err seen with the output's rank: the partitions of a launch share one tile grid)
            errv = view(err, (1,) * (rank - 1) + (2,), (0,) * (rank - 1) + (8,))
            launch(plan, ln, gather_kernel(rank, gax, dt, idx.dtype, True), (o, out_partition(errv), xv, iv, n))
            flag = plan_read_to_host(plan, ln, err, np.empty(2, np.int64))
            axis_words = "the flattened tensor" if ax is None else f"axis {ax}"

            def check() -> None:
                got = flag.resolve()
                if got[0]:
                    raise IndexError(f"{name}: index {int(got[1])} is out of range for {axis_words} of size {k}")

            plan.check_when_done(check)
        if flat is not dst:
            copy_into(plan, ln, dst, flat, name)
        return finish(plan, ln, result, name)

    @staticmethod
    def _take_views(plan: Plan, lane: Lane, x: Tensor, idx: Tensor, ax: int | None) -> tuple[Tensor, Tensor, int, int, int]:
        """``take``: x as (pre, k, post), the indices as (1, j, 1) broadcast to (pre, j, post)."""
        if ax is None:
            xs = x if one_stride(x.shape, x.strides) is not None else contiguous(plan, lane, x)
            pre_s: int | None = 0
            k_s: int | None = one_stride(xs.shape, xs.strides)
            post_s: int | None = 0
            pre, k, post = 1, x.size, 1
        else:
            pre = math.prod(x.shape[:ax])
            k = x.shape[ax]
            post = math.prod(x.shape[ax + 1 :])
            a = one_stride(x.shape[:ax], x.strides[:ax])
            b = one_stride(x.shape[ax + 1 :], x.strides[ax + 1 :])
            xs = x
            if a is None or b is None:
                xs = contiguous(plan, lane, x)
                a = one_stride(xs.shape[:ax], xs.strides[:ax])
                b = one_stride(xs.shape[ax + 1 :], xs.strides[ax + 1 :])
            pre_s, k_s, post_s = a, xs.strides[ax], b
        assert pre_s is not None and k_s is not None and post_s is not None
        ii = idx if one_stride(idx.shape, idx.strides) is not None else contiguous(plan, lane, idx)
        i_s = one_stride(ii.shape, ii.strides)
        assert i_s is not None
        j = idx.size
        xv = view(xs, (pre, k, post), (pre_s, k_s, post_s))
        iv = view(ii, (pre, j, post), (0, i_s, 0))
        return xv, iv, 3, 1, k

    @staticmethod
    def _along_views(x: Tensor, idx: Tensor, ax: int, shape: tuple[int, ...]) -> tuple[Tensor, Tensor, int, int, int]:
        """``take_along_axis``: x and the indices broadcast to the result's shape (x
        keeping its own length along the axis)."""
        xstr = tuple(0 if (d != ax and x.shape[d] == 1 and shape[d] != 1) else x.strides[d] for d in range(x.ndim))
        xshape = tuple(x.shape[d] if d == ax else shape[d] for d in range(x.ndim))
        istr = tuple(0 if (idx.shape[d] == 1 and shape[d] != 1) else idx.strides[d] for d in range(idx.ndim))
        return view(x, xshape, xstr), view(idx, shape, istr), x.ndim, ax, x.shape[ax]


def _c_steps(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides of ``shape`` in elements."""
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _axis_arg(name: str, axis: Any) -> int | None:
    if axis is None:
        return None
    if not is_int(axis):
        raise TypeError(f"{name}: axis must be an int or None, not {axis!r}")
    return int(axis)


def _indices_arg(name: str, indices: Any) -> Any:
    if isinstance(indices, (Tensor, DeviceOp)) or hasattr(indices, "_as_tensor"):
        return operand(indices, name, "indices")
    raise TypeError(
        f"{name}: the indices must be a device tensor or an op producing one, not {arg_type(indices)} "
        "(upload host indices with api.from_host(np.asarray(..., np.int64)))"
    )


def _out_arg(name: str, out: Any) -> Any:
    return None if out is None else operand(out, name)


def take(x: Any, indices: Any, axis: Any = None, *, out: Any = None, name: str = "ops.take") -> Gather:
    ax = _axis_arg(name, axis)
    return Gather(name, False, (operand(x, name), _indices_arg(name, indices), ax, _out_arg(name, out)))


def take_along_axis(x: Any, indices: Any, axis: Any, *, out: Any = None) -> Gather:
    name = "ops.take_along_axis"
    ax = _axis_arg(name, axis)
    return Gather(name, True, (operand(x, name), _indices_arg(name, indices), ax, _out_arg(name, out)))


class _Embedding(Gather):
    __slots__ = ()

    def _check(self, *args: Any) -> None:
        w = args[0]
        if isinstance(w, Tensor) and w.ndim != 2:
            raise ValueError(f"ops.embedding: the weight must be 2-D (num_embeddings, dim), not of shape {w.shape}")
        super()._check(*args)


def embedding(weight: Any, ids: Any, *, out: Any = None) -> Gather:
    name = "ops.embedding"
    return _Embedding(name, False, (operand(weight, name, "weight"), _indices_arg(name, ids), 0, _out_arg(name, out)))


# -- indexing by an integer tensor: x[idx], x[:, idx], x[..., idx] ----------------------------
def index(x: Any, key: Any) -> DeviceOp[Any]:
    """``x[key]`` where one item of ``key`` is an integer tensor (or an op producing one):
    a ``take`` along that item's axis. The items before it must be ``:`` (or ``...``
    with only ``:`` after it); the items after it index the other axes as basic
    indexing does."""
    items = key if isinstance(key, tuple) else (key,)
    where = [i for i, k in enumerate(items) if is_device_value(k)]
    if len(where) != 1:
        raise TypeError(
            f"indexing by {len(where)} index tensors: one integer index tensor (along one axis) is supported; "
            "combine gathers with ops.take"
        )
    p = where[0]
    before, idx, after = items[:p], items[p], items[p + 1 :]
    full = slice(None)
    if all(k == full for k in before):
        basic = (*before, full, *after)
        src = x[basic] if any(k != full for k in after) else x
        return take(src, idx, p, name="ops.take (indexing)")
    if before and before[-1] is Ellipsis and all(k == full for k in before[:-1]) and all(k == full for k in after):
        return take(x, idx, -(1 + len(after)), name="ops.take (indexing)")
    raise TypeError(
        "indexing by an integer tensor supports x[idx], x[:, idx] (full slices before it, basic indices after it) "
        f"and x[..., idx] (full slices after it), not {key!r}; use ops.take(x, idx, axis)"
    )
