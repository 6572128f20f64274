"""Elementwise ops (numpy broadcasting and type promotion), activations, casts, copies.

Result dtypes are numpy's (``ufunc.resolve_dtypes``, Python scalars weak as in NEP 50);
half types compute in float32 and store rounded. Each op is one kernel launch over the
(coalesced) output; inputs are read through broadcast views, never copied.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type
from .._plan import Lane, Plan
from .._tensor import Tensor
from ._codegen import Load, bf16_to_f32_kernel, elementwise_kernel, f32_to_bf16_kernel, half_view
from ._core import Out, TensorOp, alloc, as_dtype, check_out, device_of, launch, operand, out_partition, output
from ._layout import bfloat16_promotion, broadcast_shape, broadcast_view, coalesce, compute_dtype, promote, view

__all__ = ["UFUNCS", "Elementwise", "astype", "contiguous", "copy_into", "elementwise"]

_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2 = 0.7071067811865476


def _erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.vectorize(math.erf, otypes=[x.dtype])(x))


@dataclass(frozen=True)
class Ufunc:
    """An elementwise op: numba ``expr`` over ``x0..`` (in compute dtype ``C``), its numpy
    twin ``np_fn``, and the numpy ufunc whose dtype rules it follows (``like``)."""

    name: str
    nin: int
    expr: str
    np_fn: Callable[..., Any]
    like: Any  # numpy ufunc for dtype resolution
    kinds: str = "biuf"
    weak_second: Any = None  # resolve as like(x, weak_second) (relu: maximum(x, 0))
    load: str = "num"  # how operands enter expr: "num" (in the compute dtype) or "truth" (as bools)
    bool_expr: str | None = None  # expr when the loop dtype is bool (invert: logical, as numpy's)

    opname: str = field(init=False, repr=False, compare=False)  # ops.<name>, as errors and traces say

    def __post_init__(self) -> None:
        object.__setattr__(self, "opname", f"ops.{self.name}")


def _u(name: str, nin: int, expr: str, np_fn: Callable[..., Any], like: Any, kinds: str = "biuf", weak: Any = None) -> Ufunc:
    return Ufunc(name, nin, expr, np_fn, like, kinds, weak)


def _logic(name: str, nin: int, expr: str, np_fn: Callable[..., Any]) -> Ufunc:
    """A logical op: operands enter as truth values (nonzero), the result is bool."""
    return Ufunc(name, nin, expr, np_fn, np_fn, "biuf", None, "truth")


def _bits(name: str, nin: int, expr: str, np_fn: Callable[..., Any], bool_expr: str) -> Ufunc:
    return Ufunc(name, nin, expr, np_fn, np_fn, "biu", None, "num", bool_expr)


UFUNCS: dict[str, Ufunc] = {
    u.name: u
    for u in (
        _u("add", 2, "x0 + x1", np.add, np.add),
        _u("subtract", 2, "x0 - x1", np.subtract, np.subtract),
        _u("multiply", 2, "x0 * x1", np.multiply, np.multiply),
        _u("divide", 2, "x0 / x1", np.true_divide, np.true_divide),
        _u("maximum", 2, "(x0 if (x0 >= x1 or x0 != x0) else x1)", np.maximum, np.maximum),
        _u("minimum", 2, "(x0 if (x0 <= x1 or x0 != x0) else x1)", np.minimum, np.minimum),
        _u("negative", 1, "-x0", np.negative, np.negative),
        _u("abs", 1, "abs(x0)", np.absolute, np.absolute, "biuf"),
        _u("exp", 1, "math.exp(x0)", np.exp, np.exp),
        _u("log", 1, "math.log(x0)", np.log, np.log),
        _u("sqrt", 1, "math.sqrt(x0)", np.sqrt, np.sqrt),
        _u("rsqrt", 1, "C(1) / math.sqrt(x0)", lambda x: 1 / np.sqrt(x), np.sqrt),
        _u("tanh", 1, "math.tanh(x0)", np.tanh, np.tanh),
        _u(
            "relu", 1, "(x0 if (x0 > C(0) or x0 != x0) else C(0))", lambda x: np.maximum(x, x.dtype.type(0)), np.maximum, "iuf", 0
        ),
        _u("sigmoid", 1, "C(1) / (C(1) + math.exp(-x0))", lambda x: 1 / (1 + np.exp(-x)), np.exp, "iuf"),
        _u("silu", 1, "x0 / (C(1) + math.exp(-x0))", lambda x: x / (1 + np.exp(-x)), np.exp, "iuf"),
        _u(
            "gelu",
            1,
            f"C(0.5) * x0 * (C(1) + math.tanh(C({_SQRT_2_OVER_PI}) * (x0 + C(0.044715) * x0 * x0 * x0)))",
            lambda x: (
                x.dtype.type(0.5) * x * (1 + np.tanh(x.dtype.type(_SQRT_2_OVER_PI) * (x + x.dtype.type(0.044715) * x * x * x)))
            ),
            np.exp,
            "iuf",
        ),
        # comparisons give bool; they compare in the promoted dtype, as numpy's
        _u("equal", 2, "x0 == x1", np.equal, np.equal),
        _u("not_equal", 2, "x0 != x1", np.not_equal, np.not_equal),
        _u("less", 2, "x0 < x1", np.less, np.less),
        _u("less_equal", 2, "x0 <= x1", np.less_equal, np.less_equal),
        _u("greater", 2, "x0 > x1", np.greater, np.greater),
        _u("greater_equal", 2, "x0 >= x1", np.greater_equal, np.greater_equal),
        # (x - x is NaN exactly for infinities and NaN: no float-only math calls, so
        # integer inputs compile too; bools, which have no subtraction, are finite)
        _u("isnan", 1, "x0 != x0", np.isnan, np.isnan),
        Ufunc("isinf", 1, "(x0 == x0) and ((x0 - x0) != (x0 - x0))", np.isinf, np.isinf, bool_expr="False"),
        Ufunc("isfinite", 1, "(x0 - x0) == (x0 - x0)", np.isfinite, np.isfinite, bool_expr="True"),
        _logic("logical_and", 2, "x0 and x1", np.logical_and),
        _logic("logical_or", 2, "x0 or x1", np.logical_or),
        _logic("logical_xor", 2, "x0 != x1", np.logical_xor),
        _logic("logical_not", 1, "not x0", np.logical_not),
        _bits("bitwise_and", 2, "x0 & x1", np.bitwise_and, "x0 and x1"),
        _bits("bitwise_or", 2, "x0 | x1", np.bitwise_or, "x0 or x1"),
        _bits("bitwise_xor", 2, "x0 ^ x1", np.bitwise_xor, "x0 != x1"),
        _bits("invert", 1, "~x0", np.invert, "not x0"),
        _u(
            "gelu_exact",
            1,
            f"C(0.5) * x0 * (C(1) + math.erf(x0 * C({_INV_SQRT_2})))",
            lambda x: x.dtype.type(0.5) * x * (1 + _erf(x * x.dtype.type(_INV_SQRT_2))),
            np.exp,
            "iuf",
        ),
    )
}


def _resolve(u: Ufunc, operands: tuple[Any, ...]) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(loop dtype the inputs are cast to, result dtype) by numpy's rules for ``u``."""
    name = f"ops.{u.name}"
    key: list[Any] = []
    bf16 = other_float = False
    for x in operands:
        if isinstance(x, Tensor):
            dt = x.dtype
            if dt == BFLOAT16:  # resolved as float16 (its numpy stand-in), then mapped back
                if "f" not in u.kinds:
                    raise TypeError(f"{name}: tensors of dtype {dt} are not supported (kinds {u.kinds!r})")
                bf16 = True
                dt = np.dtype(np.float16)
            elif dt.kind not in u.kinds:
                raise TypeError(f"{name}: tensors of dtype {x.dtype} are not supported")
            else:
                other_float = other_float or dt.kind == "f"
            key.append(dt)
        elif isinstance(x, (np.generic, bool)):
            key.append(np.asarray(x).dtype)  # numpy scalars strong; a Python bool is numpy's bool
            other_float = other_float or key[-1].kind == "f"
        else:
            key.append(type(x))
    if u.weak_second is not None:
        key.append(type(u.weak_second))
    try:
        dts = u.like.resolve_dtypes((*key, None))
    except TypeError as err:
        raise TypeError(f"{name}: {err}") from None
    if bf16:
        return bfloat16_promotion(dts[0], other_float), bfloat16_promotion(dts[-1], other_float)
    return dts[0], dts[-1]


def _scalar(x: Any, dt: np.dtype[Any], name: str) -> Any:
    try:
        return dt.type(x)
    except (OverflowError, ValueError) as err:
        raise OverflowError(f"{name}: the scalar {x!r} does not fit the op's {dt} arithmetic ({err})") from None


def _plan_elementwise(
    plan: Plan,
    lane: Lane,
    name: str,
    expr: str,
    np_fn: Callable[..., Any],
    operands: tuple[Any, ...],
    loads_kind: tuple[str, ...],
    loop: np.dtype[Any],
    result: np.dtype[Any],
    out: Any,
) -> Tensor:
    """Plan ``out = expr(operands)`` over the broadcast shape (see the module doc).
    ``loads_kind``: per operand, "num" (cast to the compute dtype), "truth" or "raw"
    (in its own dtype, a scalar too)."""
    tensors = [x for x in operands if isinstance(x, Tensor)]
    dev = device_of(name, tensors, lane)
    ln = lane.on(dev)
    shape = broadcast_shape(name, *(t.shape for t in tensors))
    for t in tensors:
        plan.use(t._buffer, t)
    # (a bfloat16 result stored into out= of another dtype rounds to bfloat16 first: a temporary)
    res = output(plan, ln, name, out, shape, result, dev, tensors, inplace_ok=True, casts=result != BFLOAT16)
    dst = res.t
    if 0 in shape:
        return finish(plan, ln, res, name)
    compute = compute_dtype(loop)
    arrays = [broadcast_view(t, shape) for t in tensors]
    new_shape, strides = coalesce(shape, [dst.strides] + [a.strides for a in arrays])
    rank = len(new_shape)
    o = half_view(view(dst, new_shape, strides[0]))  # (bfloat16 as its bits: see _codegen)
    views = iter(half_view(view(a, new_shape, s)) for a, s in zip(arrays, strides[1:], strict=True))
    args: list[Any] = [out_partition(o)]
    loads: list[Load] = []
    for x, kind in zip(operands, loads_kind, strict=True):
        array = isinstance(x, Tensor)
        loads.append(Load(array, kind == "num", kind == "truth", array and x.dtype == BFLOAT16))
        if array:
            args.append(next(views))
        elif kind == "raw":
            args.append(x)
        else:
            args.append(_scalar(x, compute if kind == "num" else np.dtype(np.float64), name))
    args.append(math.prod(new_shape))
    stored = dst.dtype if dst.dtype == BFLOAT16 else result
    k = elementwise_kernel(name.removeprefix("ops."), expr, tuple(loads), rank, compute, stored, np_fn)
    launch(plan, ln, k, tuple(args))
    return finish(plan, ln, res, name)


def finish(plan: Plan, lane: Lane, res: Out, name: str) -> Tensor:
    """The op's result: ``res.t``, copied into ``out=`` first if it was a temporary."""
    if res.back is None:
        return res.t
    copy_into(plan, lane, res.back, res.t, name)
    return res.back


class Elementwise(TensorOp):
    __slots__ = ("_out", "_u", "name")
    _cacheable = True

    def __init__(self, u: Ufunc, args: tuple[Any, ...], out: Any) -> None:
        self._u = u
        self._out = out
        self.name = u.opname
        super().__init__((*args, out))

    def _check(self, *args: Any) -> None:
        operands, out = args[:-1], args[-1]
        if not any(isinstance(x, Tensor) for x in operands):
            raise TypeError(f"{self.name}: needs at least one tensor operand")
        loop, result = _resolve(self._u, operands)
        tensors = [x for x in operands if isinstance(x, Tensor)]
        shape = broadcast_shape(self.name, *(t.shape for t in tensors))
        for x in operands:
            if not isinstance(x, Tensor):
                _scalar(x, compute_dtype(loop), self.name)
        dev = device_of(self.name, tensors)
        if out is not None:
            check_out(self.name, out, shape, result, dev)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        operands, out = args[:-1], args[-1]
        u = self._u
        loop, result = _resolve(u, operands)
        expr = u.bool_expr if u.bool_expr is not None and loop == np.bool_ else u.expr
        return _plan_elementwise(plan, lane, self.name, expr, u.np_fn, operands, (u.load,) * u.nin, loop, result, out)


_COMPARE = {
    "equal": operator.eq,
    "not_equal": operator.ne,
    "less": operator.lt,
    "less_equal": operator.le,
    "greater": operator.gt,
    "greater_equal": operator.ge,
}
_SYMBOL = {operator.eq: "==", operator.ne: "!=", operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">="}


def _signed_beside_uint64(operands: tuple[Any, ...]) -> int | None:
    """The position of the signed integer operand (a tensor or a numpy scalar) where the
    other is uint64, else None: numpy compares these exactly (its mixed loops), where a
    common dtype would wrap the negatives or round the large values."""
    dts = [x.dtype if isinstance(x, (Tensor, np.generic)) else None for x in operands]
    for signed, unsigned in ((0, 1), (1, 0)):
        a, b = dts[signed], dts[unsigned]
        if a is not None and b is not None and a.kind == "i" and b == np.uint64:
            return signed
    return None


class Compare(Elementwise):
    """A comparison, with numpy's exact answers where one loop dtype cannot hold both
    operands: a Python int beyond an integer loop's range relates the same way to every
    element (numpy fills the result, where arithmetic with it would overflow), and uint64
    against a signed integer compares by sign first (numpy's mixed loops)."""

    __slots__ = ()

    def _beyond(self, operands: tuple[Any, ...]) -> bool | None:
        """The result of every element where a Python int operand lies beyond the
        integer loop's range, else None."""
        k = next((i for i, x in enumerate(operands) if type(x) is int), None)
        if k is None:
            return None
        loop, _ = _resolve(self._u, operands)
        if loop.kind not in "iu":
            return None
        info = np.iinfo(loop)
        if info.min <= operands[k] <= info.max:
            return None
        # every element lies between the loop's bounds, as 0 does, so 0 stands for all
        a, b = (0, operands[k]) if k == 1 else (operands[k], 0)
        return bool(_COMPARE[self._u.name](a, b))

    def _check(self, *args: Any) -> None:
        operands, out = args[:-1], args[-1]
        if self._beyond(operands) is not None:  # (the int need not fit the loop dtype)
            operands = tuple(0 if type(x) is int else x for x in operands)
        super()._check(*operands, out)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        operands, out = args[:-1], args[-1]
        u = self._u
        loop, result = _resolve(u, operands)
        const = self._beyond(operands)
        if const is not None:
            operands = tuple(0 if type(x) is int else x for x in operands)
            expr, kinds = str(const), (u.load,) * u.nin
            return _plan_elementwise(plan, lane, self.name, expr, lambda *_: np.bool_(const), operands, kinds, loop, result, out)
        signed = _signed_beside_uint64(operands)
        if signed is None:
            return super()._build(plan, lane, *args)
        # a negative signed operand is below every uint64; else both compare as uint64
        fn = _COMPARE[u.name]
        below = bool(fn(-1, 0) if signed == 0 else fn(0, -1))
        expr = f"({below} if x{signed} < 0 else (np.uint64(x0) {_SYMBOL[fn]} np.uint64(x1)))"
        return _plan_elementwise(plan, lane, self.name, expr, u.np_fn, operands, ("raw", "raw"), loop, result, out)


def elementwise(name: str, *args: Any, out: Any = None) -> Elementwise:
    u = UFUNCS[name]
    if len(args) != u.nin:
        raise TypeError(f"ops.{name} takes {u.nin} operand{'s' if u.nin > 1 else ''}, got {len(args)}")
    n = u.opname
    # (a tensor is its own operand: the common case without a call)
    operands: tuple[Any, ...]
    if len(args) == 2:
        x, y = args
        operands = (x if type(x) is Tensor else operand(x, n), y if type(y) is Tensor else operand(y, n))
    else:
        operands = tuple([a if type(a) is Tensor else operand(a, n) for a in args])
    cls = Compare if name in _COMPARE else Elementwise
    return cls(u, operands, out if out is None or type(out) is Tensor else operand(out, n))


# -- where ----------------------------------------------------------------------------------
class Where(TensorOp):
    __slots__ = ()
    _cacheable = True
    name = "ops.where"

    def _check(self, *args: Any) -> None:
        cond, x, y, out = args
        if not any(isinstance(v, Tensor) for v in (cond, x, y)):
            raise TypeError("ops.where: needs at least one tensor operand")
        result = promote(self.name, [x, y])
        tensors = [v for v in (cond, x, y) if isinstance(v, Tensor)]
        shape = broadcast_shape(self.name, *(t.shape for t in tensors))
        for v in (x, y):
            if not isinstance(v, Tensor):
                _scalar(v, compute_dtype(result), self.name)
        dev = device_of(self.name, tensors)
        if out is not None:
            check_out(self.name, out, shape, result, dev)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        cond, x, y, out = args
        result = promote(self.name, [x, y])
        if not isinstance(cond, Tensor):
            cond = bool(cond)
        return _plan_elementwise(
            plan,
            lane,
            self.name,
            "(x1 if x0 else x2)",
            lambda c, a, b: np.where(c, a, b),
            (cond, x, y),
            ("truth", "num", "num"),
            result,
            result,
            out,
        )


def where(cond: Any, x: Any, y: Any, *, out: Any = None) -> Where:
    n = "ops.where"
    return Where((operand(cond, n, "condition"), operand(x, n), operand(y, n), None if out is None else operand(out, n)))


# -- casts and copies ---------------------------------------------------------------------------
def copy_into(plan: Plan, lane: Lane, dst: Tensor, src: Tensor, name: str) -> None:
    """Plan ``dst[...] = src`` (same shape; any strides; numpy's unsafe cast)."""
    if src.dtype == BFLOAT16 or dst.dtype == BFLOAT16:
        _copy_bf16(plan, lane, dst, src, name)
        return
    if 0 in dst.shape:
        return
    new_shape, strides = coalesce(dst.shape, [dst.strides, src.strides])
    o, a = view(dst, new_shape, strides[0]), view(src, new_shape, strides[1])
    if dst.dtype == np.bool_ and src.dtype != np.bool_:
        loads, compute = (Load(True, False, True),), np.dtype(np.bool_)
    else:
        loads, compute = (Load(True, True, False),), dst.dtype
    k = elementwise_kernel("copy", "x0", loads, len(new_shape), compute, dst.dtype, lambda x: x)
    launch(plan, lane, k, (out_partition(o), a, math.prod(new_shape)))


def _copy_bf16(plan: Plan, lane: Lane, dst: Tensor, src: Tensor, name: str) -> None:
    """Copies to or from bfloat16, bit-exact through float32 (integer views)."""
    if 0 in dst.shape:
        return
    if src.dtype == dst.dtype:  # bfloat16 to bfloat16: move the bits
        u16 = np.dtype(np.uint16)
        copy_into(plan, lane, view(dst, dst.shape, dst.strides, u16), view(src, src.shape, src.strides, u16), name)
        return
    if dst.dtype == BFLOAT16:
        if src.dtype != np.float32:
            tmp = alloc(plan, lane, src.shape, np.dtype(np.float32), name)
            copy_into(plan, lane, tmp, src, name)
            src = tmp
        kernel_for = f32_to_bf16_kernel
        o_dt: np.dtype[Any] = np.dtype(np.uint16)
        a_dt: np.dtype[Any] = np.dtype(np.uint32)
    else:
        if dst.dtype != np.float32:
            tmp = alloc(plan, lane, dst.shape, np.dtype(np.float32), name)
            _copy_bf16(plan, lane, tmp, src, name)
            copy_into(plan, lane, dst, tmp, name)
            return
        kernel_for = bf16_to_f32_kernel
        o_dt, a_dt = np.dtype(np.uint32), np.dtype(np.uint16)
    new_shape, strides = coalesce(dst.shape, [dst.strides, src.strides])
    o = view(dst, new_shape, strides[0], o_dt)
    a = view(src, new_shape, strides[1], a_dt)
    launch(plan, lane, kernel_for(len(new_shape)), (out_partition(o), a, math.prod(new_shape)))


def contiguous(plan: Plan, lane: Lane, t: Tensor, what: str = "a contiguous copy") -> Tensor:
    """``t`` itself if C-contiguous, else a contiguous copy planned on its device
    (``what`` names it in errors, e.g. inside a graph capture, which cannot allocate)."""
    if t.is_contiguous:
        return t
    ln = lane.on(t.device)
    plan.use(t._buffer, t)
    dst = alloc(plan, ln, t.shape, t.dtype, what)
    copy_into(plan, ln, dst, t, "copy")
    return dst


class AsType(TensorOp):
    __slots__ = ()
    _cacheable = True
    name = "ops.astype"

    def _check(self, *args: Any) -> None:
        x, dtype, _copy, out = args
        if not isinstance(x, Tensor):
            raise TypeError(f"{self.name}: needs a tensor, got {arg_type(x)}")
        if out is not None:
            t = check_out(self.name, out, x.shape, dtype, x.device)
            if t.dtype != dtype:
                raise TypeError(f"{self.name}: out= has dtype {t.dtype}, not {dtype}")

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, dtype, copy, out = args
        assert isinstance(x, Tensor)
        if out is None and not copy and x.dtype == dtype:
            return x  # numpy's astype(copy=False): the same tensor
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        res = output(plan, ln, self.name, out, x.shape, dtype, x.device, (x,), inplace_ok=True)
        copy_into(plan, ln, res.t, x, self.name)
        return finish(plan, ln, res, self.name)


def astype(x: Any, dtype: Any, *, copy: bool = True, out: Any = None) -> AsType:
    """``x`` converted to ``dtype`` (numpy's unsafe cast: floats to ints truncate)."""
    return AsType((operand(x, "ops.astype"), as_dtype(dtype), bool(copy), None if out is None else operand(out, "ops.astype")))
