"""The simulated device's fused attention: numpy, with the softmax in float32.

Scores are computed in float32 from the stored inputs (float32 accumulation, as the
tensor cores do), scaled, biased and masked in float32, normalised by a float32
softmax, multiplied by V in float32 and rounded once into the output's dtype. (cuDNN
rounds the probabilities to the input's dtype before that last product: results agree
to that rounding.) A query row whose every key is masked gives NaN, as
``torch.nn.functional.scaled_dot_product_attention``'s reference does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._boundary import AttentionDesc, gemm_dtype

__all__ = ["attend"]


def _view(
    read: Callable[[int, int], np.ndarray], ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dt: Any
) -> np.ndarray:
    """The array of ``shape`` and element ``strides`` at ``ptr`` (read-only view)."""
    isz = dt.itemsize
    span = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * isz
    raw = read(ptr, span)
    return np.ndarray(shape, dtype=dt, buffer=raw, strides=tuple(s * isz for s in strides))


def attend(read: Callable[[int, int], np.ndarray], desc: AttentionDesc, q: int, k: int, v: int, bias: int, o: int) -> None:
    """Compute ``desc`` on the memory at the pointers (``read(ptr, nbytes)``: the bytes there)."""
    dt = gemm_dtype(desc.dtype)
    f32 = np.float32
    qs, ks, vs, os_ = desc.shapes
    x = _view(read, q, qs, desc.q_strides, dt).astype(f32)
    y = _view(read, k, ks, desc.k_strides, dt).astype(f32)
    z = _view(read, v, vs, desc.v_strides, dt).astype(f32)
    with np.errstate(all="ignore"):
        s = np.matmul(x, np.swapaxes(y, -1, -2)) * f32(desc.scale)
        if desc.bias_shape is not None:
            bs = desc.bias_shape
            c = (bs[1] * bs[2] * bs[3], bs[2] * bs[3], bs[3], 1)
            s = s + _view(read, bias, bs, c, dt).astype(f32)
        if desc.causal:
            above = np.triu(np.ones((desc.seq_q, desc.seq_k), dtype=bool), 1)
            s = np.where(above, f32(-np.inf), s)
        m = s.max(axis=-1, keepdims=True)
        e = np.exp(s - m)
        p = e / e.sum(axis=-1, keepdims=True)
        r = np.matmul(p, z)
    out = _view(read, o, os_, desc.o_strides, dt)
    out[...] = r.astype(dt)
