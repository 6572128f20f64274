"""zeros_like / ones_like / empty_like / full_like, concatenate and stack."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _api as api
from .._checks import arg_type, check_dtype, is_int
from .._op import DeviceOp, TensorValuedOp
from .._plan import Lane, Plan
from .._tensor import Partition, Tensor, index_view, normalize_axis
from ._core import TensorOp, device_of, operand, output, tensor_arg
from ._elementwise import copy_into, finish
from ._layout import promote

__all__ = ["Concatenate", "like"]


def like(kind: str, x: Any, dtype: Any, fill: Any = None) -> TensorValuedOp[Tensor]:
    """A new tensor with the shape (and, by default, dtype and device) of ``x``."""
    name = f"ops.{kind}_like"
    if isinstance(x, Partition):
        x = x.tensor
    dt = None if dtype is None else check_dtype(dtype)

    def make(t: Any) -> TensorValuedOp[Tensor]:
        t = tensor_arg(t, name)
        d = dt or t.dtype
        if kind == "zeros":
            return api.zeros(t.shape, d, device=t.device)
        if kind == "ones":
            return api.ones(t.shape, d, device=t.device)
        if kind == "full":
            return api.full(t.shape, fill, d, device=t.device)
        return api.empty(t.shape, d, device=t.device)

    if isinstance(x, Tensor):
        return make(x)
    if isinstance(x, DeviceOp):
        return x.then(make)
    raise TypeError(f"{name}: needs a tensor or an op producing one, not {arg_type(x)}")


class Concatenate(TensorOp):
    """Inputs copied into slices of one output along ``axis`` (``stack``: along a new axis)."""

    __slots__ = ("_n", "_new_axis", "name")
    _cacheable = True

    def __init__(self, args: tuple[Any, ...], n: int, new_axis: bool) -> None:
        self._n = n
        self._new_axis = new_axis
        self.name = "ops.stack" if new_axis else "ops.concatenate"
        super().__init__(args)

    def _layout(self, *args: Any) -> tuple[list[Tensor], int, tuple[int, ...], np.dtype[Any]]:
        xs = [tensor_arg(x, self.name, "input") for x in args[: self._n]]
        axis = args[self._n]
        if self._new_axis:
            ax = normalize_axis(axis, xs[0].ndim + 1)
            if any(x.shape != xs[0].shape for x in xs):
                raise ValueError(f"{self.name}: all inputs must have the same shape, got {[x.shape for x in xs]}")
            xs = [x[(slice(None),) * ax + (None,)] for x in xs]
        else:
            if xs[0].ndim == 0:
                raise ValueError(f"{self.name}: zero-dimensional inputs cannot be concatenated")
            ax = normalize_axis(axis, xs[0].ndim)
            for x in xs:
                if x.ndim != xs[0].ndim or any(
                    a != b for d, (a, b) in enumerate(zip(x.shape, xs[0].shape, strict=True)) if d != ax
                ):
                    raise ValueError(f"{self.name}: shapes {[t.shape for t in xs]} differ outside axis {ax}")
        shape = list(xs[0].shape)
        shape[ax] = sum(x.shape[ax] for x in xs)
        dtype = promote(self.name, xs)
        return xs, ax, tuple(shape), dtype

    def _check(self, *args: Any) -> None:
        xs, _, shape, dtype = self._layout(*args)
        dev = device_of(self.name, xs)
        out = args[self._n + 1]
        if out is not None:
            from ._core import check_out

            check_out(self.name, out, shape, dtype, dev)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        xs, ax, shape, dtype = self._layout(*args)
        dev = device_of(self.name, xs)
        ln = lane.on(dev)
        for x in xs:
            plan.use(x._buffer, x)
        result = output(plan, ln, self.name, args[self._n + 1], shape, dtype, dev, xs)
        dst = result.t
        start = 0
        for x in xs:
            n = x.shape[ax]
            key = (slice(None),) * ax + (slice(start, start + n),)
            shp, strides, offset = index_view(dst.shape, dst.strides, key)
            part = Tensor._new(dst._buffer, shp, dst.dtype, dst._offset + offset, strides, dst._tracked)
            copy_into(plan, ln, part, x, self.name)
            start += n
        return finish(plan, ln, result, self.name)


def concatenate(xs: Any, axis: Any = 0, *, out: Any = None, new_axis: bool = False) -> Concatenate:
    name = "ops.stack" if new_axis else "ops.concatenate"
    if isinstance(xs, (Tensor, DeviceOp, Partition)) or not hasattr(xs, "__iter__"):
        raise TypeError(f"{name}: needs a sequence of tensors (or ops), not {arg_type(xs)}")
    items = [operand(x, name, "input") for x in xs]
    if not items:
        raise ValueError(f"{name}: needs at least one input")
    for x in items:
        if not isinstance(x, (Tensor, DeviceOp)):
            raise TypeError(f"{name}: inputs must be tensors or ops, not {arg_type(x)}")
    if not is_int(axis):
        raise TypeError(f"{name}: axis must be an int, not {axis!r}")
    return Concatenate((*items, int(axis), None if out is None else operand(out, name)), len(items), new_axis)
