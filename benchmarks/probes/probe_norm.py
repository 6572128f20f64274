"""Which layer_norm / rms_norm kernel variant is fastest for bfloat16 and float16: each against PyTorch's in the same process.

Usage: python benchmarks/probes/probe_norm.py [--reps 50] [--variants NAME,NAME] [--smoke]

Cases: ``ops.layer_norm`` (weight and bias) and ``ops.rms_norm`` (weight) over the last
axis of 4096 x 8192 and 4096 x 4096, bfloat16 and float16, against
``torch.nn.functional.layer_norm`` / ``rms_norm`` on the same data. Each variant is a
``trio_cuda._ops._norm.NormTuning`` (threads per row, values per load, words per thread
kept in registers between the passes; "scalar" is one value per load). Every variant's
result is compared with PyTorch's first (its largest difference is printed), then
``--reps`` calls are timed back to back on one stream (as bench_ops.py): GB/s of the
bytes read and written once, and the ratio to PyTorch. The last lines name the best
variant per case. The first run compiles every variant (about 2 s each; the disk cache
serves later runs).

``--smoke`` (the simulated device, no PyTorch): tiny shapes, every variant's result
checked against numpy through ml_dtypes; the figures mean nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import trio_cuda
from benchmarks.bench_ops import time_torch, time_trio
from trio_cuda import api, ops
from trio_cuda._ops import _norm

VARIANTS: dict[str, _norm.NormTuning] = {
    "scalar": _norm.NormTuning(pack=1),
    "pack2 t256": _norm.NormTuning(pack=2, cache_words=0),
    "pack4 t256": _norm.NormTuning(pack=4, cache_words=0),
    "pack4 t512": _norm.NormTuning(threads=512, pack=4, cache_words=0),
    "pack4 t256 regs": _norm.NormTuning(threads=256, pack=4, cache_words=8),
    "pack4 t512 regs": _norm.NormTuning(threads=512, pack=4, cache_words=4),
}


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    """numpy's layer_norm (``b`` given) or rms_norm, in float64."""
    v, wf = x.astype(np.float64), w.astype(np.float64)
    if b is None:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * wf
    return (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + eps) * wf + b.astype(np.float64)


def torch_case(
    torch: Any, op: str, dtype: str, a: np.ndarray, w: np.ndarray, bias: np.ndarray, eps: float, reps: int
) -> tuple[np.ndarray, float]:
    """PyTorch's result (float32) and seconds per call on the same data."""
    tdt = getattr(torch, dtype)
    ta, tw, tb = (torch.from_numpy(v.view(np.int16)).view(tdt).cuda() for v in (a, w, bias))
    k = a.shape[-1]

    def fn() -> Any:
        if op == "layer_norm":
            return torch.nn.functional.layer_norm(ta, (k,), tw, tb, eps)
        return torch.nn.functional.rms_norm(ta, (k,), tw, eps)

    want = fn().float().cpu().numpy()
    return want, time_torch(fn, reps)


async def trio_case(
    op: str, x: Any, wt: Any, bt: Any, eps: float, reps: int, stream: trio_cuda.Stream
) -> tuple[np.ndarray, float]:
    """trio-cuda's result (float64) and seconds per call, with the current NormTuning."""
    z = await api.empty(x.shape, x.dtype)  # a new out=: a new recipe, so this variant's kernel

    def make() -> Any:
        if op == "layer_norm":
            return ops.layer_norm(x, wt, bt, eps, out=z)
        return ops.rms_norm(x, wt, eps, out=z)

    got = (await make().to_host()).astype(np.float64)
    return got, await time_trio(make, reps, stream)


async def run(reps: int, names: list[str], smoke: bool) -> None:
    import ml_dtypes

    torch = None if smoke else __import__("torch")
    stream = trio_cuda.current_device().create_stream()
    shapes = [(8, 64), (3, 36)] if smoke else [(4096, 8192), (4096, 4096)]
    rng = np.random.default_rng(0)
    best: dict[str, tuple[float, str]] = {}
    print("| case | variant | GB/s | torch GB/s | ratio | max diff |\n|---|---|---|---|---|---|", flush=True)
    for dtype in ("bfloat16", "float16"):
        np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
        for m, k in shapes:
            a = rng.standard_normal((m, k), np.float32).astype(np_dt)
            w = rng.uniform(0.5, 1.5, k).astype(np.float32).astype(np_dt)
            bias = rng.uniform(-1, 1, k).astype(np.float32).astype(np_dt)
            x, wt, bt = await api.from_host(a), await api.from_host(w), await api.from_host(bias)
            gb = 2 * 2 * m * k / 1e9  # read once, written once
            for op in ("layer_norm", "rms_norm"):
                case = f"{op} {m}x{k} {dtype}"
                eps = 1e-5 if op == "layer_norm" else 1e-6
                if torch is not None:
                    want, t_torch = torch_case(torch, op, dtype, a, w, bias, eps, reps)
                else:
                    want, t_torch = reference(a, w, bias if op == "layer_norm" else None, eps), 0.0
                for name in names:
                    _norm.TUNING = VARIANTS[name]
                    got, t = await trio_case(op, x, wt, bt, eps, reps, stream)
                    diff = float(np.max(np.abs(got - want)))
                    if smoke:  # within 8 units in the last place of the dtype, of numpy's float64
                        tol = 8 * (2.0**-8 if dtype == "bfloat16" else 2.0**-11)
                        assert diff <= tol * max(1.0, float(np.max(np.abs(want)))), (case, name, diff)
                    ratio = f"{t_torch / t:.3f}" if t_torch else "-"
                    torch_gbs = f"{gb / t_torch:.1f}" if t_torch else "-"
                    print(f"| {case} | {name} | {gb / t:.1f} | {torch_gbs} | {ratio} | {diff:.2e} |", flush=True)
                    if case not in best or t < best[case][0]:
                        best[case] = (t, name)
    _norm.TUNING = _norm.NormTuning()
    print("\nbest variant per case (default now: " + repr(_norm.TUNING) + "):")
    for case, (_, name) in best.items():
        print(f"  {case}: {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the simulated device, results checked")
    args = p.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if not args.smoke and trio_cuda.backend_name() != "cuda":
        raise SystemExit("probe_norm.py needs a CUDA device (or --smoke)")
    trio.run(run, 2 if args.smoke else args.reps, names, args.smoke)


if __name__ == "__main__":
    main()
