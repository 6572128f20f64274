"""Comparisons and logic: the ops and the operators give bool tensors as numpy does,
equality is elementwise (not identity) while hashing stays identity, and a tensor's or
an op's truth value refuses with what to do."""

from __future__ import annotations

import operator

import numpy as np
import pytest

import trio_cuda
from trio_cuda import api, ops

from ..helpers.arrays import host

A = np.array([[1.0, np.nan, np.inf], [-np.inf, 0.0, -2.5]], np.float32)
B = np.array([1.0, 2.0, -np.inf], np.float32)
COMPARE = [
    ("equal", operator.eq, np.equal),
    ("not_equal", operator.ne, np.not_equal),
    ("less", operator.lt, np.less),
    ("less_equal", operator.le, np.less_equal),
    ("greater", operator.gt, np.greater),
    ("greater_equal", operator.ge, np.greater_equal),
]


def expect(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("name", "oper", "ref"), COMPARE)
def test_comparisons_broadcast_with_nan_and_infinities(name: str, oper: object, ref: np.ufunc) -> None:
    a, b = api.from_host(A).sync(), api.from_host(B).sync()
    want = ref(A, B)
    expect(host(getattr(ops, name)(a, b)), want)
    expect(host(oper(a, b)), want)  # type: ignore[operator]
    expect(host(oper(a + 0, b)), want)  # type: ignore[operator]  # an op as the left operand
    expect(host(oper(a, 1.0)), ref(A, np.float32(1.0)))  # type: ignore[operator]


@pytest.mark.parametrize(("name", "oper", "ref"), COMPARE)
def test_reflected_comparisons_and_mixed_dtypes(name: str, oper: object, ref: np.ufunc) -> None:
    i = np.array([-3, 0, 2, 7], np.int64)
    f = np.array([-3.5, 0.0, 2.0, 7.25], np.float32)
    ti, tf = api.from_host(i).sync(), api.from_host(f).sync()
    expect(host(oper(2, ti)), ref(2, i))  # type: ignore[operator]  # int.__lt__ defers to the tensor
    expect(host(oper(np.float32(0.0), tf)), ref(np.float32(0.0), f))  # type: ignore[operator]
    expect(host(oper(ti, tf)), ref(i, f))  # type: ignore[operator]  # compared in float64, as numpy
    expect(host(oper(ti, 2.5)), ref(i, 2.5))  # type: ignore[operator]


@pytest.mark.parametrize(("name", "oper", "ref"), COMPARE)
def test_integers_compare_exactly_where_no_dtype_holds_both(name: str, oper: object, ref: np.ufunc) -> None:
    """numpy 2's exact answers: a Python int beyond the tensor's integer dtype (``uint8 <
    -1``, ``int64 == 2**64``) is compared, not refused; uint64 against a signed integer
    tensor or numpy scalar compares by sign, not through one dtype (which wraps -1 to
    2**64 - 1)."""
    small = np.array([0, 1, 100, 255], np.uint8)
    wide = np.array([-5, 0, 2**62, 2**63 - 1], np.int64)
    for a in (small, wide, np.array([0, 7, 2**63, 2**64 - 1], np.uint64)):
        t = api.from_host(a).sync()
        for s in (-1, 1000, 2**64, -(2**70)):
            expect(host(getattr(ops, name)(t, s)), ref(a, s))
            expect(host(oper(s, t + 0)), ref(s, a))  # type: ignore[operator]  # reflected, on an op
    u = np.array([0, 1, 2**63, 2**64 - 1], np.uint64)
    i = np.array([-1, 1, -(2**63), 2**63 - 1], np.int64)
    tu, ti = api.from_host(u).sync(), api.from_host(i).sync()
    expect(host(oper(tu, ti)), ref(u, i))  # type: ignore[operator]
    expect(host(oper(api.from_host(i.astype(np.int8)).sync(), tu)), ref(i.astype(np.int8), u))  # type: ignore[operator]
    expect(host(oper(tu, np.int64(-1))), ref(u, np.int64(-1)))  # type: ignore[operator]


def test_float16_and_bool_inputs() -> None:
    h = np.array([0.5, -1.0, 65504.0, np.nan], np.float16)
    t = api.from_host(h).sync()
    expect(host(t > 0), h > 0)
    expect(host(ops.isnan(t)), np.isnan(h))
    m = np.array([True, False, True, False])
    n = np.array([True, True, False, False])
    tm, tn = api.from_host(m).sync(), api.from_host(n).sync()
    expect(host(tm == tn), m == n)
    expect(host(tm < tn), m < n)


def test_isnan_isinf_isfinite() -> None:
    a = api.from_host(A).sync()
    expect(host(ops.isnan(a)), np.isnan(A))
    expect(host(ops.isinf(a)), np.isinf(A))
    expect(host(ops.isfinite(a)), np.isfinite(A))
    i = np.arange(-2, 3, dtype=np.int32)
    ti = api.from_host(i).sync()
    expect(host(ops.isnan(ti)), np.isnan(i))
    expect(host(ops.isfinite(ti)), np.isfinite(i))


def test_logical_ops_take_truth_values() -> None:
    x = np.array([0.0, 2.0, np.nan, -1.0], np.float32)
    y = np.array([0, 0, 3, 1], np.int32)
    tx, ty = api.from_host(x).sync(), api.from_host(y).sync()
    expect(host(ops.logical_and(tx, ty)), np.logical_and(x, y))
    expect(host(ops.logical_or(tx, ty)), np.logical_or(x, y))
    expect(host(ops.logical_xor(tx, ty)), np.logical_xor(x, y))
    expect(host(ops.logical_not(tx)), np.logical_not(x))
    expect(host(ops.logical_and(tx, 0)), np.logical_and(x, 0))


def test_bitwise_operators_on_masks_and_integers() -> None:
    x = np.array([0.5, -1.0, 3.0, 7.0], np.float32)
    t = api.from_host(x).sync()
    expect(host((t > 0) & (t < 5)), (x > 0) & (x < 5))
    expect(host((t < 0) | (t > 5)), (x < 0) | (x > 5))
    expect(host((t > 0) ^ (t > 2)), (x > 0) ^ (x > 2))
    expect(host(~(t > 0)), ~(x > 0))  # logical on bools, as numpy's
    i = np.array([-6, 0, 5, 12], np.int16)
    ti = api.from_host(i).sync()
    expect(host(ti & 6), i & 6)
    expect(host(3 | ti), 3 | i)
    expect(host(ti ^ ti), i ^ i)
    expect(host(~ti), ~i)
    with pytest.raises(TypeError, match=r"ops.bitwise_and: tensors of dtype float32"):
        t & t
    with pytest.raises(TypeError, match=r"ops.invert: tensors of dtype float32"):
        ~t  # noqa: B018


def test_a_comparison_writes_into_out() -> None:
    a = api.from_host(A).sync()
    out = api.zeros(A.shape, np.bool_).sync()
    res = ops.greater(a, 0, out=out).sync()
    assert res is out
    expect(out.to_host().sync(), A > 0)
    with pytest.raises(ValueError, match="out= has shape"):
        ops.less(a, 0, out=api.zeros((2,), np.bool_).sync())


def test_where_takes_a_comparison() -> None:
    a = api.from_host(A).sync()
    got = host(ops.where(ops.isnan(a), 0.0, a))
    expect(got, np.where(np.isnan(A), np.float32(0), A))


def test_truth_value_refuses_with_the_way_to_test_on_the_host() -> None:
    a = api.from_host(B).sync()
    for thing in (a, a == a, a + 1, (a > 0) & (a < 2)):
        with pytest.raises(TypeError, match=r"truth value.*to_host\(\)\)\.all\(\)"):
            bool(thing)
    with pytest.raises(TypeError, match="truth value"):
        if a == a:  # the habit this catches
            pass


def test_equality_is_elementwise_but_hashing_stays_identity() -> None:
    a = api.from_host(B).sync()
    b = api.from_host(B).sync()
    assert isinstance(a == b, trio_cuda.DeviceOp)
    assert len({a, b, a}) == 2  # set members and dict keys by identity
    d = {a: 1, b: 2}
    assert d[a] == 1 and d[b] == 2
    op = a + 1
    assert {op: "x"}[op] == "x"
    # operands no op takes: Python's fallback (identity), not an error
    assert (a == None) is False  # noqa: E711
    assert (a != "text") is True
    assert (a, ...).index(...) == 1
    # host data is refused with the way to upload it, before any work
    with pytest.raises(TypeError, match="from_host"):
        a == np.ones(3, np.float32)  # noqa: B015


def test_ordering_of_incomparable_operands_is_a_type_error() -> None:
    a = api.from_host(B).sync()
    with pytest.raises(TypeError):
        a < "text"  # noqa: B015
    with pytest.raises(TypeError):
        a < None  # type: ignore[operator]  # noqa: B015
