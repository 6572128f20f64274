"""scaled_dot_product_attention: ``torch.nn.functional.scaled_dot_product_attention``'s
forward, fused: cuDNN's SDPA on CUDA, numpy (the softmax in float32) on the simulated
device.

q, k and v are ``(batch, heads, seq, head_dim)`` tensors of one dtype (float16 or
bfloat16; float32 on the simulated device only), read where they lie when the library
can read them (the last axis contiguous, the other strides multiples of 16 bytes: a
``(batch, seq, heads, head_dim)`` tensor transposed to heads-first is read in place),
else copied to contiguous memory first. The mask is boolean (True: attend) or additive
of q's dtype, broadcastable to ``(batch, heads, seq_q, seq_k)``; it is passed to the
library as an additive bias of shape ``(1 or batch, 1 or heads, seq_q, seq_k)``: a
boolean mask is turned into one (0 where True, -inf where False) by a kernel of the
same submission, a mask broadcast along the sequence axes is materialised.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._backends._boundary import AttentionDesc
from .._checks import BFLOAT16, arg_type, is_scalar
from .._device import Device
from .._direct import note_accesses, order_accesses
from .._plan import Lane, Plan
from .._stream import Stream
from .._tensor import Tensor, c_strides
from ._core import TensorOp, alloc, check_out, device_of, operand, output, prepared_step, replayable_step
from ._elementwise import _plan_elementwise, copy_into, finish
from ._layout import broadcast_view, view

__all__ = ["Attention", "scaled_dot_product_attention"]

NAME = "ops.scaled_dot_product_attention"
MAX_HEAD_DIM = 128
_DTYPES = {np.dtype(np.float16): "float16", BFLOAT16: "bfloat16", np.dtype(np.float32): "float32"}
_ALIGN = 16  # bytes: the library's alignment of addresses and strides


def _dims(q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int, int]:
    """(batch, heads, seq_q, seq_k, head_dim, head_dim_v), after checking the shapes."""
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{NAME}: {what} must be a tensor, not {arg_type(t)}")
        if t.ndim != 4:
            raise ValueError(f"{NAME}: {what} must be 4-D (batch, heads, seq, head_dim), got shape {t.shape}")
    b, h, sq, d = q.shape
    sk, dv = v.shape[2], v.shape[3]
    if k.shape[:2] != (b, h) or v.shape[:2] != (b, h):
        raise ValueError(
            f"{NAME}: q, k and v must have the same batch and heads, got q {q.shape}, k {k.shape}, v {v.shape} "
            "(grouped-query attention is not supported: repeat k's and v's heads)"
        )
    if k.shape[3] != d:
        raise ValueError(f"{NAME}: q and k must have the same head_dim, got q {q.shape} and k {k.shape}")
    if k.shape[2] != sk:
        raise ValueError(f"{NAME}: k and v must have the same sequence length, got k {k.shape} and v {v.shape}")
    if sk == 0:
        raise ValueError(f"{NAME}: k and v have no keys (shape {k.shape})")
    for what, n in (("q and k", d), ("v", dv)):
        if n == 0 or n > MAX_HEAD_DIM or n % 8:
            raise ValueError(f"{NAME}: the head_dim of {what} is {n}; it must be a multiple of 8 up to {MAX_HEAD_DIM}")
    return b, h, sq, sk, d, dv


def _bias_shape(mask: Any, q: Tensor, dims: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The shape of the bias the library is given for ``mask``, after checking it."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{NAME}: the mask must be a tensor, not {arg_type(mask)}")
    if mask.dtype != np.bool_ and mask.dtype != q.dtype:
        raise TypeError(
            f"{NAME}: a mask of dtype {mask.dtype}; it must be boolean (True: attend) or additive of q's dtype {q.dtype}"
        )
    b, h, sq, sk = dims[:4]
    full = (b, h, sq, sk)
    m4 = (1,) * (4 - mask.ndim) + mask.shape
    if mask.ndim > 4 or any(n != 1 and n != f for n, f in zip(m4, full, strict=True)):
        raise ValueError(f"{NAME}: a mask of shape {mask.shape} does not broadcast to (batch, heads, seq_q, seq_k) = {full}")
    return (b if m4[0] != 1 else 1, h if m4[1] != 1 else 1, sq, sk)


def _dtype_name(q: Tensor, k: Tensor, v: Tensor, dev: Device) -> str:
    for what, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{NAME}: q is {q.dtype} but {what} is {t.dtype}; convert them to one dtype with astype")
    driver = dev._driver
    driver.attention_check()  # ImportError saying what to install, before any work
    allowed = driver.attention_dtypes
    got = _DTYPES.get(q.dtype)
    if got is None or got not in allowed:
        raise TypeError(f"{NAME}: dtype {q.dtype} is not supported on device {dev.ordinal} ({', '.join(allowed)})")
    return got


def _elements(t: Tensor) -> tuple[int, int, int, int] | None:
    """``t``'s strides in elements if the library can read it in place (the last axis
    contiguous, the others at multiples of 16 bytes, aligned), else None."""
    isz = t.dtype.itemsize
    if t._offset % _ALIGN:
        return None
    out: list[int] = []
    inner = 1  # the elements one step of the next axis out must at least skip
    for n, s in zip(reversed(t.shape), reversed(t.strides), strict=True):
        if n == 1:
            s = inner * isz  # (any stride serves an axis of length 1)
        if s <= 0 or s % isz or (s % _ALIGN if out else s != isz):
            return None
        out.append(s // isz)
        inner = s // isz * n
    return (out[3], out[2], out[1], out[0])


def _readable(plan: Plan, lane: Lane, t: Tensor) -> tuple[Tensor, tuple[int, int, int, int]]:
    """``t`` as the library reads it (a contiguous copy if it cannot read ``t`` itself)."""
    st = _elements(t)
    if st is None:
        c = alloc(plan, lane, t.shape, t.dtype, "a contiguous copy")
        copy_into(plan, lane, c, t, NAME)
        t, st = c, _elements(c)
        assert st is not None
    return t, st


def _bias(plan: Plan, lane: Lane, mask: Tensor, shape: tuple[int, int, int, int], dtype: np.dtype[Any]) -> Tensor:
    """The mask as a C-contiguous additive bias of ``shape`` and ``dtype``."""
    lead = 4 - mask.ndim
    shape4 = (1,) * lead + mask.shape
    m4 = view(mask, shape4, c_strides(shape4, mask.dtype.itemsize)[:lead] + mask.strides)
    src = broadcast_view(m4, shape)
    if mask.dtype == np.bool_:
        work = np.dtype(np.float32) if dtype == BFLOAT16 else dtype
        add = _plan_elementwise(
            plan,
            lane,
            NAME,
            "(x1 if x0 else x2)",
            lambda c, a, b: np.where(c, a, b),
            (src, 0.0, -math.inf),
            ("truth", "num", "num"),
            work,
            work,
            None,
        )
        if work == dtype:
            return add
        src = add
    elif _elements(src) == tuple(s // src.dtype.itemsize for s in c_strides(shape, src.dtype.itemsize)):
        return src  # C-contiguous but for axes of length 1: read in place
    dst = alloc(plan, lane, shape, dtype, "an attention bias")
    copy_into(plan, lane, dst, src, NAME)
    return dst


@replayable_step  # (desc, q, k, v, bias, o): a frozen AttentionDesc and tensors
def _attention_step(lane: Lane, arg: tuple[AttentionDesc, Tensor, Tensor, Tensor, Tensor | None, Tensor]) -> None:
    desc, q, k, v, bias, o = arg
    for t in (q, k, v, bias):
        if t is not None:
            lane.read(t._buffer, t._tracked)
    lane.write(o._buffer, o._tracked)
    s = lane.stream
    # Whether the stream records a graph: known, unless another library's stream was
    # wrapped on this device (as for GEMMs, see _matmul._gemm_step).
    capturing = None if lane.device._foreign_streams else lane.plan.capture is not None
    b = bias.ptr if bias is not None else 0
    lane.device._driver.attention(desc, q.ptr, k.ptr, v.ptr, b, o.ptr, s.handle, capturing, s._foreign)
    seq = lane.end()
    lane.wrote(o._buffer, seq, o._tracked)
    for t in (q, k, v, bias):
        if t is not None:
            lane.was_read(t._buffer, seq, t._tracked)


def _prepare_attention(arg: tuple[AttentionDesc, Tensor, Tensor, Tensor, Tensor | None, Tensor]) -> Any:
    """_attention_step prepared for a recipe's direct submissions (see
    _core.prepared_step): the same memory each time, so the addresses are taken once."""
    desc, q, k, v, bias, o = arg
    static = (desc, q.ptr, k.ptr, v.ptr, bias.ptr if bias is not None else 0, o.ptr)
    reads: tuple[int, ...] = (1, 2, 3)  # (no conditional expression: see _matmul._prepare_gemm)
    if bias is not None:
        reads = (1, 2, 3, 4)
    return _attention_direct, static, (5,), reads


def _attention_direct(s: Stream, arg: tuple[tuple[AttentionDesc, int, int, int, int, int], Any, Any]) -> None:
    """_attention_step of a direct submission (not capturing, unless another library's
    stream may be: see _matmul._gemm_direct). Under LOCK."""
    (desc, q, k, v, bias, o), writes, reads = arg
    order_accesses(s, writes, reads)
    device = s.device
    capturing = None if device._foreign_streams else False
    device._driver.attention(desc, q, k, v, bias, o, s.handle, capturing, s._foreign)
    s.seq += 1
    note_accesses(s, s.seq, writes, reads)


prepared_step(_attention_step, _prepare_attention)


class Attention(TensorOp):
    __slots__ = ()
    _cacheable = True
    name = NAME

    def _check(self, *args: Any) -> None:
        q, k, v, mask, _causal, _scale, out = args
        dims = _dims(q, k, v)
        dev = device_of(NAME, [q, k, v] + ([mask] if isinstance(mask, Tensor) else []))
        _dtype_name(q, k, v, dev)
        if mask is not None:
            _bias_shape(mask, q, dims)
        if out is not None:
            check_out(NAME, out, (*dims[:3], dims[5]), q.dtype, dev)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        q, k, v, mask, causal, scale, out = args
        b, h, sq, sk, d, dv = dims = _dims(q, k, v)
        inputs = [q, k, v] + ([mask] if mask is not None else [])
        dev = device_of(NAME, inputs)
        dtype = _dtype_name(q, k, v, dev)
        bias_shape = _bias_shape(mask, q, dims) if mask is not None else None
        ln = lane.on(dev)
        for t in inputs:
            plan.use(t._buffer, t)
        shape = (b, h, sq, dv)
        res = output(plan, ln, NAME, out, shape, q.dtype, dev, inputs)
        dst = res.t
        if b * h * sq == 0:
            return finish(plan, ln, res, NAME)
        (qq, qs), (kk, ks), (vv, vs) = (_readable(plan, ln, t) for t in (q, k, v))
        target = dst if dst.is_contiguous and _elements(dst) is not None else alloc(plan, ln, shape, q.dtype, NAME)
        os_ = _elements(target)
        assert os_ is not None
        bias = _bias(plan, ln, mask, bias_shape, q.dtype) if mask is not None and bias_shape is not None else None
        sc = 1.0 / math.sqrt(d) if scale is None else scale
        desc = AttentionDesc(b, h, sq, sk, d, dv, dtype, sc, causal, qs, ks, vs, os_, bias_shape)
        plan.step(ln, _attention_step, (desc, qq, kk, vv, bias, target))
        plan.ops.append(NAME)
        if target is not dst:
            copy_into(plan, ln, dst, target, NAME)
        return finish(plan, ln, res, NAME)


def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, *, mask: Any = None, is_causal: bool = False, scale: Any = None, out: Any = None
) -> Attention:
    """``softmax(q @ k^T * scale + mask) @ v`` (see the module doc and docs/ops.md)."""
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{NAME}: is_causal must be a bool, not {is_causal!r}")
    if is_causal and mask is not None:
        raise ValueError(f"{NAME}: pass a mask or is_causal=True, not both (as torch's scaled_dot_product_attention)")
    sc: float | None = None
    if scale is not None:
        if isinstance(scale, (bool, np.bool_)) or not is_scalar(scale) or isinstance(scale, (complex, np.complexfloating)):
            raise TypeError(f"{NAME}: scale must be a real number or None, not {scale!r}")
        sc = float(scale)
        if not math.isfinite(sc):
            raise ValueError(f"{NAME}: scale must be finite, not {scale!r}")
    return Attention(
        (
            operand(q, NAME, "q"),
            operand(k, NAME, "k"),
            operand(v, NAME, "v"),
            None if mask is None else operand(mask, NAME, "mask"),
            bool(is_causal),
            sc,
            None if out is None else operand(out, NAME, "out= tensor"),
        )
    )
