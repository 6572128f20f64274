"""layer_norm and rms_norm over the last axes: one block per row of a ``(rows, cols)`` view.

Two kernel shapes, both computing in float32 for half types (float64 for float64) and
rounding once when they store:

* **scalar**: any float dtype and layout; each thread walks the row's columns with a
  stride of the block size, one value per load (reads two passes over the row: the
  moments, then the normalised values).
* **packed** (float16 and bfloat16 rows that are contiguous, aligned and a multiple of
  the pack long): the row is read as 32-bit or 64-bit words of two or four values, the
  result stored the same way, so a load or a store moves as many bytes as float32's
  (or twice as many) instead of half. When the row's words fit in ``cache_words``
  registers per thread, the row is read from memory once and kept in registers for the
  second pass; longer rows are read again.

layer_norm takes both moments in one pass over the row shifted by its first element
(the shift keeps ``E[d**2] - E[d]**2`` from cancelling when the mean is large against the
spread). :data:`TUNING` holds the choices the probe ``benchmarks/probes/probe_norm.py``
times on CUDA.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_scalar
from .._plan import Lane, Plan
from .._tensor import Tensor
from ._codegen import block_reduce, half_view, row_kernel, row_loop
from ._core import TensorOp, alloc, check_out, launch, operand, out_partition, output
from ._elementwise import contiguous, copy_into, finish
from ._layout import compute_dtype, view
from ._reduce import _as_rows, _check_float, _host_in, _host_out, _ld, _np_name, _st, _unrolls

__all__ = ["TUNING", "Norm", "NormTuning", "norm"]

_F16 = np.dtype(np.float16)


@dataclass(frozen=True)
class NormTuning:
    """How the packed kernel runs (see the module doc).

    Attributes:
        threads: Threads per row (a multiple of 32, 64 to 1024).
        pack: The most half values per load and store: 4 (64-bit words), 2 (32-bit)
            or 1 (the scalar kernel).
        cache_words: The most words per thread kept in registers between the passes
            (0: every row is read twice).
    """

    threads: int = 256
    pack: int = 4
    cache_words: int = 0

    def __post_init__(self) -> None:
        if self.threads % 32 or not 64 <= self.threads <= 1024:
            raise ValueError(f"NormTuning: threads must be a multiple of 32 from 64 to 1024, not {self.threads}")
        if self.pack not in (1, 2, 4):
            raise ValueError(f"NormTuning: pack must be 1, 2 or 4, not {self.pack}")
        if not 0 <= self.cache_words <= 64:
            raise ValueError(f"NormTuning: cache_words must be 0 to 64, not {self.cache_words}")


#: The packed kernel's choices for every later call (a probe sets it; calls read it when
#: they plan, and a replayed recipe keeps the kernel it chose).
TUNING = NormTuning()


# -- the scalar kernel ----------------------------------------------------------------------
@functools.cache  # the kernel source is built once per key
def _norm_kernel(
    rms: bool, has_w: bool, has_b: bool, acc: np.dtype[Any], res: np.dtype[Any], w_bf16: bool = False, b_bf16: bool = False
) -> Any:
    a_t, o_t = getattr(np, _np_name(acc)), getattr(np, _np_name(res))
    bf16 = res == BFLOAT16  # the input's dtype too; w_bf16, b_bf16: the weight's, the bias's
    reads, writes = _unrolls(bf16)

    def weights(c: str, j: str) -> list[str]:
        return [f"w{j} = {_ld(f'w[{c}]', w_bf16)}"] * has_w + [f"b{j} = {_ld(f'b[{c}]', b_bf16)}"] * has_b

    scale = " * w{j}" if has_w else ""
    shift = " + b{j}" if has_b else ""
    if rms:
        body = [
            "sm = cuda.shared.array(256, A)",
            "s = A(0)",
            *row_loop(lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)}"], lambda c, j: [f"s += v{j} * v{j}"], reads),
            *block_reduce("s", "{p} + {q}"),
            "r = A(1) / math.sqrt(s / A(k) + eps)",
            *row_loop(
                lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)}", *weights(c, j)],
                lambda c, j: [f"out[row, {c}] = {_st(f'v{j} * r{scale.format(j=j)}', res)}"],
                writes,
            ),
        ]
    else:
        body = [
            "sm = cuda.shared.array(256, A)",
            "sq = cuda.shared.array(256, A)",
            "x0 = A(0)",
            "if k > 0:",
            f"    x0 = {_ld('x[row, 0]', bf16)}",
            "s = A(0)",
            "q2 = A(0)",
            *row_loop(
                lambda c, j: [f"d{j} = {_ld(f'x[row, {c}]', bf16)} - x0"],
                lambda c, j: [f"s += d{j}", f"q2 += d{j} * d{j}"],
                reads,
            ),
            *block_reduce("s", "{p} + {q}", more=(("q2", "{p} + {q}", "sq"),)),
            *_moments(),
            *row_loop(
                lambda c, j: [f"v{j} = {_ld(f'x[row, {c}]', bf16)}", *weights(c, j)],
                lambda c, j: [f"out[row, {c}] = {_st(f'(v{j} - mean) * r{scale.format(j=j)}{shift.format(j=j)}', res)}"],
                writes,
            ),
        ]
    params = ["out", "x", *(["w"] if has_w else []), *(["b"] if has_b else []), "eps", "k", "m"]

    def sim(out: np.ndarray, x: np.ndarray, *rest: Any) -> None:
        it = iter(rest)
        w = _host_in(next(it), w_bf16, a_t) if has_w else None
        b = _host_in(next(it), b_bf16, a_t) if has_b else None
        _host_out(out, _reference(rms, _host_in(x, bf16, a_t), w, b, a_t(next(it))), res)

    op = "rms_norm" if rms else "layer_norm"
    key = ("norm", rms, has_w, has_b, acc.str, res.str, w_bf16, b_bf16)
    return row_kernel(op, params, body, {"A": a_t, "O": o_t}, sim, key)


def _moments() -> list[str]:
    """Statements giving ``mean`` and ``r`` (1 / the deviation) from the shifted sums."""
    return [
        "md = s / A(k)",
        "var = q2 / A(k) - md * md",
        "if var < A(0):",
        "    var = A(0)",
        "mean = x0 + md",
        "r = A(1) / math.sqrt(var + eps)",
    ]


def _reference(rms: bool, v: np.ndarray, w: Any, b: Any, eps: Any) -> Any:
    """The numpy twin's arithmetic on the decoded rows ``v`` (the accumulator dtype)."""
    with np.errstate(all="ignore"):
        if rms:
            r = v / np.sqrt(np.mean(v * v, axis=1, keepdims=True) + eps)
        else:
            d = v - np.mean(v, axis=1, keepdims=True)
            r = d / np.sqrt(np.mean(d * d, axis=1, keepdims=True) + eps)
        if w is not None:
            r = r * w
        if b is not None:
            r = r + b
    return r


# -- the packed kernel ----------------------------------------------------------------------
def _decode(u: str, name: str, bf16: bool, q: int) -> list[str]:
    """Statements giving ``name0 .. name{q-1}``, the float32 values of word ``u``."""
    lo, hi = ("BF16_LO", "BF16_HI") if bf16 else ("F16_LO", "F16_HI")
    lines = []
    if not u.isidentifier():  # one load (a store between two might alias it)
        lines.append(f"{name}u = {u}")
        u = f"{name}u"
    if q == 2:
        return [*lines, f"{name}0 = {lo}({u})", f"{name}1 = {hi}({u})"]
    return [
        *lines,
        f"{name}l = np.uint32({u} & np.uint64(0xFFFFFFFF))",
        f"{name}h = np.uint32({u} >> np.uint64(32))",
        f"{name}0 = {lo}({name}l)",
        f"{name}1 = {hi}({name}l)",
        f"{name}2 = {lo}({name}h)",
        f"{name}3 = {hi}({name}h)",
    ]


def _encode(values: list[str], bf16: bool) -> str:
    """The word of ``values`` (float32 expressions, two or four), each rounded once."""
    pack = "BF16_PACK" if bf16 else "F16_PACK"
    if len(values) == 2:
        return f"{pack}({values[0]}, {values[1]})"
    return f"np.uint64({pack}({values[0]}, {values[1]})) | (np.uint64({pack}({values[2]}, {values[3]})) << np.uint64(32))"


@functools.cache  # the kernel source is built once per key
def _packed_kernel(
    rms: bool, w_mode: str | None, b_mode: str | None, bf16: bool, q: int, threads: int, nw: int, has_w: bool, has_b: bool
) -> Any:
    """The packed kernel: rows of ``kw`` words of ``q`` half values (bfloat16 when
    ``bf16``, else float16), ``threads`` per row, ``nw`` words per thread kept in
    registers (0: read twice). ``w_mode``/``b_mode``: ``"packed"`` (words of the row's
    type), ``"bf16"`` (bfloat16 bits, one value per load) or ``"plain"`` (a float array)."""
    a_t = np.float32
    wt = np.uint32 if q == 2 else np.uint64

    def weight(p: str, mode: str | None, c: str, j: str) -> list[str]:
        """Statements defining ``{p}{j}_0 ..``: the weight's (or bias's) values of word ``c``."""
        if mode == "packed":
            return _decode(f"{p}[{c}]", f"{p}{j}_", bf16, q)
        return [f"{p}{j}_{i} = {_ld(f'{p}[({c}) * {q} + {i}]', mode == 'bf16')}" for i in range(q)]

    def values(j: str, c: str) -> list[str]:
        return [*weight("w", w_mode, c, j)] * has_w + [*weight("b", b_mode, c, j)] * has_b

    def result(j: str, i: int) -> str:
        e = f"v{j}_{i} * r" if rms else f"(v{j}_{i} - mean) * r"
        return e + (f" * w{j}_{i}" if has_w else "") + (f" + b{j}_{i}" if has_b else "")

    def moments(j: str) -> list[str]:
        if rms:
            return [f"s += v{j}_{i} * v{j}_{i}" for i in range(q)]
        return [line for i in range(q) for line in (f"d_ = v{j}_{i} - x0", "s += d_", "q2 += d_ * d_")]

    def store(j: str, c: str) -> list[str]:
        return [*values(j, c), f"out[row, {c}] = {_encode([result(j, i) for i in range(q)], bf16)}"]

    body = [f"sm = cuda.shared.array({threads}, A)", "s = A(0)"]
    if not rms:
        first = _decode("x[row, 0]", "f_", bf16, q)
        body += [f"sq = cuda.shared.array({threads}, A)", "q2 = A(0)", *first, "x0 = f_0"]
    reduce_ = block_reduce("s", "{p} + {q}", threads=threads, more=() if rms else (("q2", "{p} + {q}", "sq"),))
    finish_ = ["r = A(1) / math.sqrt(s / A(k) + eps)"] if rms else _moments()
    if nw:
        cols = [f"c{j}" for j in range(nw)]
        for j, c in enumerate(cols):
            body += [f"{c} = t_ + {threads * j}", f"u{j} = W(0)", f"if {c} < kw:", f"    u{j} = x[row, {c}]"]
        for j, c in enumerate(cols):
            body += [f"if {c} < kw:", *(f"    {line}" for line in (*_decode(f"u{j}", f"v{j}_", bf16, q), *moments(str(j))))]
        body += [*reduce_, *finish_]
        for j, c in enumerate(cols):
            body += [f"if {c} < kw:", *(f"    {line}" for line in (*_decode(f"u{j}", f"v{j}_", bf16, q), *store(str(j), c)))]
    else:
        reads, writes = 32 // (2 * q), 16 // (2 * q)  # the bytes in flight of float32's 8 and 4
        body += row_loop(lambda c, j: _decode(f"x[row, {c}]", f"v{j}_", bf16, q), lambda c, j: moments(j), reads, threads, "kw")
        body += [*reduce_, *finish_]
        body += row_loop(
            lambda c, j: [*_decode(f"x[row, {c}]", f"v{j}_", bf16, q), *values(j, c)],
            lambda c, j: [f"out[row, {c}] = {_encode([result(j, i) for i in range(q)], bf16)}"],
            writes,
            threads,
            "kw",
        )
    params = ["out", "x", *(["w"] if has_w else []), *(["b"] if has_b else []), "eps", "k", "kw", "m"]
    half = np.uint16 if bf16 else np.float16

    res: np.dtype[Any] = BFLOAT16 if bf16 else _F16  # type: ignore[assignment]

    def decoded(a: np.ndarray, mode: str | None) -> Any:
        if mode == "packed":
            return _host_in(a.view(np.uint16), True, a_t) if bf16 else a.view(np.float16).astype(a_t)
        return _host_in(a, mode == "bf16", a_t)

    def sim(out: np.ndarray, x: np.ndarray, *rest: Any) -> None:
        it = iter(rest)
        w = decoded(next(it), w_mode) if has_w else None
        b = decoded(next(it), b_mode) if has_b else None
        r = _reference(rms, decoded(x, "packed"), w, b, a_t(next(it)))
        _host_out(out.view(half), r, res)

    op = "rms_norm" if rms else "layer_norm"
    key = ("norm-packed", rms, w_mode, b_mode, bf16, q, threads, nw, has_w, has_b)
    return row_kernel(op, params, body, {"A": a_t, "W": wt}, sim, key, threads)


def _aligned(t: Tensor, n: int) -> bool:
    """Whether ``t``'s first element is ``n``-byte aligned (pool memory: 256-byte aligned
    before its address is known)."""
    p = t._buffer.ptr
    return ((p or 0) + t._offset) % n == 0


def _pack(x: Tensor, rows: Tensor, flat: Tensor, k: int) -> int:
    """Values per word of the packed kernel for these rows (1: the scalar kernel)."""
    if x.dtype != BFLOAT16 and x.dtype != _F16:
        return 1
    q = TUNING.pack
    while q > 1:
        nb = 2 * q
        s0, s1 = rows.strides
        if k % q == 0 and s1 == 2 and (rows.shape[0] == 1 or s0 % nb == 0) and _aligned(rows, nb) and _aligned(flat, nb):
            return q
        q //= 2
    return 1


class Norm(TensorOp):
    """layer_norm / rms_norm over the last ``weight.ndim`` axes (the last axis without a weight)."""

    __slots__ = ("_rms", "name")
    _cacheable = True

    def __init__(self, rms: bool, args: tuple[Any, ...]) -> None:
        self._rms = rms
        self.name = "ops.rms_norm" if rms else "ops.layer_norm"
        super().__init__(args)

    def _check(self, *args: Any) -> None:
        x, w, b, _eps, out = args
        if not isinstance(x, Tensor):
            raise TypeError(f"{self.name}: needs a tensor, got {arg_type(x)}")
        _check_float(self.name, x)
        if x.ndim == 0:
            raise ValueError(f"{self.name}: needs at least one dimension")
        for what, p in (("weight", w), ("bias", b)):
            if p is None:
                continue
            if not isinstance(p, Tensor):
                raise TypeError(f"{self.name}: the {what} must be a tensor, not {arg_type(p)}")
            if p.dtype.kind != "f" and p.dtype != BFLOAT16:
                raise TypeError(f"{self.name}: the {what} must be floating, not {p.dtype}")
            if p.device is not x.device:
                raise ValueError(f"{self.name}: the {what} is on device {p.device.ordinal}, x on {x.device.ordinal}")
            if p.ndim == 0 or p.shape != x.shape[x.ndim - p.ndim :]:
                raise ValueError(f"{self.name}: the {what} of shape {p.shape} does not match the last axes of x {x.shape}")
        if w is not None and b is not None and w.shape != b.shape:
            raise ValueError(f"{self.name}: weight {w.shape} and bias {b.shape} differ in shape")
        if out is not None:
            check_out(self.name, out, x.shape, x.dtype, x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, w, b, eps, out = args
        nd = w.ndim if w is not None else (b.ndim if b is not None else 1)
        ln = lane.on(x.device)
        for t in (x, w, b):
            if t is not None:
                plan.use(t._buffer, t)
        result = output(plan, ln, self.name, out, x.shape, x.dtype, x.device, (x, w, b), inplace_ok=True)
        dst = result.t
        if x.size == 0:
            return finish(plan, ln, result, self.name)
        axes = tuple(range(x.ndim - nd, x.ndim))
        rows, m, k = _as_rows(plan, ln, x, axes)
        flat = dst if dst.is_contiguous else alloc(plan, ln, x.shape, x.dtype, self.name)
        isz = x.dtype.itemsize
        acc = compute_dtype(x.dtype)
        q = _pack(x, rows, flat, k)
        ps = [contiguous(plan, ln, p) if p is not None else None for p in (w, b)]
        if q == 1:
            params: list[Any] = [out_partition(half_view(view(flat, (m, k), (k * isz, isz)))), half_view(rows)]
            params += [half_view(view(p, (k,), (p.dtype.itemsize,))) for p in ps if p is not None]
            halves = (w is not None and w.dtype == BFLOAT16, b is not None and b.dtype == BFLOAT16)
            kernel = _norm_kernel(self._rms, w is not None, b is not None, acc, x.dtype, *halves)
            launch(plan, ln, kernel, (*params, acc.type(eps), k, m))
        else:
            nb, kw = 2 * q, k // q
            word = np.dtype(np.uint32 if q == 2 else np.uint64)
            params = [out_partition(view(flat, (m, kw), (kw * nb, nb), word)), view(rows, (m, kw), (rows.strides[0], nb), word)]
            modes: list[str | None] = []
            for p in ps:
                if p is None:
                    modes.append(None)
                elif p.dtype == x.dtype and _aligned(p, nb):
                    modes.append("packed")
                    params.append(view(p, (kw,), (nb,), word))
                else:
                    modes.append("bf16" if p.dtype == BFLOAT16 else "plain")
                    params.append(half_view(view(p, (k,), (p.dtype.itemsize,))))
            t = TUNING
            per = -(-kw // t.threads)
            # a power of two words (fewer kernels to compile), at most the cache
            nw = min(1 << (per - 1).bit_length(), t.cache_words) if per <= t.cache_words else 0
            kernel = _packed_kernel(
                self._rms, modes[0], modes[1], x.dtype == BFLOAT16, q, t.threads, nw, w is not None, b is not None
            )
            launch(plan, ln, kernel, (*params, np.float32(eps), k, kw, m))
        if flat is not dst:
            copy_into(plan, ln, dst, flat, self.name)
        return finish(plan, ln, result, self.name)


def _eps(name: str, eps: Any) -> float:
    if type(eps) is float and 0 <= eps < math.inf:  # the common case, first
        return eps
    if not is_scalar(eps) or isinstance(eps, (bool, np.bool_, complex, np.complexfloating)):
        raise TypeError(f"{name}: eps must be a real number, not {eps!r}")
    e = float(eps)
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"{name}: eps must be finite and non-negative, not {eps!r}")
    return e


def _norm_param(name: str, what: str, p: Any) -> Any:
    if p is None or type(p) is Tensor:  # the common cases, without the checks' calls
        return p
    p = operand(p, name, what)
    if is_scalar(p):
        raise TypeError(f"{name}: the {what} must be a tensor, not a scalar")
    return p


def norm(rms: bool, x: Any, weight: Any, bias: Any, eps: Any, out: Any) -> Norm:
    name = "ops.rms_norm" if rms else "ops.layer_norm"
    w = _norm_param(name, "weight", weight)
    b = _norm_param(name, "bias", bias)
    if type(x) is not Tensor:
        x = operand(x, name)
    e = _eps(name, eps)
    if out is not None and type(out) is not Tensor:
        out = operand(out, name)
    return Norm(rms, (x, w, b, e, out))
