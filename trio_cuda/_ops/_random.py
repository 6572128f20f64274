"""Seeded, counter-based random numbers: Philox4x32-10, the same numbers on both backends.

Element ``i`` (C order) of a result is made from the Philox block of counter
``(i + offset)`` under key ``seed``: no state is kept anywhere, any element can be made
independently, and the same ``(seed, offset)`` gives the same numbers on CUDA and on the
simulated device (uniforms bit for bit; normals up to the last bit of the math library's
log and cos).

* uniform float32: the top 24 bits of word 0, times 2**-24, scaled to [low, high);
  float64: 53 bits from words 0 and 1. float16 rounds the float32 value. A value that
  rounds up to ``high`` becomes the largest value below it, so ``high`` is never drawn.
* normal: Box-Muller on words 0 and 1, in float64, then ``mean + std * z``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from .._checks import BFLOAT16, check_dtype, check_shape, is_int, is_scalar
from .._plan import Lane, Plan
from .._registry import as_device
from .._tensor import Tensor
from ._codegen import bf16_to_f32, cached, f32_to_bf16, half_view, load_expr, make_kernel, store_expr
from ._core import TensorOp, alloc, check_out, flat_geometry, launch, operand, out_partition, output
from ._elementwise import contiguous, copy_into, finish
from ._layout import view

__all__ = ["Dropout", "Random", "dropout", "philox"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox(counter: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 of 64-bit counters (uint64 array) under a 64-bit key: four uint64
    arrays of 32-bit words (the numpy twin of the kernels' code)."""
    c0: Any = counter & _MASK
    c1: Any = counter >> np.uint64(32)
    c2: Any = np.zeros_like(counter)
    c3: Any = np.zeros_like(counter)
    k0 = np.uint64(seed & _MASK)
    k1 = np.uint64(seed >> 32)
    for _ in range(10):
        p0 = np.uint64(_M0) * c0
        p1 = np.uint64(_M1) * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + np.uint64(_W0)) & np.uint64(_MASK)
        k1 = (k1 + np.uint64(_W1)) & np.uint64(_MASK)
    return c0, c1, c2, c3


_PHILOX_SRC = """
    c0 = ctr & MASK
    c1 = ctr >> np.uint64(32)
    c2 = np.uint64(0)
    c3 = np.uint64(0)
    k0 = key0
    k1 = key1
    for _r in range(10):
        p0 = M0 * c0
        p1 = M1 * c2
        n0 = (p1 >> np.uint64(32)) ^ c1 ^ k0
        n2 = (p0 >> np.uint64(32)) ^ c3 ^ k1
        c1 = p1 & MASK
        c3 = p0 & MASK
        c0 = n0
        c2 = n2
        k0 = (k0 + W0) & MASK
        k1 = (k1 + W1) & MASK
"""


def _kernel(dist: str, out_dtype: np.dtype[Any]) -> Any:
    key = ("random", dist, out_dtype.str)
    wide = out_dtype == np.float64

    def build() -> Any:
        fname = f"{dist}__{out_dtype.name}"
        if dist == "uniform":
            if wide:
                value = (
                    "v = (np.float64(c0 >> np.uint64(5)) * 67108864.0 + np.float64(c1 >> np.uint64(6))) * 1.1102230246251565e-16"
                )
                value += "\n        r = a + (b - a) * v"
            else:
                value = "v = np.float32(np.float32(c0 >> np.uint64(8)) * np.float32(5.960464477539063e-08))"
                value += "\n        r = np.float32(a) + (np.float32(b) - np.float32(a)) * v"
        else:
            value = (
                "u1 = (np.float64(c0) + 1.0) * 2.3283064365386963e-10\n"
                "        u2 = np.float64(c1) * 2.3283064365386963e-10\n"
                "        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(6.283185307179586 * u2)\n"
                "        r = a + b * z"
            )
        src = (
            f"def {fname}(out, key0, key1, offset, a, b, top, n):\n"
            "    i = cuda.grid(1)\n"
            "    if i < n:\n"
            "        ctr = np.uint64(i) + offset\n" + _PHILOX_SRC.replace("\n    ", "\n        ") + f"        {value}\n"
            "        o = O(r)\n"
            + ("        if W(o) > W(top):\n            o = O(top)\n" if dist == "uniform" else "")
            + "        out[i] = o\n"
        )
        o_t = getattr(np, out_dtype.name)

        def sim(out: np.ndarray, key0: Any, key1: Any, offset: Any, a: Any, b: Any, top: Any, n: int) -> None:
            seed = int(key0) | (int(key1) << 32)
            ctr = np.arange(n, dtype=np.uint64) + np.uint64(offset)
            w0, w1, _, _ = philox(ctr, seed)
            r: Any
            v: Any
            with np.errstate(all="ignore"):
                if dist == "uniform":
                    if wide:
                        v = ((w0 >> np.uint64(5)).astype(np.float64) * 67108864.0 + (w1 >> np.uint64(6)).astype(np.float64)) * (
                            1.1102230246251565e-16
                        )
                        r = np.float64(a) + (np.float64(b) - np.float64(a)) * v
                    else:
                        v = (w0 >> np.uint64(8)).astype(np.float32) * np.float32(5.960464477539063e-08)
                        r = np.float32(a) + (np.float32(b) - np.float32(a)) * v
                else:
                    u1 = (w0.astype(np.float64) + 1.0) * 2.3283064365386963e-10
                    u2 = w1.astype(np.float64) * 2.3283064365386963e-10
                    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(6.283185307179586 * u2)
                    r = np.float64(a) + np.float64(b) * z
            o = r.astype(o_t)
            if dist == "uniform":
                o = np.where(o > o_t(top), o_t(top), o)
            np.copyto(out, o)

        g = {
            "O": o_t,
            "W": np.float64 if wide else np.float32,
            "MASK": np.uint64(_MASK),
            "M0": np.uint64(_M0),
            "M1": np.uint64(_M1),
            "W0": np.uint64(_W0),
            "W1": np.uint64(_W1),
        }
        return make_kernel(fname, src, g, sim, flat_geometry)

    return cached(key, build)


class Random(TensorOp):
    __slots__ = ("_dist", "name")

    def __init__(self, dist: str, args: tuple[Any, ...]) -> None:
        self._dist = dist
        self.name = f"ops.{dist}"
        super().__init__(args)

    def _check(self, *args: Any) -> None:
        shape, dtype, _seed, _offset, _a, _b, device, out = args
        if out is not None:
            check_out(self.name, out, shape, dtype, device)
            if out.dtype != dtype:
                raise TypeError(f"{self.name}: out= has dtype {out.dtype}, not {dtype}")

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        shape, dtype, seed, offset, a, b, device, out = args
        dev = out.device if out is not None else (device or lane.device)
        ln = lane.on(dev)
        dst: Tensor
        if out is not None:
            plan.use(out._buffer, out)
            dst = out
        else:
            dst = alloc(plan, ln, shape, dtype, self.name)
        n = math.prod(shape)
        if n == 0:
            return dst
        contiguous = dst if dst.is_contiguous else alloc(plan, ln, shape, dtype, self.name)
        flat = view(contiguous, (n,), (dtype.itemsize,))
        top = float(np.nextafter(dtype.type(b), dtype.type(-np.inf))) if self._dist == "uniform" and a != b else float(b)
        key = (np.uint64(seed & _MASK), np.uint64(seed >> 32), np.uint64(offset))
        args_ = (out_partition(flat), *key, float(a), float(b), max(top, float(a)), n)
        launch(plan, ln, _kernel(self._dist, dtype), args_)
        if contiguous is not dst:
            copy_into(plan, ln, dst, contiguous, self.name)
        return dst


def random(dist: str, shape: Any, seed: Any, a: Any, b: Any, dtype: Any, offset: Any, device: Any, out: Any) -> Random:
    name = f"ops.{dist}"
    if seed is None or not is_int(seed) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"{name}: seed must be an int in [0, 2**64) (counter-based: the seed is the whole state), not {seed!r}")
    if not is_int(offset) or not 0 <= int(offset) < 2**64:
        raise ValueError(f"{name}: offset must be an int in [0, 2**64), not {offset!r}")
    shp = check_shape(shape)
    dt = check_dtype(dtype)
    if dt not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"{name}: dtype must be float16, float32 or float64, not {dt}")
    for what, v in (("low/mean", a), ("high/std", b)):
        if not is_scalar(v) or isinstance(v, (complex, np.complexfloating)) or not math.isfinite(float(v)):
            raise ValueError(f"{name}: {what} must be a finite real number, not {v!r}")
    if dist == "uniform":
        if float(a) > float(b):
            raise ValueError(f"{name}: low must not exceed high, not {a!r} > {b!r}")
        with np.errstate(over="ignore"):
            if not (np.isfinite(dt.type(a)) and np.isfinite(dt.type(b))):
                raise ValueError(f"{name}: low and high must be finite in {dt}, not {a!r}, {b!r}")
            work = np.float64 if dt == np.float64 else np.float32  # the kernels' arithmetic
            if not np.isfinite(work(b) - work(a)):
                raise ValueError(f"{name}: high - low overflows {np.dtype(work)} ({a!r}, {b!r}); use a narrower range")
    if dist == "normal" and float(b) < 0:
        raise ValueError(f"{name}: std must not be negative, not {b!r}")
    if int(offset) + math.prod(shp) > 2**64:
        raise ValueError(f"{name}: offset + size exceeds 2**64 counters: the numbers would repeat")
    dev = as_device(device) if device is not None else None
    if out is not None:
        from ._core import tensor_arg

        out = tensor_arg(out, name, "out= tensor")
        if dev is not None and out.device is not dev:
            raise ValueError(f"{name}: out= is on device {out.device.ordinal}, not the device asked for ({dev.ordinal})")
        dev = out.device
    return Random(dist, (shp, dt, int(seed), int(offset), a, b, dev, out))


# -- dropout --------------------------------------------------------------------------------------
def _dropout_kernel(x_dt: np.dtype[Any], o_dt: np.dtype[Any], seed_dt: np.dtype[Any] | None, off_dt: np.dtype[Any] | None) -> Any:
    """``out[i] = x[i] * scale`` where the uniform of counter ``i + offset`` is >= ``p``,
    else 0; ``seed`` and ``offset`` are numbers or one-element tensors (read per thread)."""
    key = ("dropout", x_dt.str, o_dt.str, seed_dt and seed_dt.str, off_dt and off_dt.str)

    def build() -> Any:
        fname = f"dropout__{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"
        seed = "np.uint64(seed[0])" if seed_dt is not None else "np.uint64(seed)"
        off = "np.uint64(offset[0])" if off_dt is not None else "np.uint64(offset)"
        src = (
            f"def {fname}(out, x, seed, offset, p, scale, n):\n"
            "    i = cuda.grid(1)\n"
            "    if i < n:\n"
            f"        s_ = {seed}\n"
            "        key0 = s_ & MASK\n"
            "        key1 = s_ >> np.uint64(32)\n"
            f"        ctr = np.uint64(i) + {off}\n" + _PHILOX_SRC.replace("\n    ", "\n        ") + ""
            "        v = np.float32(np.float32(c0 >> np.uint64(8)) * np.float32(5.960464477539063e-08))\n"
            "        r = np.float32(0)\n"
            "        if v >= np.float32(p):\n"
            f"            r = {load_expr('x[i]', x_dt, 'np.float32')} * np.float32(scale)\n"
            f"        out[i] = {store_expr('r', o_dt)}\n"
        )

        def sim(out: np.ndarray, x: np.ndarray, seed: Any, offset: Any, p: float, scale: float, n: int) -> None:
            s = int(np.asarray(seed).reshape(-1)[0]) & ((1 << 64) - 1)
            o = int(np.asarray(offset).reshape(-1)[0]) & ((1 << 64) - 1)
            w0 = philox(np.arange(n, dtype=np.uint64) + np.uint64(o), s)[0]
            v = (w0 >> np.uint64(8)).astype(np.float32) * np.float32(5.960464477539063e-08)
            xs = bf16_to_f32(x) if x_dt == BFLOAT16 else np.asarray(x).astype(np.float32)
            with np.errstate(all="ignore"):
                r = np.where(v >= np.float32(p), xs * np.float32(scale), np.float32(0))
            if o_dt == BFLOAT16:
                np.copyto(out, f32_to_bf16(r))
            else:
                np.copyto(out, r, casting="unsafe")

        g = {"O": np.uint16 if o_dt == BFLOAT16 else o_dt.type, "MASK": np.uint64(_MASK)}
        g.update({"M0": np.uint64(_M0), "M1": np.uint64(_M1), "W0": np.uint64(_W0), "W1": np.uint64(_W1)})
        return make_kernel(fname, src, g, sim, flat_geometry)

    return cached(key, build)


class Dropout(TensorOp):
    __slots__ = ()
    _cacheable = True
    name = "ops.dropout"

    def _check(self, *args: Any) -> None:
        x, _p, seed, offset, out = args
        if not isinstance(x, Tensor):
            raise TypeError(f"ops.dropout: needs a tensor, not {type(x).__name__}")
        if x.dtype.kind != "f" and x.dtype != BFLOAT16:
            raise TypeError(f"ops.dropout: needs a floating tensor, not {x.dtype}")
        for what, v in (("seed", seed), ("offset", offset)):
            if isinstance(v, Tensor):
                if v.size != 1 or v.dtype.kind not in "iu":
                    raise TypeError(
                        f"ops.dropout: {what} must be an int or a one-element integer tensor, not {v.dtype} {v.shape}"
                    )
                if v.device is not x.device:
                    raise ValueError(f"ops.dropout: {what} is on device {v.device.ordinal}, x on {x.device.ordinal}")
        if out is not None:
            check_out(self.name, out, x.shape, x.dtype, x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, p, seed, offset, out = args
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        res = output(plan, ln, self.name, out, x.shape, x.dtype, x.device, (x,), inplace_ok=True)
        n = x.size
        if n == 0:
            return finish(plan, ln, res, self.name)
        dst = res.t
        flat = dst if dst.is_contiguous else alloc(plan, ln, x.shape, x.dtype, self.name)
        isz = x.dtype.itemsize
        xs = view(half_view(contiguous(plan, ln, x)), (n,), (isz,))
        scalars: list[Any] = []
        dts: list[Any] = []
        for v in (seed, offset):
            if isinstance(v, Tensor):
                plan.use(v._buffer, v)
                scalars.append(view(v, (1,), (v.dtype.itemsize,)))
                dts.append(v.dtype)
            else:
                scalars.append(np.uint64(v))
                dts.append(None)
        scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
        k = _dropout_kernel(x.dtype, x.dtype, dts[0], dts[1])
        launch(plan, ln, k, (out_partition(view(half_view(flat), (n,), (isz,))), xs, *scalars, float(p), scale, n))
        if flat is not dst:
            copy_into(plan, ln, dst, flat, self.name)
        return finish(plan, ln, res, self.name)


def dropout(x: Any, p: Any, seed: Any, offset: Any, out: Any) -> Dropout:
    name = "ops.dropout"
    if not is_scalar(p) or isinstance(p, (bool, np.bool_, complex)) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"{name}: p must be a probability in [0, 1], not {p!r}")
    args: list[Any] = []
    for what, v in (("seed", seed), ("offset", offset)):
        if is_int(v):
            if not 0 <= int(v) < 2**64:
                raise ValueError(f"{name}: {what} must be an int in [0, 2**64), not {v!r}")
            args.append(int(v))
        elif v is None or is_scalar(v):
            raise TypeError(f"{name}: {what} must be an int or a one-element integer tensor, not {v!r}")
        else:
            args.append(operand(v, name, what))
    return Dropout((operand(x, name), float(p), args[0], args[1], None if out is None else operand(out, name)))
