"""Tensor math as DeviceOps: ``y = await ((x @ w1 + b1).relu() @ w2).to_host()``.

Every function returns a lazy :class:`~trio_cuda.DeviceOp` producing a
:class:`~trio_cuda.Tensor`; arguments may be tensors, partitions, tensor-producing ops
and scalars, so a whole expression is one submission awaited once. Elementwise ops
follow numpy's broadcasting and type promotion (Python scalars are weak, as in NEP 50);
``out=`` writes into an existing tensor instead of allocating (needed inside graph
captures, where allocation is refused). Bad input raises when the op is made (or, for
inputs that are ops, when the submission is planned), before any work runs.

On CUDA ``matmul`` and ``linear`` run on cuBLASLt (nvmath-python), everything else on
numba-cuda kernels the library generates; on the simulated device every op runs a numpy
implementation with the same arithmetic. See docs/ops.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _op
from ._op import DeviceOp, TensorValuedOp
from ._ops import (
    _attention,
    _create,
    _elementwise,
    _gather,
    _loss,
    _math,
    _matmul,
    _norm,
    _optim,
    _random,
    _reduce,
    _scan,
    _sort,
    _stats,
)
from ._ops._core import CacheStatistics, cache_statistics
from ._tensor import Partition, Tensor

# abs, all, any, max, min, pow, round and sum are not in __all__: `from trio_cuda.ops import *`
# must not shadow the builtins (use ops.sum, ...).
__all__ = [
    "ceil",
    "clip",
    "cos",
    "embedding",
    "erf",
    "floor",
    "power",
    "sign",
    "sin",
    "take",
    "take_along_axis",
    "invert",
    "bitwise_xor",
    "bitwise_or",
    "bitwise_and",
    "logical_not",
    "logical_xor",
    "logical_or",
    "logical_and",
    "isfinite",
    "isinf",
    "isnan",
    "greater_equal",
    "greater",
    "less_equal",
    "less",
    "not_equal",
    "equal",
    "add",
    "argmax",
    "argmin",
    "prod",
    "var",
    "std",
    "logsumexp",
    "cumsum",
    "sort",
    "argsort",
    "topk",
    "astype",
    "concatenate",
    "copy",
    "divide",
    "empty_like",
    "exp",
    "full_like",
    "gelu",
    "layer_norm",
    "linear",
    "log",
    "log_softmax",
    "matmul",
    "maximum",
    "mean",
    "minimum",
    "multiply",
    "negative",
    "normal",
    "ones_like",
    "relu",
    "rms_norm",
    "rsqrt",
    "scaled_dot_product_attention",
    "sigmoid",
    "silu",
    "softmax",
    "sqrt",
    "stack",
    "subtract",
    "tanh",
    "uniform",
    "where",
    "zeros_like",
    # training
    "adamw_step",
    "cross_entropy",
    "cross_entropy_grad",
    "dropout",
    "sgd_step",
    # the recipe cache
    "CacheStatistics",
    "cache_statistics",
]

TensorLike = Any  # a Tensor, a Partition, a DeviceOp producing one, or a scalar
Op = TensorValuedOp[Tensor]


# -- elementwise ------------------------------------------------------------------------------
def add(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x + y`` (numpy broadcasting and promotion)."""
    return _elementwise.elementwise("add", x, y, out=out)


def subtract(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x - y``."""
    return _elementwise.elementwise("subtract", x, y, out=out)


def multiply(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x * y``."""
    return _elementwise.elementwise("multiply", x, y, out=out)


def divide(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x / y`` (true division: integers give float64, as in numpy)."""
    return _elementwise.elementwise("divide", x, y, out=out)


def maximum(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """The elementwise maximum (NaN if either is NaN, as numpy's)."""
    return _elementwise.elementwise("maximum", x, y, out=out)


def minimum(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """The elementwise minimum (NaN if either is NaN)."""
    return _elementwise.elementwise("minimum", x, y, out=out)


def negative(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``-x``."""
    return _elementwise.elementwise("negative", x, out=out)


def abs(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``|x|``."""
    return _elementwise.elementwise("abs", x, out=out)


def exp(x: TensorLike, *, out: TensorLike = None) -> Op:
    return _elementwise.elementwise("exp", x, out=out)


def log(x: TensorLike, *, out: TensorLike = None) -> Op:
    """Natural logarithm (``-inf`` at 0, NaN below)."""
    return _elementwise.elementwise("log", x, out=out)


def sqrt(x: TensorLike, *, out: TensorLike = None) -> Op:
    return _elementwise.elementwise("sqrt", x, out=out)


def rsqrt(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``1 / sqrt(x)``."""
    return _elementwise.elementwise("rsqrt", x, out=out)


def tanh(x: TensorLike, *, out: TensorLike = None) -> Op:
    return _elementwise.elementwise("tanh", x, out=out)


# -- more math (elementwise) ----------------------------------------------------------------------
def sin(x: TensorLike, *, out: TensorLike = None) -> Op:
    """Sine (radians); integers give float64, as numpy's."""
    return _math.math_op("sin", x, out=out)


def cos(x: TensorLike, *, out: TensorLike = None) -> Op:
    """Cosine (radians)."""
    return _math.math_op("cos", x, out=out)


def erf(x: TensorLike, *, out: TensorLike = None) -> Op:
    """The error function (``scipy.special.erf``, ``torch.erf``)."""
    return _math.math_op("erf", x, out=out)


def floor(x: TensorLike, *, out: TensorLike = None) -> Op:
    """The largest integer <= x (integers and bools unchanged, as numpy's)."""
    return _math.math_op("floor", x, out=out)


def ceil(x: TensorLike, *, out: TensorLike = None) -> Op:
    """The smallest integer >= x."""
    return _math.math_op("ceil", x, out=out)


def round(x: TensorLike, decimals: int = 0, *, out: TensorLike = None) -> Op:
    """numpy's round: to ``decimals`` places, halves to even (``round(2.5) == 2``);
    integers to negative decimals through float64, keeping their dtype, as numpy's."""
    return _math.round_(x, decimals, out=out)


def sign(x: TensorLike, *, out: TensorLike = None) -> Op:
    """-1, 0 or 1 by the sign of x (NaN stays NaN)."""
    return _math.math_op("sign", x, out=out)


def power(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x ** y`` (numpy broadcasting and promotion). Integers are exact, wrapping past
    their dtype as numpy's; a negative integer exponent raises for a
    scalar exponent (as numpy) and gives 0 (1 or -1 for a base of 1 or -1) from a tensor."""
    return _math.power(x, y, out=out)


def clip(x: TensorLike, a_min: TensorLike, a_max: TensorLike, *, out: TensorLike = None) -> Op:
    """``minimum(maximum(x, a_min), a_max)`` (either bound may be None; NaN stays NaN)."""
    return _math.clip(x, a_min, a_max, out=out)


# -- gathers --------------------------------------------------------------------------------------
def take(x: TensorLike, indices: TensorLike, axis: int | None = None, *, out: TensorLike = None) -> Op:
    """Elements of ``x`` at ``indices`` (an integer tensor) along ``axis`` (None: of the
    flattened ``x``), as ``numpy.take``: the result has shape
    ``x.shape[:axis] + indices.shape + x.shape[axis + 1:]``. Negative indices count from
    the end (once, as numpy's); an index out of range fails the op with ``IndexError``
    (checked on the device, raised when the submission completes; inside a graph capture
    it is clamped and not reported)."""
    return _gather.take(x, indices, axis, out=out)


def take_along_axis(x: TensorLike, indices: TensorLike, axis: int | None, *, out: TensorLike = None) -> Op:
    """``numpy.take_along_axis``: ``out[..., i, ...] = x[..., indices[..., i, ...], ...]``
    along ``axis``, the other axes broadcast (``indices`` has the rank of ``x``; with
    axis=None, 1-D indices into the flattened ``x``). Indices are checked as in :func:`take`."""
    return _gather.take_along_axis(x, indices, axis, out=out)


def embedding(weight: TensorLike, ids: TensorLike, *, out: TensorLike = None) -> Op:
    """Rows of ``weight`` (num_embeddings, dim) at ``ids`` (any shape): the result has
    shape ``ids.shape + (dim,)``, as ``torch.nn.functional.embedding``; ids are checked
    as in :func:`take`."""
    return _gather.embedding(weight, ids, out=out)


# -- comparisons and logic (bool results) ----------------------------------------------------------
def equal(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x == y`` elementwise, a bool tensor (compared in the promoted dtype, as numpy's;
    NaN equals nothing)."""
    return _elementwise.elementwise("equal", x, y, out=out)


def not_equal(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x != y`` elementwise, a bool tensor (NaN differs from everything)."""
    return _elementwise.elementwise("not_equal", x, y, out=out)


def less(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x < y`` elementwise, a bool tensor."""
    return _elementwise.elementwise("less", x, y, out=out)


def less_equal(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x <= y`` elementwise, a bool tensor."""
    return _elementwise.elementwise("less_equal", x, y, out=out)


def greater(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x > y`` elementwise, a bool tensor."""
    return _elementwise.elementwise("greater", x, y, out=out)


def greater_equal(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x >= y`` elementwise, a bool tensor."""
    return _elementwise.elementwise("greater_equal", x, y, out=out)


def isnan(x: TensorLike, *, out: TensorLike = None) -> Op:
    """True where ``x`` is NaN (never for integers and bools)."""
    return _elementwise.elementwise("isnan", x, out=out)


def isinf(x: TensorLike, *, out: TensorLike = None) -> Op:
    """True where ``x`` is +inf or -inf."""
    return _elementwise.elementwise("isinf", x, out=out)


def isfinite(x: TensorLike, *, out: TensorLike = None) -> Op:
    """True where ``x`` is neither infinite nor NaN."""
    return _elementwise.elementwise("isfinite", x, out=out)


def logical_and(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x and y`` elementwise on truth values (nonzero is true), a bool tensor."""
    return _elementwise.elementwise("logical_and", x, y, out=out)


def logical_or(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x or y`` elementwise on truth values, a bool tensor."""
    return _elementwise.elementwise("logical_or", x, y, out=out)


def logical_xor(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """True where exactly one of ``x`` and ``y`` is true, a bool tensor."""
    return _elementwise.elementwise("logical_xor", x, y, out=out)


def logical_not(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``not x`` elementwise on truth values, a bool tensor."""
    return _elementwise.elementwise("logical_not", x, out=out)


def bitwise_and(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x & y`` on integers and bools (on bools: logical and, as numpy's)."""
    return _elementwise.elementwise("bitwise_and", x, y, out=out)


def bitwise_or(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x | y`` on integers and bools."""
    return _elementwise.elementwise("bitwise_or", x, y, out=out)


def bitwise_xor(x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x ^ y`` on integers and bools."""
    return _elementwise.elementwise("bitwise_xor", x, y, out=out)


def invert(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``~x`` on integers (bitwise) and bools (logical not, as numpy's)."""
    return _elementwise.elementwise("invert", x, out=out)


def where(cond: TensorLike, x: TensorLike, y: TensorLike, *, out: TensorLike = None) -> Op:
    """``x`` where ``cond`` is true (nonzero), else ``y`` (broadcast together)."""
    return _elementwise.where(cond, x, y, out=out)


# -- activations --------------------------------------------------------------------------------
def relu(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``max(x, 0)`` (NaN stays NaN)."""
    return _elementwise.elementwise("relu", x, out=out)


def gelu(x: TensorLike, *, approximate: str = "tanh", out: TensorLike = None) -> Op:
    """GELU: ``approximate="tanh"`` (the default, as cuBLASLt's epilogue and GPT-2) or
    ``"none"`` (exact, with erf), as ``torch.nn.functional.gelu``."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"ops.gelu: approximate must be 'tanh' or 'none', not {approximate!r}")
    return _elementwise.elementwise("gelu" if approximate == "tanh" else "gelu_exact", x, out=out)


def silu(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``x * sigmoid(x)``."""
    return _elementwise.elementwise("silu", x, out=out)


def sigmoid(x: TensorLike, *, out: TensorLike = None) -> Op:
    """``1 / (1 + exp(-x))``."""
    return _elementwise.elementwise("sigmoid", x, out=out)


# -- reductions -----------------------------------------------------------------------------------
def sum(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Sum over ``axis`` (an int, a tuple, or None for all); numpy's result dtypes
    (integers sum to int64)."""
    return _reduce.reduce("sum", x, axis, keepdims, out)


def mean(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Mean over ``axis`` (integers give float64; empty gives NaN)."""
    return _reduce.reduce("mean", x, axis, keepdims, out)


def max(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Maximum over ``axis`` (NaN if any is NaN)."""
    return _reduce.reduce("max", x, axis, keepdims, out)


def min(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Minimum over ``axis`` (NaN if any is NaN)."""
    return _reduce.reduce("min", x, axis, keepdims, out)


def argmax(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Index of the maximum along ``axis`` (an int, or None for the flattened tensor);
    the first occurrence, and the first NaN if any (numpy's rules); int64."""
    return _reduce.reduce("argmax", x, axis, keepdims, out)


def argmin(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Index of the minimum along ``axis`` (an int, or None for the flattened tensor);
    the first occurrence, and the first NaN if any (numpy's rules); int64."""
    return _reduce.reduce("argmin", x, axis, keepdims, out)


def prod(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Product over ``axis`` (integers multiply in int64, as numpy's; empty gives 1)."""
    return _reduce.reduce("prod", x, axis, keepdims, out)


def any(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """True where some element along ``axis`` is nonzero (NaN counts); a bool tensor."""
    return _reduce.reduce("any", x, axis, keepdims, out)


def all(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """True where every element along ``axis`` is nonzero (empty gives True)."""
    return _reduce.reduce("all", x, axis, keepdims, out)


def var(x: TensorLike, axis: Any = None, *, ddof: float = 0, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Variance over ``axis``: the mean squared deviation from the mean, divided by
    ``n - ddof`` (numpy's; ``ddof=1`` for the unbiased estimate); integers give float64."""
    return _stats.stat("var", x, axis, ddof, keepdims, out)


def std(x: TensorLike, axis: Any = None, *, ddof: float = 0, keepdims: bool = False, out: TensorLike = None) -> Op:
    """Standard deviation over ``axis``: ``sqrt(var(x, axis, ddof=ddof))``."""
    return _stats.stat("std", x, axis, ddof, keepdims, out)


def logsumexp(x: TensorLike, axis: Any = None, *, keepdims: bool = False, out: TensorLike = None) -> Op:
    """``log(sum(exp(x)))`` over ``axis``, computed shifted by the maximum (no overflow),
    as ``scipy.special.logsumexp`` and ``torch.logsumexp``; integers give float64."""
    return _stats.logsumexp(x, axis, keepdims, out)


def cumsum(x: TensorLike, axis: int | None = None, *, dtype: Any = None, out: TensorLike = None) -> Op:
    """Cumulative sum along ``axis`` (None: of the flattened tensor), numpy's result
    dtypes (integers and bools in int64) or ``dtype``."""
    return _scan.cumsum(x, axis, dtype, out)


# -- sorting ------------------------------------------------------------------------------------------
def sort(x: TensorLike, axis: int | None = -1, *, out: TensorLike = None) -> Op:
    """``x`` sorted along ``axis`` (None: flattened), ascending and stable (numpy's
    ``kind="stable"``), NaN last."""
    return _sort.sort("sort", x, axis, out)


def argsort(x: TensorLike, axis: int | None = -1, *, out: TensorLike = None) -> Op:
    """The int64 indices that sort ``x`` along ``axis`` (stable: equal values keep their order)."""
    return _sort.sort("argsort", x, axis, out)


def topk(
    x: TensorLike, k: int, *, largest: bool = True, out: tuple[Tensor, Tensor] | None = None
) -> DeviceOp[tuple[Tensor, Tensor]]:
    """The ``k`` largest elements along the last axis and their int64 indices, largest
    first (``largest=False``: the smallest, smallest first), as ``torch.topk``: an op
    producing ``(values, indices)`` (``values, indices = ops.topk(x, 5).unzip()``).
    Ties keep the lower index first; NaN counts as the largest."""
    return _sort.topk(x, k, largest, out)


# -- normalisation ----------------------------------------------------------------------------------
def softmax(x: TensorLike, axis: int = -1, *, out: TensorLike = None) -> Op:
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``."""
    return _reduce.softmax(x, axis, log=False, out=out)


def log_softmax(x: TensorLike, axis: int = -1, *, out: TensorLike = None) -> Op:
    """``x - max - log(sum(exp(x - max)))`` along ``axis``."""
    return _reduce.softmax(x, axis, log=True, out=out)


def layer_norm(
    x: TensorLike, weight: TensorLike = None, bias: TensorLike = None, eps: float = 1e-5, *, out: TensorLike = None
) -> Op:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last ``weight.ndim``
    axes (the last axis without a weight), as ``torch.nn.functional.layer_norm``."""
    return _norm.norm(False, x, weight, bias, eps, out)


def rms_norm(x: TensorLike, weight: TensorLike = None, eps: float = 1e-6, *, out: TensorLike = None) -> Op:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last ``weight.ndim`` axes."""
    return _norm.norm(True, x, weight, None, eps, out)


# -- matrices -----------------------------------------------------------------------------------------
def matmul(a: TensorLike, b: TensorLike, *, out: TensorLike = None, allow_tf32: bool = False) -> Op:
    """``a @ b`` with numpy's rules (1-D operands, broadcast batch dimensions); float16,
    bfloat16, float32 (``allow_tf32=True``: TF32 tensor cores) and float64; on CUDA
    cuBLASLt."""
    return _matmul.matmul(a, b, out=out, allow_tf32=allow_tf32)


def linear(
    x: TensorLike,
    w: TensorLike,
    bias: TensorLike = None,
    *,
    activation: str | None = None,
    out: TensorLike = None,
    allow_tf32: bool = False,
) -> Op:
    """``activation(x @ w.T + bias)``, ``w`` of shape (out_features, in_features) as in
    ``torch.nn.functional.linear``; ``activation``: None, "relu" or "gelu" (tanh
    approximation). On CUDA the bias and the activation are a cuBLASLt epilogue."""
    return _matmul.linear(x, w, bias, activation=activation, out=out, allow_tf32=allow_tf32)


# -- attention ---------------------------------------------------------------------------------------
def scaled_dot_product_attention(
    q: TensorLike,
    k: TensorLike,
    v: TensorLike,
    *,
    mask: TensorLike = None,
    is_causal: bool = False,
    scale: float | None = None,
    out: TensorLike = None,
) -> Op:
    """``softmax(q @ k.T * scale + mask) @ v`` over ``(batch, heads, seq, head_dim)``
    tensors, as ``torch.nn.functional.scaled_dot_product_attention``: float16 or
    bfloat16 (float32 on the simulated device), head dims multiples of 8 up to 128;
    ``mask`` boolean (True: attend) or additive of q's dtype, broadcastable to
    ``(batch, heads, seq_q, seq_k)``; ``is_causal``: query ``i`` sees keys ``j <= i``;
    ``scale`` defaults to ``1 / sqrt(head_dim)``. On CUDA one fused cuDNN kernel
    (nvidia-cudnn-frontend); on the simulated device numpy, the softmax in float32."""
    return _attention.scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, out=out)


# -- random ----------------------------------------------------------------------------------------------
def uniform(
    shape: Any,
    *,
    seed: int,
    low: float = 0.0,
    high: float = 1.0,
    dtype: Any = np.float32,
    offset: int = 0,
    device: Any = None,
    out: TensorLike = None,
) -> Op:
    """Uniform numbers in [low, high), counter-based (Philox4x32-10): element ``i`` comes
    from counter ``offset + i`` under ``seed``; the same on both backends."""
    return _random.random("uniform", shape, seed, low, high, dtype, offset, device, out)


def normal(
    shape: Any,
    *,
    seed: int,
    mean: float = 0.0,
    std: float = 1.0,
    dtype: Any = np.float32,
    offset: int = 0,
    device: Any = None,
    out: TensorLike = None,
) -> Op:
    """Normal numbers (Box-Muller on Philox4x32-10), counter-based like :func:`uniform`."""
    return _random.random("normal", shape, seed, mean, std, dtype, offset, device, out)


# -- training ------------------------------------------------------------------------------------------
def cross_entropy(
    logits: TensorLike,
    labels: TensorLike,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
    out: TensorLike = None,
) -> Op:
    """``logsumexp(logits[i]) - logits[i, labels[i]]`` for each row ``i``, averaged
    (``reduction="mean"``, a 0-d tensor), summed (``"sum"``) or kept (``"none"``, the
    labels' shape), as ``torch.nn.functional.cross_entropy`` of (N, C) logits and N
    integer labels; the classes are the last axis, so (B, T, C) logits take (B, T) labels.
    Rows whose label is ``ignore_index`` count for nothing (the mean of none is NaN, as
    PyTorch's); a label outside [0, C) makes its row's loss NaN. The logits' dtype,
    computed in float32 (float64 for float64). ``"none"`` is one kernel launch; the mean
    and the sum add the rows' losses in a fixed order through a temporary (inside a graph
    capture, use ``"none"`` with ``out=`` and ``ops.mean(..., out=...)``)."""
    return _loss.cross_entropy(logits, labels, ignore_index, reduction, out, grad=False)


def cross_entropy_grad(
    logits: TensorLike,
    labels: TensorLike,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
    out: TensorLike = None,
) -> Op:
    """The gradient of :func:`cross_entropy` (``reduction`` "mean" or "sum") with respect
    to the logits, in one kernel launch and without temporaries (it captures):
    ``(softmax(logits[i]) - onehot(labels[i])) / count`` for each row (``count``: the rows
    not ignored; 1 for the sum), zero for ignored rows; the logits' shape and dtype."""
    return _loss.cross_entropy(logits, labels, ignore_index, reduction, out, grad=True)


def dropout(x: TensorLike, p: float, seed: Any, *, offset: Any = 0, out: TensorLike = None) -> Op:
    """``x`` with each element zeroed with probability ``p`` and the rest divided by
    ``1 - p``. Element ``i`` is kept where ``uniform(..., seed=seed, offset=offset)[i] >=
    p`` (the same Philox numbers on both backends); ``seed`` and ``offset`` may be 0-d
    integer tensors, read on the device (a captured step draws a new mask per replay when
    they change). The backward is ``dropout(grad, p, seed, offset=offset)``."""
    return _random.dropout(x, p, seed, offset, out)


def sgd_step(
    params: Sequence[TensorLike],
    grads: Sequence[TensorLike],
    momentum_buffers: Sequence[TensorLike] | None = None,
    *,
    lr: Any,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> DeviceOp[tuple[Tensor, ...]]:
    """One SGD step on every parameter, in place, as ``torch.optim.SGD``: ``g = grad +
    weight_decay * p``; with momentum ``buf = momentum * buf + (1 - dampening) * g`` and
    ``g = buf`` (``g + momentum * buf`` with ``nesterov``); ``p -= lr * g``. One kernel
    launch per 8 parameters of a dtype signature (see docs/ops.md). ``lr`` is a number
    (baked into a captured graph) or a 0-d tensor (read at each run). The buffers start at zero (PyTorch's first step copies the
    gradient instead: the same unless ``dampening`` is set). The op's output is the tuple
    of the parameters."""
    return _optim.sgd_step(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov)


def adamw_step(
    params: Sequence[TensorLike],
    grads: Sequence[TensorLike],
    exp_avgs: Sequence[TensorLike],
    exp_avg_sqs: Sequence[TensorLike],
    *,
    lr: Any,
    step: Any,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> DeviceOp[tuple[Tensor, ...]]:
    """One AdamW step on every parameter, in place, with PyTorch's formula: ``p *= 1 - lr *
    weight_decay``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``; ``p -= lr / (1 -
    b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)``. One kernel launch per 8
    parameters of a dtype signature (see docs/ops.md). ``lr`` and ``step`` (the 1-based
    number of this update) are numbers or 0-d tensors read on the device, so a captured
    step is replayed with new values without re-capturing: increment the step tensor in
    the step itself (``ops.add(step, 1, out=step)``), before this op: a step tensor holding
    0 (it cannot be checked on the host) divides by zero, and every parameter becomes NaN,
    as PyTorch's formula does. States are zero-initialised tensors of the parameter's dtype
    or float32. The op's output is the tuple of the parameters."""
    return _optim.adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr, step, betas, eps, weight_decay)


# -- creation, casts, joins ------------------------------------------------------------------------------
def zeros_like(x: TensorLike, dtype: Any = None) -> Op:
    return _create.like("zeros", x, dtype)


def ones_like(x: TensorLike, dtype: Any = None) -> Op:
    return _create.like("ones", x, dtype)


def empty_like(x: TensorLike, dtype: Any = None) -> Op:
    """Uninitialised memory with the shape of ``x``."""
    return _create.like("empty", x, dtype)


def full_like(x: TensorLike, fill_value: Any, dtype: Any = None) -> Op:
    return _create.like("full", x, dtype, fill_value)


def astype(x: TensorLike, dtype: Any, *, copy: bool = True, out: TensorLike = None) -> Op:
    """``x`` converted to ``dtype`` (numpy's unsafe casting; bfloat16 rounds to nearest even)."""
    return _elementwise.astype(x, dtype, copy=copy, out=out)


def copy(x: TensorLike, *, out: TensorLike = None) -> Op:
    """A C-contiguous copy of ``x`` (of any view)."""
    if isinstance(x, Partition):
        x = x.tensor
    return _elementwise.astype(x, _dtype_of(x), copy=True, out=out) if isinstance(x, Tensor) else _copy_op(x, out)


def concatenate(xs: Sequence[TensorLike], axis: int = 0, *, out: TensorLike = None) -> Op:
    """The inputs joined along ``axis`` (numpy's promotion of their dtypes)."""
    return _create.concatenate(xs, axis, out=out)


def stack(xs: Sequence[TensorLike], axis: int = 0, *, out: TensorLike = None) -> Op:
    """The inputs (all of one shape) joined along a new ``axis``."""
    return _create.concatenate(xs, axis, out=out, new_axis=True)


def _dtype_of(x: Any) -> Any:
    return x.dtype


def _copy_op(x: Any, out: Any) -> Op:
    if not isinstance(x, DeviceOp):
        raise TypeError(f"ops.copy: needs a tensor or an op producing one, not {type(x).__name__}")
    return x.then(lambda t: _elementwise.astype(t, t.dtype, copy=True, out=out))


# -- the operators and methods of tensors and ops (see trio_cuda._op.extensions) ----------------------------
_op.extensions.update(
    {
        "add": add,
        "subtract": subtract,
        "multiply": multiply,
        "divide": divide,
        "pow": _math.pow_operator,
        "matmul": matmul,
        "negative": negative,
        "abs": abs,
        "relu": relu,
        "gelu": gelu,
        "silu": silu,
        "sigmoid": sigmoid,
        "exp": exp,
        "log": log,
        "sqrt": sqrt,
        "tanh": tanh,
        "sum": sum,
        "mean": mean,
        "max": max,
        "min": min,
        "argmax": argmax,
        "argmin": argmin,
        "var": var,
        "cumsum": cumsum,
        "std": std,
        "prod": prod,
        "any": any,
        "all": all,
        "softmax": softmax,
        "log_softmax": log_softmax,
        "astype": astype,
        "copy": copy,
        "equal": equal,
        "not_equal": not_equal,
        "less": less,
        "less_equal": less_equal,
        "greater": greater,
        "greater_equal": greater_equal,
        "bitwise_and": bitwise_and,
        "bitwise_or": bitwise_or,
        "bitwise_xor": bitwise_xor,
        "invert": invert,
        "power": power,
        "index": _gather.index,
        # planning helpers for the layers below (api.memcpy, dup): not part of this namespace
        "contiguous": _elementwise.contiguous,
        "copy_into": _elementwise.copy_into,
    }
)
