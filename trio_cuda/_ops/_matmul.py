"""matmul (numpy's semantics, batched) and linear (PyTorch's), on cuBLASLt on CUDA.

Operands are passed to the library as they lie in memory when it can read them (row- or
column-major matrices, batches at a constant stride, broadcast batches at stride 0);
anything else is copied to contiguous memory first. The bias and the activation of
``linear`` are fused as a cuBLASLt epilogue. On the simulated device the same GEMM runs
in numpy with cuBLASLt's arithmetic (float32 accumulation, TF32 rounding when allowed).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .._backends._boundary import GemmDesc, GemmOperand
from .._checks import BFLOAT16
from .._direct import note_accesses, order_accesses
from .._plan import Lane, Plan
from .._stream import Stream
from .._tensor import Tensor
from ._core import TensorOp, alloc, check_out, device_of, operand, output, prepared_step, replayable_step
from ._elementwise import contiguous, copy_into, finish
from ._layout import broadcast_shape, one_stride, view

__all__ = ["Linear", "Matmul"]

_DTYPES = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    BFLOAT16: "bfloat16",
}


def _gemm_dtype(name: str, *tensors: Tensor) -> str:
    dt = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype != dt:
            dts = sorted({str(t.dtype) for t in tensors})
            raise TypeError(f"{name}: operands of dtypes {', '.join(dts)}; convert them to one with astype")
    got = _DTYPES.get(dt)
    if got is None:
        raise TypeError(f"{name}: dtype {dt} is not supported (float16, bfloat16, float32, float64)")
    return got


def _operand(plan: Plan, lane: Lane, t: Tensor, batch_shape: tuple[int, ...]) -> tuple[Tensor, GemmOperand]:
    """``t`` (..., rows, cols) broadcast to ``batch_shape`` as a GEMM operand, copied to
    contiguous memory if the library cannot read it as it is."""
    rows, cols = t.shape[-2:]
    isz = t.dtype.itemsize
    lead = len(batch_shape) - (t.ndim - 2)
    bstrides = [0] * lead + [
        0 if n == 1 and b != 1 else s for n, b, s in zip(t.shape[:-2], batch_shape[lead:], t.strides[:-2], strict=True)
    ]
    stride = one_stride(batch_shape, bstrides)  # the batch as one stride (0 without a batch), or None
    rs, cs = t.strides[-2:]
    layout: tuple[bool, int] | None = None
    if stride is not None and stride >= 0 and stride % isz == 0:
        if (cs == isz or cols == 1) and rs % isz == 0 and rs // isz >= max(cols, 1):
            layout = (False, max(rs // isz, cols, 1))
        elif (rs == isz or rows == 1) and cs % isz == 0 and cs // isz >= max(rows, 1):
            layout = (True, max(cs // isz, rows, 1))
    if layout is None:
        full = (*batch_shape, rows, cols)
        src = Tensor._new(t._buffer, full, t.dtype, t._offset, (*bstrides, rs, cs), t._tracked)
        c = contiguous(plan, lane, src)
        return c, GemmOperand(rows, cols, max(cols, 1), False, rows * cols if math.prod(batch_shape) > 1 else 0)
    return t, GemmOperand(rows, cols, layout[1], layout[0], (stride or 0) // isz)


def _align(*tensors: Tensor | None) -> int:
    a = 256
    for t in tensors:
        if t is not None:
            p = t.ptr
            a = min(a, p & -p if p else 256)
    return a


@replayable_step  # (desc, a, b, d, bias): a frozen GemmDesc and tensors
def _gemm_step(lane: Lane, arg: tuple[GemmDesc, Tensor, Tensor, Tensor, Tensor | None]) -> None:
    desc, a, b, d, bias = arg
    for t in (a, b, bias):
        if t is not None:
            lane.read(t._buffer, t._tracked)
    lane.write(d._buffer, d._tracked)
    align = _align(a, b, d, bias)  # known now that the memory is allocated
    if desc.align != align:
        desc = dataclasses.replace(desc, align=align)
    s = lane.stream
    # Whether the stream records a graph: known here, unless another library's stream
    # was wrapped on this device: that library may be capturing it, and one of ours that
    # waited for its work joins that capture (the backend then asks the driver).
    capturing = None if lane.device._foreign_streams else lane.plan.capture is not None
    bias_ptr = bias.ptr if bias is not None else 0
    lane.device._driver.matmul(desc, a.ptr, b.ptr, d.ptr, bias_ptr, s.handle, capturing, s._foreign)
    seq = lane.end()
    lane.wrote(d._buffer, seq, d._tracked)
    for t in (a, b, bias):
        if t is not None:
            lane.was_read(t._buffer, seq, t._tracked)


def _prepare_gemm(arg: tuple[GemmDesc, Tensor, Tensor, Tensor, Tensor | None]) -> Any:
    """_gemm_step prepared for the direct submissions of a recipe (see
    _core.prepared_step): the operands are the same memory each time, so the aligned
    descriptor and the addresses are computed once."""
    desc, a, b, d, bias = arg
    align = _align(a, b, d, bias)
    if desc.align != align:
        desc = dataclasses.replace(desc, align=align)
    static = (desc, a.ptr, b.ptr, d.ptr, bias.ptr if bias is not None else 0)
    reads: tuple[int, ...] = (1, 2)  # (not a conditional expression: Cython refuses one
    if bias is not None:  # between tuples of different lengths)
        reads = (1, 2, 4)
    return _gemm_direct, static, (3,), reads


def _gemm_direct(s: Stream, arg: tuple[tuple[GemmDesc, int, int, int, int], Any, Any]) -> None:
    """_gemm_step of a direct submission (not capturing), prepared: ordered after the
    pending accesses of its buffers on other streams and registered as their writer or
    reader, as the lane's accesses are. Under LOCK."""
    (desc, a, b, d, bias), writes, reads = arg
    order_accesses(s, writes, reads)
    device = s.device
    # As in _gemm_step: not capturing, unless another library's stream may be. The same
    # call (desc, pointers, stream) comes again at the recipe's next direct submission,
    # so the backend may replay it as a graph, except in a process that wrapped another
    # library's stream: that library's device-wide synchronize in another thread would
    # fail while the backend captures (see docs/ops.md).
    foreign_streams = device._foreign_streams
    capturing = None if foreign_streams else False
    device._driver.matmul(desc, a, b, d, bias, s.handle, capturing, s._foreign, not foreign_streams)
    s.seq += 1
    note_accesses(s, s.seq, writes, reads)


prepared_step(_gemm_step, _prepare_gemm)


def _plan_gemm(
    plan: Plan,
    lane: Lane,
    name: str,
    a: Tensor,
    b: Tensor,
    out: Any,
    result_shape: tuple[int, ...],
    batch_shape: tuple[int, ...],
    bias: Tensor | None,
    activation: str,
    allow_tf32: bool,
) -> Tensor:
    dtype = _gemm_dtype(name, a, b, *([bias] if bias is not None else []))
    dev = device_of(name, [a, b] + ([bias] if bias is not None else []))
    ln = lane.on(dev)
    for t in (a, b, bias):
        if t is not None:
            plan.use(t._buffer, t)
    result = output(plan, ln, name, out, result_shape, a.dtype, dev, (a, b, bias))
    dst = result.t
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = math.prod(batch_shape)
    if dst.size == 0:
        return finish(plan, ln, result, name)
    aa, oa = _operand(plan, ln, a, batch_shape)
    bb, ob = _operand(plan, ln, b, batch_shape)
    full = dst if dst.is_contiguous else None
    target = full if full is not None else alloc(plan, ln, result_shape, a.dtype, name)
    bias_t = contiguous(plan, ln, bias) if bias is not None else None
    desc = GemmDesc(m, n, k, batch, oa, ob, dtype, bias is not None, activation, bool(allow_tf32), 256)
    d2 = view(target, (batch, m, n), (m * n * a.dtype.itemsize, n * a.dtype.itemsize, a.dtype.itemsize))
    plan.step(ln, _gemm_step, (desc, aa, bb, d2, bias_t))
    plan.ops.append(name)
    if target is not dst:
        copy_into(plan, ln, dst, target, name)
    return finish(plan, ln, result, name)


class Matmul(TensorOp):
    __slots__ = ()
    _cacheable = True
    name = "ops.matmul"

    @staticmethod
    def _shapes(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...], tuple[int, ...]]:
        """(a as >= 2-D, b as >= 2-D, batch shape, result shape) by numpy's rules."""
        if not isinstance(a, Tensor) or not isinstance(b, Tensor):
            raise TypeError("ops.matmul: both operands must be tensors (scalars: use ops.multiply)")
        if a.ndim == 0 or b.ndim == 0:
            raise ValueError("ops.matmul: operands must have at least one dimension (0-d: use ops.multiply)")
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        if a2.shape[-1] != b2.shape[-2]:
            raise ValueError(f"ops.matmul: shapes {a.shape} and {b.shape} do not align ({a2.shape[-1]} != {b2.shape[-2]})")
        if a2.shape[-1] == 0:
            raise ValueError(f"ops.matmul: the inner dimension of {a.shape} @ {b.shape} is 0 (not supported)")
        batch = broadcast_shape("ops.matmul", a2.shape[:-2], b2.shape[:-2])
        result = (*batch, a2.shape[-2], b2.shape[-1])
        if a.ndim == 1:
            result = result[:-2] + result[-1:]
        if b.ndim == 1:
            result = result[:-1]
        return a2, b2, batch, result

    def _check(self, *args: Any) -> None:
        a, b, out, _tf32 = args
        _, _, _, result = self._shapes(a, b)
        _gemm_dtype(self.name, a, b)
        dev = device_of(self.name, [a, b])
        if out is not None:
            check_out(self.name, out, result, a.dtype, dev)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        a, b, out, allow_tf32 = args
        a2, b2, batch, result = self._shapes(a, b)
        full_shape = (*batch, a2.shape[-2], b2.shape[-1])
        if out is not None:
            out = operand(out, self.name)
            o = check_out(self.name, out, result, a.dtype, device_of(self.name, [a, b]))
            out = Tensor._new(
                o._buffer, full_shape, o.dtype, o._offset, _expand_strides(o, full_shape, a.ndim, b.ndim), o._tracked
            )
        d = _plan_gemm(plan, lane, self.name, a2, b2, out, full_shape, batch, None, "none", allow_tf32)
        return Tensor._new(d._buffer, result, d.dtype, d._offset, _squeeze_strides(d, a.ndim, b.ndim), d._tracked)


def _expand_strides(o: Tensor, full: tuple[int, ...], a_ndim: int, b_ndim: int) -> tuple[int, ...]:
    st = list(o.strides)
    if b_ndim == 1:
        st.append(o.dtype.itemsize)
    if a_ndim == 1:
        st.insert(len(st) - 1, 0)
    return tuple(st)


def _squeeze_strides(d: Tensor, a_ndim: int, b_ndim: int) -> tuple[int, ...]:
    st = list(d.strides)
    if b_ndim == 1:
        st.pop()
    if a_ndim == 1:
        st.pop(-2 if b_ndim != 1 else -1)
    return tuple(st)


def matmul(a: Any, b: Any, *, out: Any = None, allow_tf32: bool = False) -> Matmul:
    """``a @ b`` with numpy's rules (1-D operands, broadcast batch dimensions)."""
    if allow_tf32 is not False and allow_tf32 is not True:
        raise TypeError(f"ops.matmul: allow_tf32 must be a bool, not {allow_tf32!r}")
    n = "ops.matmul"
    # (a tensor is its own operand: the common case without a call)
    return Matmul(
        (
            a if type(a) is Tensor else operand(a, n),
            b if type(b) is Tensor else operand(b, n),
            out if out is None or type(out) is Tensor else operand(out, n),
            allow_tf32,
        )
    )


class Linear(TensorOp):
    __slots__ = ()
    _cacheable = True
    name = "ops.linear"

    def _check(self, *args: Any) -> None:
        x, w, bias, _act, out, _tf32 = args
        if not isinstance(x, Tensor) or not isinstance(w, Tensor):
            raise TypeError("ops.linear: x and w must be tensors")
        if w.ndim != 2:
            raise ValueError(f"ops.linear: w must be 2-D (out_features, in_features), got shape {w.shape}")
        if x.ndim == 0 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"ops.linear: x of shape {x.shape} does not end in in_features = {w.shape[1]}")
        if w.shape[1] == 0:
            raise ValueError("ops.linear: in_features is 0")
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise TypeError("ops.linear: the bias must be a tensor")
            if bias.shape != (w.shape[0],):
                raise ValueError(f"ops.linear: the bias must have shape ({w.shape[0]},), got {bias.shape}")
        _gemm_dtype(self.name, x, w, *([bias] if bias is not None else []))
        dev = device_of(self.name, [x, w] + ([bias] if bias is not None else []))
        if out is not None:
            check_out(self.name, out, (*x.shape[:-1], w.shape[0]), x.dtype, dev)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, w, bias, activation, out, allow_tf32 = args
        lead = x.shape[:-1]
        m = math.prod(lead)
        k = x.shape[-1]
        nout = w.shape[0]
        xs = x.reshape(m, k) if x.is_contiguous else None
        if xs is None:
            ln = lane.on(x.device)
            xs = contiguous(plan, ln, x).reshape(m, k)
        wt = w.T  # (in, out), column-major over w's memory
        o2 = o = None
        if out is not None:
            o = check_out(self.name, out, (*lead, nout), x.dtype, x.device)
            o2 = o.reshape(m, nout) if o.is_contiguous else None
        d = _plan_gemm(plan, lane, self.name, xs, wt, o2, (m, nout), (), bias, activation, allow_tf32)
        result = d.reshape(*lead, nout)
        if o is not None and o2 is None:  # a strided out=: computed, then copied into it
            copy_into(plan, lane.on(x.device), o, result, self.name)
            return o
        return result


def linear(
    x: Any, w: Any, bias: Any = None, *, activation: str | None = None, out: Any = None, allow_tf32: bool = False
) -> Linear:
    """``activation(x @ w.T + bias)`` with ``w`` of shape (out_features, in_features), as
    ``torch.nn.functional.linear``; ``activation`` is None, "relu" or "gelu" (the tanh
    approximation, cuBLASLt's epilogue), fused into the GEMM on CUDA."""
    n = "ops.linear"
    act = "none" if activation is None else activation
    if act not in ("none", "relu", "gelu"):
        raise ValueError(f"ops.linear: activation must be None, 'relu' or 'gelu', not {activation!r}")
    if not isinstance(allow_tf32, bool):
        raise TypeError(f"ops.linear: allow_tf32 must be a bool, not {allow_tf32!r}")
    b = None if bias is None else operand(bias, n, "bias")
    return Linear((operand(x, n), operand(w, n), b, act, None if out is None else operand(out, n), allow_tf32))
