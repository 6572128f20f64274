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
from ._op import DeviceOp
from ._ops import _create, _elementwise, _loss, _matmul, _optim, _random, _reduce
from ._tensor import Partition, Tensor

# abs, max, min and sum are not in __all__: `from trio_cuda.ops import *` must not
# shadow the builtins (use ops.sum, ...).
__all__ = [
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
]

TensorLike = Any  # a Tensor, a Partition, a DeviceOp producing one, or a scalar
Op = DeviceOp[Tensor]


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
    return _reduce.norm(False, x, weight, bias, eps, out)


def rms_norm(x: TensorLike, weight: TensorLike = None, eps: float = 1e-6, *, out: TensorLike = None) -> Op:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last ``weight.ndim`` axes."""
    return _reduce.norm(True, x, weight, None, eps, out)


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
    launch per parameter. ``lr`` is a number (baked into a captured graph) or a 0-d tensor
    (read at each run). The buffers start at zero (PyTorch's first step copies the
    gradient instead: the same unless ``dampening`` is set). The op's output is the tuple
    of the parameters."""
    return _optim.sgd_step(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov)  # type: ignore[return-value]


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
    b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)``. One kernel launch per parameter.
    ``lr`` and ``step`` (the 1-based number of this update) are numbers or 0-d tensors read
    on the device, so a captured step is replayed with new values without re-capturing:
    increment the step tensor in the step itself (``ops.add(step, 1, out=step)``). States
    are zero-initialised tensors of the parameter's dtype or float32. The op's output is the
    tuple of the parameters."""
    return _optim.adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr, step, betas, eps, weight_decay)  # type: ignore[return-value]


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
        # planning helpers for the layers below (api.memcpy, dup): not part of this namespace
        "contiguous": _elementwise.contiguous,
        "copy_into": _elementwise.copy_into,
    }
)
