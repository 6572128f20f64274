"""Elementwise math against numpy: sin cos erf floor ceil round sign power clip, the
``**`` operators, numpy's result dtypes (integers stay integers where numpy keeps them),
NaN and infinities, out= and bad input."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from trio_cuda import api, ops

from ..helpers.arrays import close, host, same, up

SPECIAL = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -3.7, 3.7, 0.0, 1e20, np.inf, -np.inf, np.nan], np.float32)
INTS = np.array([-7, -1, 0, 1, 2, 5, 100], np.int32)


def erf(a: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[a.dtype])(a)


@pytest.mark.parametrize(("name", "ref"), [("sin", np.sin), ("cos", np.cos), ("erf", erf)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_sin_cos_erf(name: str, ref: object, dtype: type) -> None:
    a = np.linspace(-4, 4, 41).astype(dtype)
    tol = 2e-3 if dtype == np.float16 else 2e-6
    close(host(getattr(ops, name)(up(a))), ref(a), tol)  # type: ignore[operator]


def test_sin_of_integers_is_float64_as_numpy() -> None:
    close(host(ops.sin(up(INTS))), np.sin(INTS), 1e-12)
    close(host(ops.cos(up(np.array([0, 1], np.int8)))), np.cos(np.array([0, 1], np.int8)), 2e-3)  # float16


@pytest.mark.parametrize(("name", "ref"), [("floor", np.floor), ("ceil", np.ceil), ("round", np.round), ("sign", np.sign)])
def test_rounding_and_sign_of_floats_and_integers(name: str, ref: object) -> None:
    close(host(getattr(ops, name)(up(SPECIAL))), ref(SPECIAL))  # type: ignore[operator]
    close(host(getattr(ops, name)(up(INTS))), ref(INTS))  # type: ignore[operator]  # integers stay integers
    big = np.array([2.0**60 + 2.0**9, -(2.0**53) - 2, 4.5, -4.5], np.float64)
    close(host(getattr(ops, name)(up(big))), ref(big))  # type: ignore[operator]  # beyond int64 too


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_round_floats_to_decimals_as_numpy(dtype: type) -> None:
    """Bit for bit numpy's ``rint(x * 10**d) / 10**d`` (``rint(x / 10**-d) * 10**-d`` below
    zero), numpy's scale at large decimals included; half types compute in float32 and
    round once, so theirs is numpy's float32 result rounded (numpy's own float16 rounds
    every step, and its scale overflows to inf from 5 decimals on)."""
    a = np.array([1.25, 1.35, -2.675, 123.456, 15.0, 25.0, -35.0, -0.0, 3006.0, 2.3643249400513436e-24, np.inf, np.nan], dtype)
    for decimals in (1, 2, 25, -1, -2, -25):
        want = np.round(a.astype(np.float32), decimals).astype(dtype) if np.dtype(dtype).itemsize == 2 else np.round(a, decimals)
        got = host(ops.round(up(a), decimals))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
        np.testing.assert_array_equal(np.signbit(got.astype(np.float64)), np.signbit(want.astype(np.float64)))


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64], ids=lambda d: np.dtype(d).name
)
def test_round_integers_to_decimals_as_numpy(dtype: type) -> None:
    """numpy rounds integers to negative decimals through float64 (halves to even:
    ``round(25, -1) == 20``) and casts back to their dtype; to positive decimals they
    are unchanged. (Results beyond the dtype are left out: numpy's cast of them depends
    on the machine.)"""
    info = np.iinfo(dtype)
    small = [v for v in (5, 15, 25, 35, 45, 46, 99, 125, 150, 250, 4999, 5000, 15000) if v <= info.max // 2]
    a = np.array([0, *small, info.max // 2 + 5], dtype)  # int64's beyond 2**53: float64's rounding, as numpy
    if info.min < 0:
        a = np.concatenate([a, -a])
    for decimals in (-1, -2, -4, -20, 0, 3):
        same(host(ops.round(up(a), decimals)), np.round(a, decimals))


def test_power_and_the_operators() -> None:
    a = np.array([0.5, 1.0, 2.0, 3.0, 0.0], np.float32)
    b = np.array([2.0, -1.0, 0.5, 3.0, 2.0], np.float32)
    x, y = up(a), up(b)
    close(host(ops.power(x, y)), np.power(a, b))
    close(host(x**y), a**b)
    close(host(x**2), a**2)
    close(host(2.0**x), 2.0**a)  # __rpow__, the scalar weak
    close(host((x + 0) ** (y + 0)), a**b)  # on ops
    close(host(np.float64(2.0) ** x), np.float64(2.0) ** a)  # a numpy scalar is strong: float64
    close(host(up(INTS) ** 2), INTS**2)
    e = np.array([0, 1, 2, 3, 4, 5, 3], np.int32)
    close(host(up(INTS) ** up(e)), INTS**e)
    close(host(up(np.array([2, 1, -1, 3], np.int64)) ** up(np.array([-1, -2, -3, 0], np.int64))), np.array([0, 1, -1, 1]))
    with pytest.raises(ValueError, match="negative integer powers"):
        up(INTS) ** -1


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64, np.uint64], ids=lambda d: np.dtype(d).name)
def test_integer_powers_are_exact_and_wrap_as_numpy(dtype: type) -> None:
    """numpy's integer power multiplies in the dtype: exact beyond 2**53 (``3 ** 39``) and
    wrapping past the dtype (``int8 3 ** 5`` is -13), for tensor and scalar exponents."""
    signed = np.dtype(dtype).kind == "i"
    base = np.array([0, 1, 2, 3, 7, -1, -3] if signed else [0, 1, 2, 3, 7, 255, 10], dtype)
    for e in (0, 1, 3, 5, 13, 39, 64):
        exps = np.full(base.shape, e, dtype)
        same(host(up(base) ** up(exps)), base**exps)
        same(host(ops.power(up(base), e)), np.power(base, e))


def test_clip_with_scalars_tensors_and_one_bound() -> None:
    a = SPECIAL
    x = up(a)
    close(host(ops.clip(x, -1, 2)), np.clip(a, -1, 2))
    close(host(ops.clip(x, None, 2.5)), np.clip(a, None, 2.5))
    close(host(ops.clip(x, 0.5, None)), np.clip(a, 0.5, None))
    lo = np.linspace(-3, 0, a.size).astype(np.float32)
    close(host(ops.clip(x, up(lo), up(lo) + 1)), np.clip(a, lo, lo + 1))
    close(host(ops.clip(up(INTS), 0, 5)), np.clip(INTS, 0, 5))
    close(host(ops.clip(up(INTS), 0, 2.5)), np.clip(INTS, 0, 2.5))  # a float bound: float64, as numpy
    small = np.array([0, 1, 5, 200], np.uint8)  # Python int bounds beyond the dtype bound nothing, as numpy's
    for lo, hi in ((-1, 3), (-1, None), (None, 256), (-(2**70), 2**70), (2, 1000)):
        close(host(ops.clip(up(small), lo, hi)), np.clip(small, lo, hi))
    with pytest.raises(OverflowError):
        ops.clip(up(small), 256, None)  # a lower bound above the dtype: refused, as numpy
    with pytest.raises(ValueError, match="at least one of a_min and a_max"):
        ops.clip(x, None, None)


async def test_out_and_errors() -> None:
    x = await api.from_host(SPECIAL)
    out = await api.zeros(SPECIAL.shape)
    assert await ops.floor(x, out=out) is out
    close(await out.to_host(), np.floor(SPECIAL))
    await ops.clip(x, -1, 1, out=x)  # in place
    close(await x.to_host(), np.clip(SPECIAL, -1, 1))
    with pytest.raises(TypeError, match=r"ops\.sign: .*bool"):
        ops.sign(await api.from_host(np.array([True])))
    with pytest.raises(TypeError, match="decimals must be an int"):
        ops.round(x, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ops\.power: the argument must be"):
        ops.power(x, "2")
    with pytest.raises(TypeError, match="needs at least one tensor"):
        ops.sin(1.0)


NUMERIC = [np.bool_, np.int8, np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
def test_power_and_round_dtypes_of_bools_as_numpy(dtype: type) -> None:
    """numpy 2's result dtypes with bool operands: ``power`` of bools is int8 (int64 with a
    Python int), the ``**`` operator squares for an exponent of 2 (bool ** 2 is int8, its
    np.square), ``round`` of bools is rint's float16 (and refused with other decimals,
    where numpy raises)."""
    flags = np.array([True, False, True])
    a = np.array([1, 0, 3], dtype)
    for got, want in (
        (host(ops.power(up(flags), up(a))), np.power(flags, a)),
        (host(ops.power(up(a), up(flags))), np.power(a, flags)),
        (host(up(a) ** 2), a**2),
        (host(ops.power(up(a), 2)), np.power(a, 2)),
        (host(up(a) ** True), a**True),
        (host(2 ** up(a)), 2**a),
        (host(ops.add(up(a), 0) ** 2), (a + 0) ** 2),  # the operator on an op
    ):
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want)
    got = host(ops.round(up(flags)))
    assert got.dtype == np.round(flags).dtype == np.float16
    np.testing.assert_array_equal(got, np.round(flags))
    for decimals in (1, -1):
        with pytest.raises(TypeError):
            np.round(flags, decimals)
        with pytest.raises(TypeError, match=rf"ops\.round: bool tensors round only to 0 decimals.*decimals={decimals}"):
            ops.round(up(flags), decimals)
