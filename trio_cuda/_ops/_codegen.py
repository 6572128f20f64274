"""The kernels the ops generate: numba-cuda source per (op, rank, dtypes), and its numpy
twin, which the simulated device runs instead.

Elementwise kernels take ``(out, operands..., n)``: ``out`` and every array operand are
views of the same (coalesced) shape, broadcast operands with zero strides; one thread
per element, the flat index unravelled over ``out``'s shape. Arithmetic runs in the
compute dtype ``C`` (float32 for half types), the store casts to ``out``'s dtype.

Generated functions get a stable module and name, and their source is registered with
``linecache``: their content fingerprint (the compile cache key) is stable across
processes, so the disk cache serves them.
"""

from __future__ import annotations

import hashlib
import linecache
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import BFLOAT16
from .._kernel import Kernel
from .._tensor import Tensor
from . import _core
from ._core import flat_geometry, rows_geometry, unrolled_geometry

__all__ = ["Load", "elementwise_kernel", "make_kernel", "row_loop"]

_lock = threading.Lock()
_kernels: dict[Any, Kernel] = {}
_MODULE = "trio_cuda._ops.generated"


@dataclass(frozen=True)
class Load:
    """How an operand enters the expression: ``array`` (a view) or ``scalar``; ``cast``:
    to the compute dtype (else raw); ``truth``: as a bool (``!= 0``); ``bf16``: an array of
    bfloat16 bits (see half_view), decoded first."""

    array: bool
    cast: bool = True
    truth: bool = False
    bf16: bool = False


def _np_name(dt: np.dtype[Any]) -> str:
    return "bool_" if dt == np.bool_ else dt.name


def make_kernel(
    name: str,
    source: str,
    globals_: dict[str, Any],
    sim: Callable[..., Any],
    geometry: Callable[..., Any],
) -> Kernel:
    """A Kernel from generated ``source`` (one function named ``name``)."""
    from numba import cuda  # the backend chose numba's mode when trio_cuda was imported

    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    filename = f"<trio_cuda.ops {name} {digest}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    g: dict[str, Any] = {"cuda": cuda, "math": math, "np": np, "__name__": _MODULE}
    g.update(half_globals())
    g.update(globals_)
    exec(compile(source, filename, "exec"), g)
    fn = g[name]
    fn.__module__ = _MODULE
    k = Kernel(fn, sim=sim, name=f"ops.{name.split('__')[0]}", geometry=geometry)
    k.generated = True  # type: ignore[attr-defined]  # the simulated device may run its numba code (tests)
    return k


def cached(key: Any, build: Callable[[], Kernel]) -> Kernel:
    k = _kernels.get(key)
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                k = _kernels[key] = build()
    return k


# -- bfloat16 in kernels: loaded as float32, stored rounded once -------------------------------
# numba has no bfloat16 arrays: kernels see bfloat16 tensors as uint16 views (see half_view)
# and convert with BF16_IN (exact: the bits are the top half of a float32) and BF16_OUT
# (round to nearest even, NaN kept quiet), which every generated kernel may call. On CUDA
# they are register bit casts (libdevice); numba's simulator has no libdevice, so there
# the same bits go through a one-element local array viewed as the other type.
_BF16_CUDA = """
def BF16_IN(u):
    return libdevice.int_as_float(np.int32(np.uint32(u) << np.uint32(16)))

def BF16_OUT(f):
    # 32-bit arithmetic (the sum wraps only for NaNs) and a select, no branch
    u = np.uint32(libdevice.float_as_int(np.float32(f)))
    rounded = np.uint32(u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.uint16(quiet if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)

# two half values per 32-bit word (the first in the low half): decoded to float32, and
# two float32 rounded once and packed
def BF16_LO(u):
    return libdevice.int_as_float(np.int32(np.uint32(u) << np.uint32(16)))

def BF16_HI(u):
    return libdevice.int_as_float(np.int32(np.uint32(u) & np.uint32(0xFFFF0000)))

def BF16_PACK(a, b):
    return np.uint32(BF16_OUT(a)) | (np.uint32(BF16_OUT(b)) << np.uint32(16))

# float16 through 32-bit integer and float32 arithmetic only: 16-bit values split from a
# 64-bit word (cvt to .f16 registers and back) came out in the wrong lanes on CUDA. Each
# case is computed and one kept (selects, no branches: the loads of a row stay in flight)
def F16_IN(h):
    # the float32 of half bits ``h`` (below 2**16), exactly: the exponent and mantissa
    # moved to float32's place and scaled by 2**112 in a float32 product (subnormals too),
    # inf and NaN given the whole exponent
    h = np.uint32(h)
    m = (h & np.uint32(0x7FFF)) << np.uint32(13)
    f = np.uint32(libdevice.float_as_int(libdevice.int_as_float(np.int32(m)) * np.float32(5.192296858534828e33)))
    top = np.uint32(0x7F800000) if (h & np.uint32(0x7C00)) == np.uint32(0x7C00) else np.uint32(0)
    return libdevice.int_as_float(np.int32(f | top | ((h & np.uint32(0x8000)) << np.uint32(16))))

def F16_OUT(f):
    # the half bits of float32 ``f``, rounded to nearest even once (NaN kept quiet): from
    # 2**-14 the exponent rebiased and the 13 dropped bits rounded (the sum carries 2**17,
    # masked off), below it the float32 adder rounding to a multiple of 2**-24, from 2**16 inf
    x = np.uint32(libdevice.float_as_int(np.float32(f)))
    sign = (x >> np.uint32(16)) & np.uint32(0x8000)
    x = x & np.uint32(0x7FFFFFFF)
    normal = ((x + np.uint32(0x08000FFF) + ((x >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)) & np.uint32(0xFFFF)
    small = np.uint32(libdevice.float_as_int(libdevice.int_as_float(np.int32(x)) + np.float32(0.5))) - np.uint32(0x3F000000)
    big = np.uint32(0x7E00) if x > np.uint32(0x7F800000) else np.uint32(0x7C00)
    o = small if x < np.uint32(0x38800000) else (big if x >= np.uint32(0x47800000) else normal)
    return np.uint32(o | sign)

def F16_LO(u):
    return F16_IN(np.uint32(u) & np.uint32(0xFFFF))

def F16_HI(u):
    return F16_IN(np.uint32(u) >> np.uint32(16))

def F16_PACK(a, b):
    return F16_OUT(a) | (F16_OUT(b) << np.uint32(16))
"""
_BF16_SIMULATOR = """
def BF16_IN(u):
    b = cuda.local.array(1, np.uint32)
    b[0] = np.uint32(u) << np.uint32(16)
    return b.view(np.float32)[0]

def BF16_OUT(f):
    b = cuda.local.array(1, np.float32)
    b[0] = np.float32(f)
    u = b.view(np.uint32)[0]
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

def BF16_LO(u):
    return np.uint32(np.uint32(u) << np.uint32(16)).view(np.float32)

def BF16_HI(u):
    return np.uint32(np.uint32(u) & np.uint32(0xFFFF0000)).view(np.float32)

def BF16_PACK(a, b):
    return np.uint32(BF16_OUT(a)) | (np.uint32(BF16_OUT(b)) << np.uint32(16))

def F16_IN(h):
    return np.float32(np.uint16(h).view(np.float16))

def F16_OUT(f):
    return np.uint32(np.float16(f).view(np.uint16))

def F16_LO(u):
    return F16_IN(np.uint32(u) & np.uint32(0xFFFF))

def F16_HI(u):
    return F16_IN(np.uint32(u) >> np.uint32(16))

def F16_PACK(a, b):
    return F16_OUT(a) | (F16_OUT(b) << np.uint32(16))
"""
# numpy's integer power, which integer loops of power call (the same source on CUDA and in
# the simulator): square and multiply in the loop's integer type, so a result beyond it
# wraps as numpy's (``one`` is 1 of that type); a negative exponent, which numpy refuses,
# gives 0, or 1 or -1 for a base of 1 or -1
_POWERS = """
def IPOW(b, e, one):
    zero = one - one
    if e < zero:
        if b == one:
            return one
        if b == zero - one:
            return one if (e & one) == zero else b
        return zero
    r = one
    while e > zero:
        if (e & one) != zero:
            r = r * b
        b = b * b
        e = e >> one
    return r

# numpy's float power, whose C pow is exact where the result is one rounding: exponents
# 1, 2 and -1 are computed as that one operation (the device's pow may miss them by an ulp)
def FPOW(b, e):
    if e == 1:
        return b
    if e == 2:
        return b * b
    if e == -1:
        return -e / b
    return b ** e
"""
_half: dict[str, Any] = {}


_HALF_NAMES = (
    "BF16_IN",
    "BF16_OUT",
    "BF16_LO",
    "BF16_HI",
    "BF16_PACK",
    "F16_IN",
    "F16_OUT",
    "F16_LO",
    "F16_HI",
    "F16_PACK",
    "IPOW",
    "FPOW",
)


def half_globals() -> dict[str, Any]:
    """``BF16_IN``, ``BF16_OUT``, their float16 twins, the packed forms, ``IPOW`` and
    ``FPOW``: numba device functions (see above) that every generated kernel may call."""
    if not _half:
        from numba import config, cuda
        from numba.cuda import libdevice

        src = (_BF16_SIMULATOR if config.ENABLE_CUDASIM else _BF16_CUDA) + _POWERS
        filename = "<trio_cuda.ops bfloat16>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        g: dict[str, Any] = {"cuda": cuda, "np": np, "libdevice": libdevice, "__name__": _MODULE}
        exec(compile(src, filename, "exec"), g)
        # (called under _lock, by make_kernel: setdefault keeps the first of racing threads);
        # the jitted function replaces the plain one in g, where the others call it
        for name in _HALF_NAMES:
            g[name].__module__ = _MODULE
            g[name] = _half.setdefault(name, cuda.jit(device=True)(g[name]))
    return _half


def half_view(t: Any) -> Any:
    """``t`` as a kernel sees it: a bfloat16 tensor as its uint16 bits, others as they are."""
    if t.dtype != BFLOAT16:
        return t
    return Tensor._new(t._buffer, t.shape, np.dtype(np.uint16), t._offset, t.strides, t._tracked)


def load_expr(src: str, dtype: np.dtype[Any], to: str) -> str:
    """Source loading ``src`` (an element of a tensor of ``dtype``) as constructor ``to``'s type."""
    return f"{to}(BF16_IN({src}))" if dtype == BFLOAT16 else f"{to}({src})"


def store_expr(value: str, dtype: np.dtype[Any], to: str = "O") -> str:
    """Source converting ``value`` for a store into a tensor of ``dtype`` (constructor ``to``)."""
    return f"BF16_OUT({value})" if dtype == BFLOAT16 else f"{to}({value})"


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """The numpy twin of BF16_IN on an array of uint16 bits."""
    return (np.asarray(a).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(r: Any) -> np.ndarray:
    """The numpy twin of BF16_OUT: uint16 bits of ``r`` rounded to bfloat16 (through float32)."""
    out = np.empty(np.shape(r), np.uint16)
    _to_bf16_sim(out, np.asarray(r, np.float32).view(np.uint32), 0)
    return out


# -- elementwise ----------------------------------------------------------------------------
def _unravel(rank: int, flat: str = "i", tag: str = "") -> tuple[list[str], str]:
    """Statements giving the indices ``i{tag}0..`` of flat index ``flat`` over ``out``'s
    shape, and the index expression."""
    if rank == 1:
        return [], flat
    r = f"r{tag}_"
    lines = [f"{r} = {flat}"]
    for d in range(rank - 1, 0, -1):
        lines.append(f"i{tag}{d} = {r} % out.shape[{d}]")
        lines.append(f"{r} = {r} // out.shape[{d}]")
    lines.append(f"i{tag}0 = {r}")
    return lines, ", ".join(f"i{tag}{d}" for d in range(rank))


def elementwise_kernel(
    op: str,
    expr: str,
    loads: tuple[Load, ...],
    rank: int,
    compute: np.dtype[Any],
    out_dtype: np.dtype[Any],
    np_fn: Callable[..., Any],
) -> Kernel:
    """The kernel computing ``out = expr(x0, x1, ...)`` elementwise (see the module doc).

    ``expr`` is numba source over ``x0, x1, ...`` (already loaded) and ``C`` (the compute
    dtype's constructor); ``np_fn`` computes the same on numpy arrays of the compute dtype.
    """
    key = ("ew", op, expr, loads, rank, compute.str, out_dtype.str)

    def build() -> Kernel:
        fname = f"{op}__{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"
        params = ["out"]
        for k, ld in enumerate(loads):
            params.append(f"a{k}" if ld.array else f"s{k}")
        params.append("n")

        def element(j: str) -> tuple[list[str], list[str]]:
            """(index and load statements, compute and store statements) of element
            ``i{j}``, names suffixed with ``j``."""
            first, idx = _unravel(rank, f"i{j}", f"{j}_")
            for k, ld in enumerate(loads):
                src = f"a{k}[{idx}]" if ld.array else f"s{k}"
                if ld.bf16:
                    src = f"BF16_IN({src})"
                if ld.truth:
                    first.append(f"x{k}_{j} = {src} != 0")
                elif ld.cast:
                    first.append(f"x{k}_{j} = C({src})")
                else:
                    first.append(f"x{k}_{j} = {src}")
            e = re.sub(r"\bx(\d+)\b", rf"x\1_{j}", expr)
            if out_dtype == np.bool_:
                store = f"out[{idx}] = r{j}_v != 0"
            else:
                store = f"out[{idx}] = {store_expr(f'r{j}_v', out_dtype)}"
            return first, [f"r{j}_v = {e}", store]

        # each thread takes elements t, t + 256, t + 512, t + 768 of its block's 1024: the
        # four loads come first, so four reads are in flight per thread
        body = [f"base = cuda.blockIdx.x * {256 * UNROLL} + cuda.threadIdx.x", f"if base + {256 * (UNROLL - 1)} < n:"]
        parts = [element(str(j)) for j in range(UNROLL)]
        for j in range(UNROLL):
            body.append(f"    i{j} = base + {256 * j}" if j else "    i0 = base")
            body += [f"    {line}" for line in parts[j][0]]
        for j in range(UNROLL):
            body += [f"    {line}" for line in parts[j][1]]
        body.append("else:")
        body.append(f"    for q_ in range({UNROLL}):")
        body.append("        i0 = base + q_ * 256")
        body.append("        if i0 < n:")
        body += [f"            {line}" for line in (*parts[0][0], *parts[0][1])]
        src = f"def {fname}({', '.join(params)}):\n"
        src += "".join(f"    {line}\n" for line in body)
        c_type = getattr(np, _np_name(compute))
        o_type = np.uint16 if out_dtype == BFLOAT16 else getattr(np, _np_name(out_dtype))

        def sim(out: np.ndarray, *args: Any) -> None:
            xs = []
            for ld, a in zip(loads, args[:-1], strict=True):
                if ld.bf16:
                    a = bf16_to_f32(a)
                if ld.truth:
                    xs.append(np.asarray(a) != 0)
                elif ld.cast:
                    xs.append(np.asarray(a).astype(c_type, copy=False) if ld.array else c_type(a))
                else:
                    xs.append(a)
            with np.errstate(all="ignore"):
                r = np_fn(*xs)
                if out_dtype == BFLOAT16:
                    np.copyto(out, f32_to_bf16(np.broadcast_to(r, out.shape)))
                else:
                    np.copyto(out, r, casting="unsafe")

        return make_kernel(fname, src, {"C": c_type, "O": o_type}, sim, unrolled_geometry)

    return cached(key, build)


# -- bit-exact conversions for bfloat16 (on integer views) ----------------------------------------
def _flat_kernel(key: Any, fname: str, rank: int, body: Callable[[str], list[str]], sim: Callable[..., Any]) -> Kernel:
    """A ``(out, a0, n)`` kernel, one thread per element: ``body(idx)`` gives the
    statements for the element at index expression ``idx`` of ``out`` and ``a0``."""

    def build() -> Kernel:
        unravel, idx = _unravel(rank)
        src = f"def {fname}(out, a0, n):\n    i = cuda.grid(1)\n    if i < n:\n"
        src += "".join(f"        {line}\n" for line in (*unravel, *body(idx)))
        return make_kernel(fname, src, {}, sim, flat_geometry)

    return cached(key, build)


def _to_bf16_sim(out: np.ndarray, a: np.ndarray, n: int) -> None:
    u = a.astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    np.copyto(out, (r & 0xFFFF).astype(np.uint16))


def _from_bf16_sim(out: np.ndarray, a: np.ndarray, n: int) -> None:
    np.copyto(out, a.astype(np.uint32) << np.uint32(16))


def f32_to_bf16_kernel(rank: int) -> Kernel:
    """out (uint16 view of bfloat16) = round-to-nearest-even of a0 (uint32 view of float32)."""
    return _flat_kernel(
        ("f32>bf16", rank),
        f"to_bfloat16__r{rank}",
        rank,
        lambda idx: [
            f"u = np.uint32(a0[{idx}])",
            "if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):",
            "    r = (u >> np.uint32(16)) | np.uint32(0x40)",
            "else:",
            "    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)",
            f"out[{idx}] = np.uint16(r)",
        ],
        _to_bf16_sim,
    )


def bf16_to_f32_kernel(rank: int) -> Kernel:
    """out (uint32 view of float32) = a0 (uint16 view of bfloat16) << 16."""
    return _flat_kernel(
        ("bf16>f32", rank),
        f"from_bfloat16__r{rank}",
        rank,
        lambda idx: [f"out[{idx}] = np.uint32(a0[{idx}]) << np.uint32(16)"],
        _from_bf16_sim,
    )


# -- row kernels: one block of 256 threads per row of a (rows, cols) view --------------------------
def block_reduce(
    var: str, combine: str, sm: str = "sm", threads: int = 256, more: tuple[tuple[str, str, str], ...] = ()
) -> list[str]:
    """Statements reducing ``var`` over the block into ``var`` of every thread (through
    shared array ``sm`` of ``threads`` elements); ``combine`` is an expression over
    ``{p}`` and ``{q}``. ``more``: further ``(var, combine, sm)`` reduced in the same
    barriers.

    Two levels, three barriers (a halving tree takes one per step, nine for 256
    threads): each of ``threads / 16`` threads combines a group of 16 partials into the
    group's first slot, then every thread combines those (the same address across a
    warp is one broadcast read)."""
    items = ((var, combine, sm), *more)
    groups = threads // 16
    lines = [f"{s}[t_] = {v}" for v, _, s in items]
    lines += ["cuda.syncthreads()", f"if t_ < {groups}:", "    g_ = t_ * 16"]
    for _v, comb, s in items:
        lines.append(f"    p_ = {s}[g_]")
        lines += [f"    p_ = {comb.format(p='p_', q=f'{s}[g_ + {i}]')}" for i in range(1, 16)]
        lines.append(f"    {s}[g_] = p_")
    lines.append("cuda.syncthreads()")
    for v, comb, s in items:
        lines.append(f"{v} = {s}[0]")
        lines += [f"{v} = {comb.format(p=v, q=f'{s}[{16 * i}]')}" for i in range(1, groups)]
    lines.append("cuda.syncthreads()")
    return lines


UNROLL = 4  # columns per thread per iteration of a row loop (their loads issue together)


def row_loop(
    load: Callable[[str, str], list[str]],
    use: Callable[[str, str], list[str]],
    unroll: int = UNROLL,
    threads: int = 256,
    k: str = "k",
) -> list[str]:
    """Statements running over the columns ``c = t_, t_ + threads, ... < k`` of a row,
    ``unroll`` columns per iteration: their loads (``load(c, j)``, defining names suffixed
    ``j``) come before their uses (``use(c, j)``), so each thread keeps that many memory
    reads in flight (one read at a time leaves HBM idle); then the remaining columns one
    by one. Read-only passes take 8, passes that also write 4."""
    step = threads * unroll
    cols = [f"c + {threads * j}" if j else "c" for j in range(unroll)]
    lines = ["c = t_", f"while c + {step - threads} < {k}:"]
    for j, col in enumerate(cols):
        lines += [f"    {line}" for line in load(col, str(j))]
    for j, col in enumerate(cols):
        lines += [f"    {line}" for line in use(col, str(j))]
    lines += [f"    c += {step}", f"while c < {k}:"]
    lines += [f"    {line}" for line in (*load("c", "0"), *use("c", "0"))]
    lines.append(f"    c += {threads}")
    return lines


def row_kernel(
    op: str,
    params: list[str],
    body: list[str],
    globals_: dict[str, Any],
    sim: Callable[..., Any],
    key: Any,
    threads: int = 256,
) -> Kernel:
    """A kernel run with one block of ``threads`` threads per row; ``params`` end with
    ``m`` (the number of rows), the body sees ``row`` and ``t_`` (the thread)."""

    def build() -> Kernel:
        fname = f"{op}__{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"
        # rows beyond the grid (2**31 - 1 blocks at most): each block takes every
        # gridDim.x-th row; the barrier keeps a row's shared memory from the next row's
        src = f"def {fname}({', '.join(params)}):\n    row = cuda.blockIdx.x\n    t_ = cuda.threadIdx.x\n    while row < m:\n"
        src += "".join(f"        {line}\n" for line in body)
        src += "        cuda.syncthreads()\n        row += cuda.gridDim.x\n"
        return make_kernel(fname, src, globals_, sim, rows_geometry if threads == 256 else _rows_geometry(threads))

    return cached(("row", key, threads), build)


def _rows_geometry(threads: int) -> Callable[..., tuple[tuple[int, ...], tuple[int, ...]]]:
    """rows_geometry with blocks of ``threads``."""

    def geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (min(max(1, int(args[-1])), _core.MAX_ROW_BLOCKS),), (threads,)

    return geometry
