"""Elementwise math beyond arithmetic: sin, cos, erf, floor, ceil, round, sign, power, clip.

Each is an :class:`~._elementwise.Elementwise` op (numpy broadcasting and dtype rules,
one generated kernel, the numpy twin on the simulated device), with one addition: an
integer or bool loop may use another expression than a float loop (``floor`` of an
integer is the integer; ``power`` of integers multiplies in their dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import is_int
from .._plan import Lane, Plan
from .._tensor import Tensor
from ._core import operand
from ._elementwise import Elementwise, Ufunc, _erf, _plan_elementwise, _resolve

__all__ = ["MATH", "clip", "math_op", "pow_operator", "power", "round_"]

# Floats at least this large in magnitude are integers already (float64's 2**52; float32's
# and float16's are smaller): floor/ceil/round leave them (and inf, NaN) as they are, and
# never convert them to the int64 that numba's math.floor returns.
_EXACT = "C(4503599627370496.0)"


def _integral(e: str, rounded: str) -> str:
    """``rounded`` (an expression over ``e``) where ``e`` may not be integral, else ``e``;
    with ``e``'s sign, as numpy's (``floor(-0.0)``, ``ceil(-0.5)`` and ``round(-0.4)`` are
    -0.0: numba's math.floor and math.ceil return integers, which have no -0)."""
    return f"(C(math.copysign({rounded}, {e})) if abs({e}) < {_EXACT} else {e})"


def _rint(e: str) -> str:
    """Round-half-to-even of expression ``e`` (numpy's round)."""
    f = f"C(math.floor({e}))"
    odd = f"C(math.floor({f} * C(0.5))) * C(2) != {f}"
    return _integral(e, f"({f} + C(1) if ({e} - {f} > C(0.5) or ({e} - {f} == C(0.5) and {odd})) else {f})")


class _Unary:
    """Dtype rules of a one-operand ufunc for an op that takes extra scalar operands
    (``round``'s scale): the extra operands take the loop dtype. ``bool_to``: the loop
    and result dtype for a bool operand instead (numpy's round of bools is ``rint``'s:
    float16). ``int_loop``: the loop dtype for an integer operand, whose dtype stays the
    result's (numpy rounds integers to negative decimals in float64 and casts back)."""

    def __init__(self, uf: Any, bool_to: Any = None, int_loop: Any = None) -> None:
        self._uf = uf
        self._bool_to = None if bool_to is None else np.dtype(bool_to)
        self._int_loop = None if int_loop is None else np.dtype(int_loop)

    def resolve_dtypes(self, key: tuple[Any, ...]) -> tuple[np.dtype[Any], ...]:
        if self._bool_to is not None and key[0] == np.bool_:
            return (self._bool_to,) * len(key)
        if self._int_loop is not None and isinstance(key[0], np.dtype) and key[0].kind in "iu":
            return (self._int_loop,) * (len(key) - 1) + (key[0],)
        r = self._uf.resolve_dtypes((key[0], None))
        return (r[0],) * (len(key) - 1) + (r[-1],)


class _ClipDtypes:
    """numpy's dtypes of ``clip(x, lo, hi)``: ``minimum(maximum(x, lo), hi)``."""

    def resolve_dtypes(self, key: tuple[Any, ...]) -> tuple[np.dtype[Any], ...]:
        x, lo, hi = key[:3]
        r = np.maximum.resolve_dtypes((x, lo, None))[-1]
        r = np.minimum.resolve_dtypes((r, hi, None))[-1]
        return (r, r, r, r)


def _int_power(x: Any, y: Any) -> Any:
    """The twin of IPOW (see _codegen): numpy's power (wrapping) where the exponent is not
    negative, else 0, or 1 or -1 for a base of 1 or -1."""
    x, y = np.asarray(x), np.asarray(y)
    neg = y < 0
    r = np.power(x, np.where(neg, 0, y).astype(y.dtype))
    alt = np.where(x == 1, 1, np.where(x == -1, np.where(y % 2 == 0, 1, -1), 0))
    return np.where(neg, alt.astype(r.dtype), r)


def _power(x: Any, y: Any) -> Any:
    return np.power(x, y) if np.asarray(x).dtype.kind == "f" else _int_power(x, y)


def _round(x: Any, scale: Any) -> Any:
    if np.asarray(x).dtype.kind != "f":
        return x
    return np.round(x * scale) / scale


def _round_down(x: Any, scale: Any) -> Any:
    return np.round(x / scale) * scale


@dataclass(frozen=True)
class MathUfunc(Ufunc):
    """A Ufunc whose integer and bool loops compute ``int_expr`` (None: ``expr``)."""

    int_expr: str | None = None


_MAX = "(x0 if (x0 >= x1 or x0 != x0) else x1)"


def _clip_expr() -> str:
    m = _MAX
    return f"({m} if ({m} <= x2 or {m} != {m}) else x2)"


MATH: dict[str, MathUfunc] = {
    "sin": MathUfunc("sin", 1, "math.sin(x0)", np.sin, np.sin, "biuf"),
    "cos": MathUfunc("cos", 1, "math.cos(x0)", np.cos, np.cos, "biuf"),
    "erf": MathUfunc("erf", 1, "math.erf(x0)", _erf, np.sin, "biuf"),
    "floor": MathUfunc("floor", 1, _integral("x0", "C(math.floor(x0))"), np.floor, np.floor, "biuf", int_expr="x0"),
    "ceil": MathUfunc("ceil", 1, _integral("x0", "C(math.ceil(x0))"), np.ceil, np.ceil, "biuf", int_expr="x0"),
    # round(x, decimals): x1 is 10**decimals (numpy's rint(x * 10**d) / 10**d) ...
    "round": MathUfunc("round", 2, f"({_rint('x0 * x1')} / x1)", _round, _Unary(np.floor, np.float16), "biuf", int_expr="x0"),
    # ... and for decimals < 0, x1 is 10**-decimals (numpy's rint(x / 10**-d) * 10**-d),
    # integers in float64, the store casting back to their dtype
    "round_down": MathUfunc("round", 2, f"({_rint('x0 / x1')} * x1)", _round_down, _Unary(np.floor, int_loop=np.float64), "biuf"),
    # (sign(-0.0) is 0.0 and sign(NaN) NaN, as numpy's)
    "sign": MathUfunc(
        "sign", 1, "(C(1) if x0 > C(0) else (C(-1) if x0 < C(0) else (C(0) if x0 == C(0) else x0)))", np.sign, np.sign, "iuf"
    ),
    # integers exact, wrapping as numpy's; a negative exponent gives 0 (1 or -1 for a
    # base of 1 or -1), where numpy raises
    "power": MathUfunc("power", 2, "FPOW(x0, x1)", _power, np.power, "biuf", int_expr="IPOW(x0, x1, C(1))"),
    # x ** 2 as numpy's operator computes it: square (bool ** 2 is int8, where power gives int64)
    "square": MathUfunc("power", 1, "x0 * x0", np.square, np.square, "biuf"),
    "clip": MathUfunc("clip", 3, _clip_expr(), lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi), _ClipDtypes(), "biuf"),
    "clip_min": MathUfunc("clip", 2, _MAX, np.maximum, np.maximum, "biuf"),
    "clip_max": MathUfunc("clip", 2, "(x0 if (x0 <= x1 or x0 != x0) else x1)", np.minimum, np.minimum, "biuf"),
}


class MathOp(Elementwise):
    """An elementwise op of :data:`MATH` (an integer loop may compute ``int_expr``)."""

    __slots__ = ()

    def _integers(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` as an integer loop takes them: round ignores its scale there (1, so
        that a large one need not fit the integer dtype); clip's Python int bounds beyond
        an integer tensor's range bound nothing (numpy drops them: ``clip(uint8, -1,
        5)``), so they become the range's ends."""
        name = self._u.name
        x = args[0]
        if name == "round" and isinstance(x, Tensor):
            if _resolve(self._u, args[:-1])[0].kind in "biu":
                return (x, 1, args[-1])
        if name == "clip" and isinstance(x, Tensor) and x.dtype.kind in "iu":
            info = np.iinfo(x.dtype)
            low = type(args[1]) is int and args[1] <= info.min and self._u is not MATH["clip_max"]
            high = type(args[-2]) is int and args[-2] >= info.max and self._u is not MATH["clip_min"]
            if low or high:
                bounds = [
                    info.min if low and i == 0 else info.max if high and i == len(args) - 3 else b
                    for i, b in enumerate(args[1:-1])
                ]
                return (x, *bounds, args[-1])
        return args

    def _check(self, *args: Any) -> None:
        u = self._u
        x = args[0]
        if u.name == "round" and isinstance(x, Tensor) and x.dtype == np.bool_ and args[1] != 1:
            d = round(math.log10(args[1])) * (-1 if isinstance(self, _RoundDown) else 1)
            raise TypeError(
                f"ops.round: bool tensors round only to 0 decimals, as numpy's (decimals={d}); convert with astype first"
            )
        args = self._integers(args)
        super()._check(*args)
        if u.name == "power" and u.nin == 2:
            loop, _ = _resolve(u, args[:-1])
            y = args[1]
            if loop.kind in "biu" and not isinstance(y, Tensor) and y < 0:
                raise ValueError(f"ops.power: integers to negative integer powers are not allowed (exponent {y!r}), as in numpy")

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        args = self._integers(args)
        operands, out = args[:-1], args[-1]
        u = self._u
        loop, result = _resolve(u, operands)
        int_expr = getattr(u, "int_expr", None)
        expr = int_expr if int_expr is not None and loop.kind in "biu" else u.expr
        return _plan_elementwise(plan, lane, self.name, expr, u.np_fn, operands, (u.load,) * u.nin, loop, result, out)


class _RoundDown(MathOp):
    """round with decimals < 0: an op class of its own, so that its recipes (keyed by
    class, name and operands) never serve round's on the same scale."""

    __slots__ = ()


class _Square(MathOp):
    """``x ** 2``: an op class of its own (its recipes never serve power's)."""

    __slots__ = ()


def math_op(name: str, *args: Any, out: Any = None) -> MathOp:
    u = MATH[name]
    n = u.opname
    operands = tuple([a if type(a) is Tensor else operand(a, n) for a in args])
    cls = _RoundDown if name == "round_down" else (_Square if name == "square" else MathOp)
    return cls(u, operands, out if out is None or type(out) is Tensor else operand(out, n))


def power(x: Any, y: Any, *, out: Any = None) -> MathOp:
    return math_op("power", x, y, out=out)


def pow_operator(x: Any, y: Any) -> MathOp:
    """``x ** y``: numpy's operator, which squares for an exponent of the int 2 (the
    dtypes of ``np.square``: bool gives int8) and is ``power`` otherwise."""
    if type(y) is int and y == 2:
        return math_op("square", x)
    return math_op("power", x, y)


def clip(x: Any, a_min: Any, a_max: Any, *, out: Any = None) -> MathOp:
    n = "ops.clip"
    for what, b in (("a_min", a_min), ("a_max", a_max)):
        if b is not None and not isinstance(b, (Tensor, int, float, np.generic)) and not hasattr(b, "_plan"):
            raise TypeError(f"{n}: {what} must be a tensor, an op, a real scalar or None, not {type(b).__name__}")
    if a_min is None and a_max is None:
        raise ValueError("ops.clip: at least one of a_min and a_max must be given")
    if a_min is None:
        return math_op("clip_max", x, a_max, out=out)
    if a_max is None:
        return math_op("clip_min", x, a_min, out=out)
    return math_op("clip", x, a_min, a_max, out=out)


def _power_of_ten(n: int) -> float:
    """numpy's scale for round to ``n`` decimals (its ``power_of_ten``): exact to 1e22,
    beyond 1e9 a product of tens, which leaves ``float(10**n)`` from 1e25 on; the same
    float gives numpy's results there too."""
    if n < 9:
        return float(10**n)
    p = 1e9
    for _ in range(n - 9):
        p *= 10.0
    return p


def round_(x: Any, decimals: int = 0, *, out: Any = None) -> MathOp:
    """numpy's round: half to even; ``decimals`` as numpy's (integers to negative
    decimals round in float64 and keep their dtype; bools only to 0 decimals)."""
    if not is_int(decimals):
        raise TypeError(f"ops.round: decimals must be an int, not {decimals!r}")
    d = int(decimals)
    if abs(d) > 300:
        raise ValueError(f"ops.round: decimals={d} is out of range (|decimals| <= 300)")
    if d >= 0:
        return math_op("round", x, _power_of_ten(d), out=out)
    return math_op("round_down", x, _power_of_ten(-d), out=out)
