"""Cross-entropy of logits against integer labels, and its gradient with respect to the logits.

The class axis is the last: logits of shape ``(..., C)``, labels of shape ``(...)``. Both
ops run one block of 256 threads per row (as softmax does: a max pass, a sum-of-exp pass).
``cross_entropy`` writes each row's loss (and whether it counts) and, for ``"mean"`` and
``"sum"``, a one-block kernel then adds them in a fixed order (deterministic; the rows'
losses are a temporary, so inside a graph capture use ``reduction="none"`` with ``out=``).
``cross_entropy_grad`` is one launch writing ``(softmax - onehot) * scale``; with an
``ignore_index`` each block first counts the rows that count (reading every label: they are
few next to a row of logits), so no temporary is needed and the op captures.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_int
from .._plan import Lane, Plan
from .._tensor import Tensor
from ._codegen import bf16_to_f32, block_reduce, f32_to_bf16, half_view, load_expr, row_kernel, row_loop, store_expr
from ._core import TensorOp, alloc, check_out, launch, operand, out_partition, output
from ._elementwise import contiguous, copy_into, finish
from ._layout import view

__all__ = ["CrossEntropy", "cross_entropy"]

_MAX = "({p} if ({p} >= {q} or {p} != {p}) else {q})"
_REDUCTIONS = ("mean", "sum", "none")


def _np_name(dt: np.dtype[Any]) -> str:
    return "uint16" if dt == BFLOAT16 else dt.name


def _acc(dt: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def _host_rows(x: np.ndarray, dt: np.dtype[Any], a_t: Any) -> Any:
    return (bf16_to_f32(x) if dt == BFLOAT16 else x).astype(a_t)


def _lse(v: Any) -> Any:
    mx = np.max(v, axis=1, keepdims=True)
    return mx, np.sum(np.exp(v - mx), axis=1, keepdims=True)


@functools.cache  # the kernel source is built once per key
def _rows_kernel(
    x_dt: np.dtype[Any], l_dt: np.dtype[Any], has_ignore: bool, grad: bool, out_dt: np.dtype[Any], extra: bool
) -> Any:
    """grad=False: ``out[row, 0]`` each row's loss (and with ``extra``, ``out[row, 1]``
    whether it counts); grad=True: ``out[row, c]`` the gradient times ``scale`` (with
    ``extra``: times 1 / the number of rows that count, counted by every block)."""
    acc = _acc(x_dt)
    a_t = acc.type

    def ld(src: str) -> str:
        return load_expr(src, x_dt, "A")

    body = [
        "sm = cuda.shared.array(256, A)",
        "lab = np.int64(labels[row])",
        "ok = True" if not has_ignore else "ok = lab != np.int64(ignore)",
    ]
    if grad:
        body += ["sc = A(scale)"]
        if extra:  # the rows that count, over all labels (for the mean's 1 / count)
            body += [
                "cnt = A(0)",
                "r_ = t_",
                "while r_ < m:",
                "    if np.int64(labels[r_]) != np.int64(ignore):",
                "        cnt += A(1)",
                "    r_ += 256",
                *block_reduce("cnt", "{p} + {q}"),
                "sc = sc / cnt",
            ]
    body += [
        "mx = A(-math.inf)",
        *row_loop(lambda c, j: [f"v{j} = {ld(f'x[row, {c}]')}"], lambda c, j: [f"mx = {_MAX.format(p='mx', q='v' + j)}"], 8),
        *block_reduce("mx", _MAX),
        "s = A(0)",
        *row_loop(lambda c, j: [f"v{j} = {ld(f'x[row, {c}]')} - mx"], lambda c, j: [f"s += math.exp(v{j})"], 8),
        *block_reduce("s", "{p} + {q}"),
        "inside = lab >= 0 and lab < k",
    ]
    if grad:
        # an ignored row is zero; a label out of range makes the row NaN
        body += [
            "if not ok:",
            "    sc = A(0)",
            "rs = sc / s",
            "bad = ok and not inside",
            *row_loop(
                lambda c, j: [f"v{j} = {ld(f'x[row, {c}]')} - mx"],
                lambda c, j: [
                    f"g{j} = math.exp(v{j}) * rs",
                    f"if np.int64({c}) == lab:",
                    f"    g{j} -= sc",
                    "if bad:",
                    f"    g{j} = A(math.nan)",
                    f"out[row, {c}] = {store_expr(f'g{j}', out_dt)}",
                ],
            ),
        ]
        params = ["out", "x", "labels", "ignore", "scale", "k", "m"]
    else:
        body += [
            "if t_ == 0:",
            "    loss = A(0)",
            "    if ok:",
            "        if inside:",
            f"            loss = mx + math.log(s) - {ld('x[row, lab]')}",
            "        else:",
            "            loss = A(math.nan)",
            f"    out[row, 0] = {store_expr('loss', out_dt)}",
            *(["    out[row, 1] = A(1) if ok else A(0)"] if extra else []),
        ]
        params = ["out", "x", "labels", "ignore", "k", "m"]

    def sim(out: np.ndarray, x: np.ndarray, labels: np.ndarray, ignore: int, *rest: Any) -> None:
        k, m = rest[-2], rest[-1]
        lab = np.asarray(labels).astype(np.int64)
        ok = lab != ignore if has_ignore else np.ones(m, bool)
        inside = (lab >= 0) & (lab < k)
        with np.errstate(all="ignore"):
            v = _host_rows(x, x_dt, a_t)
            mx, s = _lse(v)
            picked = v[np.arange(m), np.where(inside, lab, 0)]
            if grad:
                sc = a_t(rest[0])
                if extra:
                    sc = sc / a_t(np.count_nonzero(ok))
                scs = np.where(ok, sc, a_t(0)).astype(a_t)[:, None]
                g = np.exp(v - mx) * (scs / s)
                rows = np.flatnonzero(inside)
                g[rows, lab[rows]] -= scs[rows, 0]
                g[ok & ~inside] = np.nan
                if out_dt == BFLOAT16:
                    np.copyto(out, f32_to_bf16(g))
                else:
                    np.copyto(out, g, casting="unsafe")
            else:
                loss = np.where(ok, np.where(inside, mx[:, 0] + np.log(s[:, 0]) - picked, np.nan), 0).astype(a_t)
                if out_dt == BFLOAT16:
                    out[:, 0] = f32_to_bf16(loss)
                else:
                    out[:, 0] = loss
                if extra:
                    out[:, 1] = ok

    return row_kernel(
        "cross_entropy_grad" if grad else "cross_entropy",
        params,
        body,
        {"A": a_t, "O": np.dtype(_np_name(out_dt)).type},
        sim,
        ("xent", x_dt.str, l_dt.str, has_ignore, grad, out_dt.str, extra),
    )


@functools.cache
def _total_kernel(acc: np.dtype[Any], res: np.dtype[Any], mean: bool) -> Any:
    """One block: ``out[0] = sum(parts[:, 0]) (/ sum(parts[:, 1]) for the mean)``, in a
    fixed order (each thread its rows with a stride of 256, then the block's tree)."""
    a_t = acc.type
    body = [
        "sm = cuda.shared.array(256, A)",
        "tot = A(0)",
        "cnt = A(0)",
        "r_ = t_",
        "while r_ < k:",
        "    tot += parts[r_, 0]",
        "    cnt += parts[r_, 1]",
        "    r_ += 256",
        *block_reduce("tot", "{p} + {q}"),
        *block_reduce("cnt", "{p} + {q}"),
        "if t_ == 0:",
        f"    out[0] = {store_expr('tot / cnt' if mean else 'tot', res)}",
    ]

    def sim(out: np.ndarray, parts: np.ndarray, k: int, m: int) -> None:
        with np.errstate(all="ignore"):
            tot = np.sum(parts[:, 0], dtype=a_t)
            r = tot / np.sum(parts[:, 1], dtype=a_t) if mean else tot
        if res == BFLOAT16:
            np.copyto(out, f32_to_bf16(np.full(1, r, np.float32)))
        else:
            np.copyto(out, np.full(1, r, a_t), casting="unsafe")

    return row_kernel(
        "cross_entropy_total",
        ["out", "parts", "k", "m"],
        body,
        {"A": a_t, "O": np.dtype(_np_name(res)).type},
        sim,
        ("xent-total", acc.str, res.str, mean),
    )


class CrossEntropy(TensorOp):
    __slots__ = ("_grad", "name")
    _cacheable = True

    def __init__(self, grad: bool, args: tuple[Any, ...]) -> None:
        self._grad = grad
        self.name = "ops.cross_entropy_grad" if grad else "ops.cross_entropy"
        super().__init__(args)

    def _shape(self, x: Any, labels: Any, reduction: str) -> tuple[int, ...]:
        name = self.name
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: the logits must be a tensor, not {arg_type(x)}")
        if not isinstance(labels, Tensor):
            raise TypeError(f"{name}: the labels must be a tensor of integers, not {arg_type(labels)}")
        if x.dtype.kind != "f" and x.dtype != BFLOAT16:
            raise TypeError(f"{name}: the logits must be floating, not {x.dtype}")
        if labels.dtype.kind not in "iu":
            raise TypeError(f"{name}: the labels must be integers, not {labels.dtype} (class indices; convert with astype)")
        if x.ndim == 0 or labels.shape != x.shape[:-1]:
            raise ValueError(
                f"{name}: logits of shape {x.shape} need labels of shape {x.shape[:-1]} (classes along the last axis), "
                f"not {labels.shape}"
            )
        if x.shape[-1] == 0 and labels.size:
            raise ValueError(f"{name}: logits of shape {x.shape} have no classes")
        if labels.device is not x.device:
            raise ValueError(f"{name}: the labels are on device {labels.device.ordinal}, the logits on {x.device.ordinal}")
        if self._grad:
            return x.shape
        return labels.shape if reduction == "none" else ()

    def _result_dtype(self, x: Tensor, reduction: str) -> np.dtype[Any]:
        return x.dtype

    def _check(self, *args: Any) -> None:
        x, labels, _ignore, reduction, out = args
        shape = self._shape(x, labels, reduction)
        if out is not None:
            check_out(self.name, out, shape, self._result_dtype(x, reduction), x.device)

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        x, labels, ignore, reduction, out = args
        shape = self._shape(x, labels, reduction)
        res = self._result_dtype(x, reduction)
        ln = lane.on(x.device)
        plan.use(x._buffer, x)
        plan.use(labels._buffer, labels)
        result = output(plan, ln, self.name, out, shape, res, x.device, (x, labels), inplace_ok=self._grad)
        dst = result.t
        k = x.shape[-1]
        m = x.size // k if k else labels.size
        acc = _acc(x.dtype)
        has_ignore = ignore is not None
        ign = int(ignore) if has_ignore else 0
        # what the scratch memory of a reduction is, in errors (a graph capture cannot
        # allocate it; the user's operands are what they can change)
        scratch = (
            f"{self.name}(reduction={reduction!r}) of logits {x.shape}: its per-row losses (scratch memory; "
            f"in a capture, use reduction='none' into an out= of shape {labels.shape}, then ops.sum or ops.mean "
            "with out=)"
        )
        if m == 0:
            if self._grad or reduction == "none":
                return finish(plan, ln, result, self.name)
            # no rows: NaN for the mean (as PyTorch's), 0 for the sum
            parts = alloc(plan, ln, (0, 2), acc, scratch)
            o = view(half_view(dst), (1,), (res.itemsize,))
            launch(plan, ln, _total_kernel(acc, res, reduction == "mean"), (out_partition(o), parts, 0, 1))
            return finish(plan, ln, result, self.name)
        isz = x.dtype.itemsize
        xc = contiguous(plan, ln, x, f"{self.name}: a contiguous copy of the logits {x.shape} (pass contiguous logits)")
        rows = view(half_view(xc), (m, k), (k * isz, isz))
        lc = contiguous(plan, ln, labels, f"{self.name}: a contiguous copy of the labels {labels.shape} (pass contiguous labels)")
        lab = view(lc, (m,), (labels.dtype.itemsize,))
        where = "out=" if out is not None else "the result"
        flat = dst if dst.is_contiguous else alloc(plan, ln, shape, res, f"{self.name}: a contiguous stand-in for {where}")
        if self._grad:
            mean = reduction == "mean"
            scale = 1.0 if not mean or has_ignore else 1.0 / m
            kern = _rows_kernel(x.dtype, labels.dtype, has_ignore, True, res, mean and has_ignore)
            o = view(half_view(flat), (m, k), (k * res.itemsize, res.itemsize))
            launch(plan, ln, kern, (out_partition(o), rows, lab, ign, acc.type(scale), k, m))
        elif reduction == "none":
            kern = _rows_kernel(x.dtype, labels.dtype, has_ignore, False, res, False)
            o = view(half_view(flat), (m, 1), (res.itemsize, res.itemsize))
            launch(plan, ln, kern, (out_partition(o), rows, lab, ign, k, m))
        else:
            parts = alloc(plan, ln, (m, 2), acc, scratch)
            launch(
                plan,
                ln,
                _rows_kernel(x.dtype, labels.dtype, has_ignore, False, acc, True),
                (out_partition(parts), rows, lab, ign, k, m),
            )
            o = view(half_view(flat), (1,), (res.itemsize,))
            launch(plan, ln, _total_kernel(acc, res, reduction == "mean"), (out_partition(o), parts, m, 1))
        if flat is not dst:
            copy_into(plan, ln, dst, flat, self.name)
        return finish(plan, ln, result, self.name)


def cross_entropy(logits: Any, labels: Any, ignore_index: Any, reduction: Any, out: Any, *, grad: bool) -> CrossEntropy:
    name = "ops.cross_entropy_grad" if grad else "ops.cross_entropy"
    if ignore_index is not None and not is_int(ignore_index):
        raise TypeError(f"{name}: ignore_index must be an int or None, not {ignore_index!r}")
    if reduction not in _REDUCTIONS or (grad and reduction == "none"):
        allowed = _REDUCTIONS[:2] if grad else _REDUCTIONS
        raise ValueError(f"{name}: reduction must be one of {', '.join(map(repr, allowed))}, not {reduction!r}")
    ign = None if ignore_index is None else int(ignore_index)
    return CrossEntropy(
        grad,
        (
            operand(logits, name, "logits"),
            operand(labels, name, "labels"),
            ign,
            reduction,
            None if out is None else operand(out, name),
        ),
    )
