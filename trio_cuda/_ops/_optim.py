"""Fused optimizer steps over lists of tensors: ``sgd_step`` and ``adamw_step``.

Each step is one op: multi-tensor kernel launches (as PyTorch's fused optimizers), each
over up to ``TENSORS_PER_LAUNCH`` parameters of one dtype signature, reading each
parameter, its gradient and its state once and writing the parameter and the state in
place: a step over ``n`` tensors of one signature is ``ceil(n / TENSORS_PER_LAUNCH)``
launches (empty tensors take none). The learning rate and the step count may be 0-d
tensors, read by the kernels on the device: a captured training step replays with the
values the tensors hold at each replay (a Python number is baked into the kernel's
arguments, and so into a captured graph). Arithmetic runs in float32 (float64 for float64
parameters); half-precision parameters and states are rounded once when stored."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._checks import BFLOAT16, arg_type, is_scalar
from .._plan import Lane, Plan
from .._tensor import Tensor
from ._codegen import bf16_to_f32, cached, f32_to_bf16, load_expr, make_kernel, store_expr
from ._core import LibraryOp, device_of, launch, operand, out_partition, overlaps
from ._layout import view

__all__ = ["OptimizerStep", "adamw_step", "sgd_step"]

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _is_float(dt: np.dtype[Any]) -> bool:
    return dt in _FLOATS or dt == BFLOAT16


def _np_type(dt: np.dtype[Any]) -> Any:
    return np.uint16 if dt == BFLOAT16 else dt.type


def _host_in(a: Any, dt: np.dtype[Any], c: Any) -> Any:
    """A kernel argument's values (numpy twin): bfloat16 bits decoded, in compute type ``c``."""
    return (bf16_to_f32(a) if dt == BFLOAT16 else np.asarray(a)).astype(c)


def _host_out(dst: np.ndarray, r: Any, dt: np.dtype[Any]) -> None:
    if dt == BFLOAT16:
        np.copyto(dst, f32_to_bf16(r))
    else:
        np.copyto(dst, r, casting="unsafe")


# -- the kernels ------------------------------------------------------------------------------
# A launch updates up to TENSORS_PER_LAUNCH tensors of one dtype signature: block b of the
# grid works on the tensor whose first block offset (o<k>, a scalar argument: captured
# graphs bake it like any other) is the last one <= b, each block on BLOCK * UNROLL * CHUNKS
# consecutive elements of its tensor (CHUNKS passes of BLOCK threads, UNROLL elements each,
# their loads issued together). The bias corrections and the hoisted constants are computed
# once per thread, for its UNROLL * CHUNKS elements. benchmarks/probes/probe_optim.py times
# the choices of these constants.
TENSORS_PER_LAUNCH = 8
BLOCK = 256  # threads per block
UNROLL = 4  # elements per thread per pass
CHUNKS = 4  # passes per block
# CUDA refuses a launch of more than 4096 bytes of parameters; numba passes a 1-D array as
# 7 eight-byte words (meminfo, parent, nitems, itemsize, data, shape, stride) and a scalar
# as one. A launch takes fewer tensors than TENSORS_PER_LAUNCH where they would pass this.
MAX_PARAM_BYTES = 3072
_ARRAY_BYTES = 56


def param_bytes(width: int, count: int, scalar_arrays: int, scalars: int) -> int:
    """The kernel parameter bytes of a launch over ``count`` tensors of ``width`` arrays
    each, with ``scalars`` scalar arguments of which ``scalar_arrays`` are 0-d tensors (and
    the ``count`` block offsets: ``count - 1`` first blocks and the grid's size)."""
    return _ARRAY_BYTES * (width * count + scalar_arrays) + 8 * (scalars - scalar_arrays + count)


def tensors_per_launch(width: int, scalar_arrays: int, scalars: int) -> int:
    """How many tensors one launch takes: TENSORS_PER_LAUNCH, fewer where their parameters
    would pass MAX_PARAM_BYTES."""
    k = max(1, TENSORS_PER_LAUNCH)
    while k > 1 and param_bytes(width, k, scalar_arrays, scalars) > MAX_PARAM_BYTES:
        k -= 1
    return k


def _kernel(
    kind: str,
    flags: tuple[Any, ...],
    tensors: tuple[tuple[str, np.dtype[Any]], ...],
    scalars: tuple[tuple[str, np.dtype[Any] | None], ...],
    compute: np.dtype[Any],
    setup: list[str],
    update: list[str],
    one: Callable[..., None],
    count: int,
) -> Any:
    """A kernel ``(tensors of slot 0..., tensors of slot 1..., ..., scalars..., o1, ...,
    o<count-1>, blocks)`` running ``update`` on each element of ``count`` tensors (see
    above): ``tensors`` are (name, dtype) of one slot's written then read operands (each
    loaded as ``<name>_<j>`` and, if written, stored from it), ``scalars`` (name, dtype of a
    one-element tensor, or None for a number of the compute type), loaded once per thread
    as ``<name>_``; ``setup`` runs once per thread after them. ``one(*slot, *scalars)`` is
    the numpy twin of one slot's update."""
    threads, unroll, chunks = BLOCK, UNROLL, CHUNKS
    key = (
        "optim",
        kind,
        flags,
        tuple((n, d.str) for n, d in tensors),
        tuple((n, d and d.str) for n, d in scalars),
        compute.str,
        count,
        threads,
        unroll,
        chunks,
    )
    width = len(tensors)

    def host(*args: Any) -> None:
        consts = args[width * count : width * count + len(scalars)]
        for k in range(count):
            one(*args[k * width : (k + 1) * width], *consts)

    def geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (max(1, int(args[-1])),), (threads,)

    def build() -> Any:
        fname = f"{kind}__{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"
        names = [n for n, _ in tensors]
        offsets = [f"o{k}" for k in range(1, count)]
        params = [f"{n}{k}" for k in range(count) for n in names] + [n for n, _ in scalars] + offsets + ["blocks"]
        # unsigned indices (every constant too: numba makes floats of int64 and uint64
        # mixed): a signed one costs each array access a select for negative indices
        body = ["blk = U(cuda.blockIdx.x)", "tid = U(cuda.threadIdx.x)"]
        for name, dt in scalars:
            body.append(f"{name}_ = " + (load_expr(f"{name}[0]", dt, "C") if dt is not None else name))
        body += setup
        for k in range(count):
            if count == 1:
                head, first = None, "blk"
            elif k == 0:
                head, first = "if blk < o1:", "blk"
            else:
                head, first = (f"elif blk < o{k + 1}:" if k < count - 1 else "else:"), f"(blk - o{k})"
            lines = _slot(k, tensors, update, first, threads, unroll, chunks)
            body += [head, *(f"    {line}" for line in lines)] if head else lines
        src = f"def {fname}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
        g: dict[str, Any] = {"C": compute.type, "U": np.uint64}
        for n, dt in tensors:
            g[f"T_{n}"] = _np_type(dt)
        return make_kernel(fname, src, g, host, geometry)

    return cached(key, build)


def _slot(
    k: int,
    tensors: tuple[tuple[str, np.dtype[Any]], ...],
    update: list[str],
    first: str,
    threads: int,
    unroll: int,
    chunks: int,
) -> list[str]:
    """The statements of a block of slot ``k``'s tensors (its block number ``first``)."""
    ren = {n: f"{n}{k}" for n, _ in tensors}

    def element(j: int) -> tuple[list[str], list[str]]:
        loads = [f"{n}_{j} = {load_expr(f'{n}{k}[i{j}]', dt, 'C')}" for n, dt in tensors]
        work = [_rename(line, {n: f"{n}_{j}" for n, _ in tensors}) for line in update]
        stores = [f"{n}{k}[i{j}] = {store_expr(f'{n}_{j}', dt, 'T_' + n)}" for n, dt in tensors if n in _WRITTEN]
        return loads, work + stores

    parts = [element(j) for j in range(unroll)]
    lines = [f"n_ = U({ren[tensors[0][0]]}.shape[0])", f"base = {first} * U({threads * unroll * chunks}) + tid"]
    lines += [f"for _ in range({chunks}):", f"    if base + U({threads * (unroll - 1)}) < n_:"]
    for j in range(unroll):
        lines.append(f"        i{j} = base + U({threads * j})")
        lines += [f"        {line}" for line in parts[j][0]]
    for j in range(unroll):
        lines += [f"        {line}" for line in parts[j][1]]
    lines += ["    elif base < n_:", "        i0 = base", f"        for _ in range({unroll}):", "            if i0 < n_:"]
    lines += [f"                {line}" for line in (*parts[0][0], *parts[0][1])]
    lines += [f"            i0 += U({threads})", f"    base += U({threads * unroll})"]
    return lines


_WRITTEN = ("p", "m", "v", "buf")


def _rename(line: str, names: dict[str, str]) -> str:
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda mt: names[mt.group(1)], line)


def _scalar_in(v: Any, dt: np.dtype[Any] | None, c: Any) -> Any:
    """A scalar argument's value in compute type ``c`` (numpy twin of its load)."""
    return c(v) if dt is None else _host_in(v, dt, c)[0]


def _adamw_kernel(
    dts: tuple[np.dtype[Any], ...],
    lr_dt: np.dtype[Any] | None,
    step_dt: np.dtype[Any] | None,
    compute: np.dtype[Any],
    count: int,
) -> Any:
    p_dt, m_dt, v_dt, g_dt = dts
    c = compute.type
    # (the bias corrections in the compute type, as PyTorch's fused kernel, once per thread;
    # the numbers arrive in the compute type: no float64 for float32 parameters)
    setup = [
        "bc1 = C(1) - math.pow(beta1_, step_)",
        "bc2s = math.sqrt(C(1) - math.pow(beta2_, step_))",
        "size_ = lr_ / bc1",
        "decay_ = C(1) - lr_ * wd_",
        "omb1_ = C(1) - beta1_",
        "omb2_ = C(1) - beta2_",
    ]
    # PyTorch's AdamW: decoupled weight decay, then the moments, then the bias-corrected step
    update = [
        "p = p * decay_",
        "m = beta1_ * m + omb1_ * g",
        "v = beta2_ * v + omb2_ * g * g",
        "p = p - size_ * m / (math.sqrt(v) / bc2s + eps_)",
    ]

    def one(p: Any, m: Any, v: Any, g: Any, lr: Any, step: Any, beta1: Any, beta2: Any, eps: Any, wd: Any) -> None:
        lr_, t_ = _scalar_in(lr, lr_dt, c), _scalar_in(step, step_dt, c)
        with np.errstate(all="ignore"):
            bc1 = c(1) - np.power(c(beta1), t_)
            bc2s = np.sqrt(c(1) - np.power(c(beta2), t_))
        b1, b2, wd_ = c(beta1), c(beta2), c(wd)
        with np.errstate(all="ignore"):
            pv, mv, vv, gv = (_host_in(a, dt, c) for a, dt in zip((p, m, v, g), dts, strict=True))
            pv = pv * (c(1) - lr_ * wd_)
            mv = b1 * mv + (c(1) - b1) * gv
            vv = b2 * vv + (c(1) - b2) * gv * gv
            pv = pv - (lr_ / bc1) * mv / (np.sqrt(vv) / bc2s + c(eps))
        for dst, r, dt in ((p, pv, p_dt), (m, mv, m_dt), (v, vv, v_dt)):
            _host_out(dst, r, dt)

    return _kernel(
        "adamw",
        (),
        (("p", p_dt), ("m", m_dt), ("v", v_dt), ("g", g_dt)),
        (("lr", lr_dt), ("step", step_dt), ("beta1", None), ("beta2", None), ("eps", None), ("wd", None)),
        compute,
        setup,
        update,
        one,
        count,
    )


def _sgd_kernel(
    dts: tuple[np.dtype[Any], ...],
    lr_dt: np.dtype[Any] | None,
    compute: np.dtype[Any],
    momentum: bool,
    decay: bool,
    nesterov: bool,
    count: int,
) -> Any:
    c = compute.type
    update = ["g = g + wd_ * p"] if decay else []
    if momentum:
        update.append("buf = mom_ * buf + omd_ * g")
        update.append("g = g + mom_ * buf" if nesterov else "g = buf")
    update.append("p = p - lr_ * g")
    names = ("p", "buf", "g") if momentum else ("p", "g")

    def one(*args: Any) -> None:
        arrays = args[: len(names)]
        lr, mom, damp, wd = args[len(names) :]
        lr_ = _scalar_in(lr, lr_dt, c)
        vals = dict(zip(names, (_host_in(a, dt, c) for a, dt in zip(arrays, dts, strict=True)), strict=True))
        with np.errstate(all="ignore"):
            g = vals["g"]
            if decay:
                g = g + c(wd) * vals["p"]
            if momentum:
                vals["buf"] = c(mom) * vals["buf"] + (c(1) - c(damp)) * g
                g = g + c(mom) * vals["buf"] if nesterov else vals["buf"]
            vals["p"] = vals["p"] - lr_ * g
        for name, a, dt in zip(names, arrays, dts, strict=True):
            if name != "g":
                _host_out(a, vals[name], dt)

    return _kernel(
        "sgd",
        (momentum, decay, nesterov),
        tuple(zip(names, dts, strict=True)),
        (("lr", lr_dt), ("mom", None), ("damp", None), ("wd", None)),
        compute,
        ["omd_ = C(1) - damp_"] if momentum else [],
        update,
        one,
        count,
    )


# -- the op -----------------------------------------------------------------------------------------
class OptimizerStep(LibraryOp):
    """One fused step over ``groups`` of (parameter, state..., gradient) tensors; the
    arguments are flat: ``(lr, step, *hyper, *group0, *group1, ...)``. Its output is the
    tuple of the (updated) parameters."""

    __slots__ = ("_hyper", "_kind", "_width", "name")

    def __init__(self, kind: str, width: int, hyper: tuple[Any, ...], args: tuple[Any, ...]) -> None:
        self._kind = kind
        self._width = width  # tensors per parameter: the parameter, its states, its gradient
        self._hyper = hyper  # Python numbers, checked and baked
        self.name = f"ops.{kind}_step"
        super().__init__(args)

    def _groups(self, args: tuple[Any, ...]) -> list[tuple[Tensor, ...]]:
        w = self._width
        flat = args[2:]
        return [tuple(flat[i : i + w]) for i in range(0, len(flat), w)]

    def _scalar_tensor(self, what: str, t: Any, kinds: str) -> None:
        if t is None or is_scalar(t):
            return
        if not isinstance(t, Tensor):
            raise TypeError(f"{self.name}: {what} must be a number or a one-element tensor, not {arg_type(t)}")
        if t.size != 1:
            raise ValueError(f"{self.name}: {what} must be a number or a one-element (0-d) tensor, not of shape {t.shape}")
        if not (_is_float(t.dtype) or (t.dtype.kind in kinds and t.dtype != np.bool_)):
            raise TypeError(
                f"{self.name}: {what} must be a tensor of a floating{' or integer' * ('i' in kinds)} dtype, not {t.dtype}"
            )

    def _check(self, *args: Any) -> None:
        name = self.name
        lr, step = args[0], args[1]
        self._scalar_tensor("lr", lr, "f")
        self._scalar_tensor("step", step, "fiu")
        groups = self._groups(args)
        what = ("param", *(("momentum buffer",) if self._kind == "sgd" else ("exp_avg", "exp_avg_sq")), "grad")
        if self._kind == "sgd" and self._width == 2:
            what = ("param", "grad")
        tensors: list[Tensor] = [t for t in (lr, step) if isinstance(t, Tensor)]
        for i, group in enumerate(groups):
            for w, t in zip(what, group, strict=True):
                if not isinstance(t, Tensor):
                    raise TypeError(f"{name}: {w} {i} must be a tensor, not {arg_type(t)}")
                tensors.append(t)
            p = group[0]
            if not _is_float(p.dtype):
                raise TypeError(f"{name}: param {i} has dtype {p.dtype}; parameters must be floating")
            for w, t in zip(what, group, strict=True):
                if t.shape != p.shape:
                    raise ValueError(f"{name}: {w} {i} has shape {t.shape}, its param {p.shape}")
                if not _is_float(t.dtype):
                    raise TypeError(f"{name}: {w} {i} has dtype {t.dtype}; it must be floating")
                if w not in ("param", "grad") and t.dtype not in (p.dtype, np.dtype(np.float32)):
                    raise TypeError(
                        f"{name}: {w} {i} has dtype {t.dtype}: states are of the param's dtype ({p.dtype}) or float32"
                    )
                if not t.is_contiguous:
                    raise ValueError(
                        f"{name}: {w} {i} is not C-contiguous (a copy: ops.copy(t); parameters and states are updated in place)"
                    )
        if tensors:
            device_of(name, tensors)
        # a written tensor must not share memory with any other operand (a state passed
        # for two parameters, a parameter listed twice, a gradient that is its parameter)
        by_buffer: dict[int, list[tuple[str, Tensor, bool]]] = {}
        for i, group in enumerate(groups):
            for j, (w, t) in enumerate(zip(what, group, strict=True)):
                by_buffer.setdefault(id(t._buffer), []).append((f"{w} {i}", t, j < len(group) - 1))
        for t, label in ((lr, "lr"), (step, "step")):
            if isinstance(t, Tensor):
                by_buffer.setdefault(id(t._buffer), []).append((label, t, False))
        for entries in by_buffer.values():
            for a in range(len(entries)):
                for b in range(a + 1, len(entries)):
                    (la, ta, wa), (lb, tb, wb) = entries[a], entries[b]
                    if (wa or wb) and overlaps(ta, tb):
                        raise ValueError(f"{name}: {la} and {lb} share memory (each parameter and state must be its own tensor)")

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Any:  # the tuple of the parameters
        lr, step = args[0], args[1]
        groups = self._groups(args)
        if not groups:
            return ()
        ln = lane.on(groups[0][0].device)
        scalar_args: list[Any] = []  # as the kernels take them: 0-d tensors as 1-element views
        scalar_dts: list[np.dtype[Any] | None] = []
        for t in (lr, step) if self._kind == "adamw" else (lr,):
            if isinstance(t, Tensor):
                plan.use(t._buffer, t)
                scalar_args.append(_bits(view(t, (1,), (t.dtype.itemsize,))))
                scalar_dts.append(t.dtype)
            else:
                scalar_args.append(float(t))
                scalar_dts.append(None)
        # the tensors by dtype signature (one kernel source each), in the parameters' order
        by_sig: dict[tuple[np.dtype[Any], ...], list[tuple[Tensor, ...]]] = {}
        out: list[Tensor] = []
        for group in groups:
            for t in group:
                plan.use(t._buffer, t)
            out.append(group[0])
            if group[0].size:
                by_sig.setdefault(tuple(t.dtype for t in group), []).append(group)
        nscalars = len(scalar_args) + len(self._hyper) - (self._kind == "sgd")
        k_max = tensors_per_launch(self._width, sum(d is not None for d in scalar_dts), nscalars)
        for dts, members in by_sig.items():
            compute = np.dtype(np.float64) if dts[0] == np.float64 else np.dtype(np.float32)
            c = compute.type
            consts = [e if isinstance(e, Tensor) else c(e) for e in scalar_args]
            if self._kind == "adamw":
                consts += [c(h) for h in self._hyper]
            else:
                consts += [c(h) for h in self._hyper[:3]]
            for first in range(0, len(members), k_max):
                chunk = members[first : first + k_max]
                if self._kind == "adamw":
                    k = _adamw_kernel(dts, scalar_dts[0], scalar_dts[1], compute, len(chunk))
                else:
                    momentum, _, wd, nesterov = self._hyper
                    k = _sgd_kernel(dts, scalar_dts[0], compute, momentum != 0, wd != 0, nesterov, len(chunk))
                per_block = BLOCK * UNROLL * CHUNKS
                kargs: list[Any] = []
                offsets: list[int] = []
                blocks = 0
                for group in chunk:
                    n = group[0].size
                    flat = [_bits(view(t, (n,), (t.dtype.itemsize,))) for t in group]
                    kargs += [out_partition(t) for t in flat[:-1]] + [flat[-1]]
                    offsets.append(blocks)
                    blocks += -(-n // per_block)
                launch(plan, ln, k, (*kargs, *consts, *(np.uint64(o) for o in offsets[1:]), np.uint64(blocks)))
        return tuple(out)


def _bits(t: Tensor) -> Tensor:
    from ._codegen import half_view

    return half_view(t)  # type: ignore[no-any-return]


# -- argument checks ------------------------------------------------------------------------------
def _number(name: str, what: str, v: Any, low: float, high: float = math.inf, high_open: bool = False) -> float:
    if not is_scalar(v) or isinstance(v, (bool, np.bool_, complex, np.complexfloating)):
        raise TypeError(f"{name}: {what} must be a real number, not {v!r}")
    f = float(v)
    if not (math.isfinite(f) and low <= f and (f < high if high_open else f <= high)):
        bound = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        raise ValueError(f"{name}: {what} must be finite and in {bound}, not {v!r}")
    return f


def _list(name: str, what: str, xs: Any, n: int | None) -> list[Any]:
    if isinstance(xs, (Tensor, str)) or not isinstance(xs, Sequence):
        raise TypeError(f"{name}: {what} must be a list or tuple of tensors, not {arg_type(xs)}")
    items = [operand(x, name, what) for x in xs]
    if n is not None and len(items) != n:
        raise ValueError(f"{name}: {len(items)} {what} for {n} params")
    return items


def _tensor_or_number(name: str, what: str, v: Any, low: float) -> Any:
    if isinstance(v, (Tensor,)) or not is_scalar(v):
        return operand(v, name, what)
    return _number(name, what, v, low)


def adamw_step(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    lr: Any,
    step: Any,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> OptimizerStep:
    name = "ops.adamw_step"
    ps = _list(name, "params", params, None)
    gs = _list(name, "grads", grads, len(ps))
    ms = _list(name, "exp_avgs", exp_avgs, len(ps))
    vs = _list(name, "exp_avg_sqs", exp_avg_sqs, len(ps))
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{name}: betas must be a pair of numbers, not {betas!r}")
    b1 = _number(name, "betas[0]", betas[0], 0.0, 1.0, high_open=True)
    b2 = _number(name, "betas[1]", betas[1], 0.0, 1.0, high_open=True)
    e = _number(name, "eps", eps, 0.0)
    wd = _number(name, "weight_decay", weight_decay, 0.0)
    lr_ = _tensor_or_number(name, "lr", lr, 0.0)
    if is_scalar(step) and not isinstance(step, Tensor):
        step_ = _number(name, "step", step, 1.0)
    else:
        step_ = operand(step, name, "step")
    flat: list[Any] = []
    for group in zip(ps, ms, vs, gs, strict=True):
        flat.extend(group)
    return OptimizerStep("adamw", 4, (b1, b2, e, wd), (lr_, step_, *flat))


def sgd_step(
    params: Sequence[Any],
    grads: Sequence[Any],
    momentum_buffers: Sequence[Any] | None,
    lr: Any,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
) -> OptimizerStep:
    name = "ops.sgd_step"
    ps = _list(name, "params", params, None)
    gs = _list(name, "grads", grads, len(ps))
    mom = _number(name, "momentum", momentum, 0.0)
    damp = _number(name, "dampening", dampening, 0.0, 1.0)
    wd = _number(name, "weight_decay", weight_decay, 0.0)
    if nesterov and (mom == 0 or damp != 0):
        raise ValueError(f"{name}: nesterov needs a momentum and zero dampening (momentum={momentum!r}, dampening={dampening!r})")
    if mom != 0 and momentum_buffers is None:
        raise ValueError(f"{name}: momentum={momentum!r} needs momentum_buffers (zero-initialised tensors like the params)")
    lr_ = _tensor_or_number(name, "lr", lr, 0.0)
    flat: list[Any] = []
    if mom != 0:
        bufs = _list(name, "momentum_buffers", momentum_buffers, len(ps))
        for p, b, g in zip(ps, bufs, gs, strict=True):
            flat += [p, b, g]
        width = 3
    else:
        for p, g in zip(ps, gs, strict=True):
            flat += [p, g]
        width = 2
    return OptimizerStep("sgd", width, (mom, damp, wd, bool(nesterov)), (lr_, None, *flat))
