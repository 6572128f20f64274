"""The device functions that generated kernels convert half-precision bits with on CUDA
(``BF16_IN``/``BF16_OUT``, ``F16_IN``/``F16_OUT`` and their packed forms, 32-bit integer and
float32 arithmetic), run on the host with numpy standing in for libdevice's bit casts:
every float16 and bfloat16 value decoded, and float32 values (every half value, the ties
between neighbours, the points just beside them, specials, random bits) encoded, against
numpy's and ml_dtypes' round to nearest even. A GPU runs the same source compiled."""

from __future__ import annotations

import types
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from trio_cuda._ops import _codegen


def _int_as_float(i: Any) -> np.float32:
    return np.array([i], np.int32).view(np.float32)[0]


def _float_as_int(f: Any) -> np.int32:
    return np.array([f], np.float32).view(np.int32)[0]


@pytest.fixture(scope="module")
def cuda_helpers() -> dict[str, Any]:
    libdevice = types.SimpleNamespace(int_as_float=_int_as_float, float_as_int=_float_as_int)
    g: dict[str, Any] = {"np": np, "libdevice": libdevice}
    exec(compile(_codegen._BF16_CUDA + _codegen._POWERS, "<cuda helpers>", "exec"), g)
    return g


@pytest.fixture(autouse=True)
def _no_wrap() -> Any:
    # numba computes these uint32 expressions in 64 bits: one that wrapped here would
    # differ there (a NaN's arithmetic is no error)
    with np.errstate(over="raise", invalid="ignore"):
        yield


def _bits32(f: Any) -> int:
    return int(np.array([f], np.float32).view(np.uint32)[0])


def _probes(half: np.dtype[Any]) -> np.ndarray:
    """float32 values to encode: each half value, the midpoints of neighbours (ties), a
    float32 step either side of each, beyond the range, specials and random bits."""
    every = np.arange(1 << 16, dtype=np.uint16).view(half).astype(np.float32)
    finite = np.unique(every[np.isfinite(every)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    special = np.array(
        [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e38, -1e38, 1e-45, 6e-8, 2.98e-8, 2.99e-8],
        np.float32,
    )
    rng = np.random.default_rng(7)
    random = rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([every, mids, near, special, random])


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_every_half_value_decodes_exactly(cuda_helpers: dict[str, Any], kind: str) -> None:
    half = np.dtype(np.float16) if kind == "F16" else np.dtype(ml_dtypes.bfloat16)
    decode, lo, hi = cuda_helpers[f"{kind}_IN"], cuda_helpers[f"{kind}_LO"], cuda_helpers[f"{kind}_HI"]
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(half).astype(np.float32).view(np.uint32)
    got = np.array([_bits32(decode(b)) for b in bits], np.uint32)
    np.testing.assert_array_equal(got, want)
    # the packed forms: a 32-bit word's low and high halves
    for b in bits[::97]:
        word = np.uint32(int(b) | (int(bits[-1 - int(b)]) << 16))
        assert _bits32(lo(word)) == int(want[int(b)])
        assert _bits32(hi(word)) == int(want[-1 - int(b)])


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_float32_encodes_to_nearest_even(cuda_helpers: dict[str, Any], kind: str) -> None:
    half = np.dtype(np.float16) if kind == "F16" else np.dtype(ml_dtypes.bfloat16)
    encode, pack = cuda_helpers[f"{kind}_OUT"], cuda_helpers[f"{kind}_PACK"]
    values = _probes(half)
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(half).view(np.uint16)
    got = np.array([int(encode(v)) for v in values], np.uint32)
    assert got.max() < 1 << 16
    nan = np.isnan(values)
    assert np.isnan(got[nan].astype(np.uint16).view(half).astype(np.float32)).all()  # a NaN stays a NaN
    np.testing.assert_array_equal(got[~nan], want[~nan])
    for a, b in zip(values[:4000:7], values[1:4001:7], strict=True):
        both = int(pack(a, b))
        assert both == int(encode(a)) | (int(encode(b)) << 16)


def test_float_power_is_one_rounding_for_exponents_one_two_and_minus_one(cuda_helpers: dict[str, Any]) -> None:
    fpow = cuda_helpers["FPOW"]
    for dt in (np.float32, np.float64):
        base = np.array([3.0, -0.0, 0.0, 1.1, -2.5, np.inf, -np.inf, np.nan, 1e-30], dt)
        for e in (1.0, 2.0, -1.0, 0.0, 3.0):
            with np.errstate(all="ignore"):
                got = np.array([fpow(b, dt(e)) for b in base], dt)
                want = np.power(base, dt(e))
            np.testing.assert_array_equal(got, want)
