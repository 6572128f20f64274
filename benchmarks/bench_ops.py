"""trio_cuda.ops against PyTorch on the same data, in the same run (issue 9 targets).

For each case both sides run the same operation ``reps`` times back to back on one
stream into a preallocated output (``out=`` for trio-cuda, ``out=`` / in-place for
PyTorch), after a warm-up, and the time from the first submission to the completion of
the last is divided by ``reps``. Figures: TFLOP/s for GEMMs (2*M*N*K per product),
GB/s for memory-bound ops (bytes read + written once). Targets (ratio trio / torch):

* matmul fp16, bf16 at 4096^3 and 8192^3: >= 0.95; fp32 (exact, no TF32 on both sides): >= 0.95
* add of two 64M-element float32 tensors: >= 0.90
* softmax, layer_norm over the last axis of 4096 x 8192 float32: >= 0.80; softmax, layer_norm,
  rms_norm in bfloat16 and float16: >= 0.90
* sum over the last axis of 4096 x 8192 float32: >= 0.80
* the library's matvec (8192 x 8192 float32 times a vector): >= 0.90 of torch.mv

Prints a table and writes ``ops-<date>.md`` / ``.json`` under ``--out``. Needs CUDA,
PyTorch and nvmath-python.
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import MATVEC_ROWS, matvec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _results


def _torch() -> Any:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def time_torch(fn: Callable[[], Any], reps: int) -> float:
    torch = _torch()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


async def time_trio(make: Callable[[], Any], reps: int, stream: trio_cuda.Stream) -> float:
    for _ in range(3):
        await (await lowlevel.submit(make(), stream)).wait()
    t0 = time.perf_counter()
    last = None
    for _ in range(reps):
        last = await lowlevel.submit(make(), stream)
    assert last is not None
    await last.wait()
    return (time.perf_counter() - t0) / reps


async def to_trio(x: Any) -> trio_cuda.Tensor:
    """A torch tensor's data as a trio-cuda tensor (through the host; setup only)."""
    torch = _torch()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        host = x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    else:
        host = x.cpu().numpy()
    return await api.from_host(np.ascontiguousarray(host))


async def run(reps: int, quick: bool, only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    torch = _torch()

    def wanted(name: str) -> bool:
        return not only or any(o in name for o in only)

    dev = trio_cuda.device(0)
    stream = dev.create_stream()
    ts = torch.cuda.Stream()
    rows: list[dict[str, Any]] = []

    def row(name: str, unit: str, work: float, t_trio: float, t_torch: float, target: float) -> None:
        a, b = work / t_trio, work / t_torch
        rows.append({"case": name, "unit": unit, "trio": a, "torch": b, "ratio": a / b, "target": target})
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.3f} | >= {target} |", flush=True)

    print("| case | trio-cuda | torch | ratio | target |\n|---|---|---|---|---|")

    async def gemm() -> None:
        sizes = [1024] if quick else [4096, 8192]
        for dtype, tname, target in (("float16", "float16", 0.95), ("bfloat16", "bfloat16", 0.95), ("float32", "float32", 0.95)):
            for n in sizes:
                if not wanted(f"matmul {dtype} {n}^3"):
                    continue
                tdt = getattr(torch, tname)
                with torch.cuda.stream(ts):
                    a = torch.randn(n, n, device="cuda", dtype=tdt)
                    b = torch.randn(n, n, device="cuda", dtype=tdt)
                    c = torch.empty(n, n, device="cuda", dtype=tdt)
                    t_torch = time_torch(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), reps)
                x, y = await to_trio(a), await to_trio(b)
                z = await api.empty((n, n), trio_cuda._checks.check_dtype(dtype))
                t_trio = await time_trio(lambda x=x, y=y, z=z: ops.matmul(x, y, out=z), reps, stream)
                row(f"matmul {dtype} {n}^3", "TFLOP/s", 2 * n**3 / 1e12, t_trio, t_torch, target)

    async def elementwise_add() -> None:
        if not wanted("add 64M float32"):
            return
        n = (1 << 20) if quick else (64 << 20)
        with torch.cuda.stream(ts):
            a = torch.randn(n, device="cuda")
            b = torch.randn(n, device="cuda")
            c = torch.empty(n, device="cuda")
            t_torch = time_torch(lambda: torch.add(a, b, out=c), reps)
        x, y, z = await to_trio(a), await to_trio(b), await api.empty((n,))
        t_trio = await time_trio(lambda: ops.add(x, y, out=z), reps, stream)
        row("add 64M float32", "GB/s", 3 * 4 * n / 1e9, t_trio, t_torch, 0.90)

    async def row_ops() -> None:
        m, k = (256, 1024) if quick else (4096, 8192)

        async def case(name: str, work: float, make: Callable[[], Any], t_torch: Callable[[], float], target: float) -> None:
            if wanted(name):
                row(name, "GB/s", work, await time_trio(make, reps, stream), t_torch(), target)

        with torch.cuda.stream(ts):
            a = torch.randn(m, k, device="cuda")
            w = torch.randn(k, device="cuda")
            bias = torch.randn(k, device="cuda")
            s = torch.empty(m, device="cuda")
        torch.cuda.synchronize()  # made on ts: done before the copies to trio-cuda read them
        x, z = await to_trio(a), await api.empty((m, k))
        wt, bt, st = await to_trio(w), await to_trio(bias), await api.empty((m,))

        def on_ts(fn: Callable[[], Any]) -> Callable[[], float]:
            def timed() -> float:
                with torch.cuda.stream(ts):
                    return time_torch(fn, reps)

            return timed

        # PyTorch's softmax and norms allocate their results (no out=)
        await case(
            "softmax 4096x8192 float32",
            2 * 4 * m * k / 1e9,
            lambda: ops.softmax(x, out=z),
            on_ts(lambda: torch.softmax(a, dim=-1)),
            0.80,
        )
        await case(
            "layer_norm 4096x8192 float32",
            2 * 4 * m * k / 1e9,
            lambda: ops.layer_norm(x, wt, bt, out=z),
            on_ts(lambda: torch.nn.functional.layer_norm(a, (k,), w, bias)),
            0.80,
        )
        for dtype in ("bfloat16", "float16"):
            tdt = getattr(torch, dtype)
            with torch.cuda.stream(ts):
                h, wh, bh = a.to(tdt), w.to(tdt), bias.to(tdt)
            torch.cuda.synchronize()
            x16, z16 = await to_trio(h), await api.empty((m, k), trio_cuda._checks.check_dtype(dtype))
            w16, b16 = await to_trio(wh), await to_trio(bh)
            work = 2 * 2 * m * k / 1e9
            await case(
                f"softmax 4096x8192 {dtype}",
                work,
                lambda x16=x16, z16=z16: ops.softmax(x16, out=z16),
                on_ts(lambda h=h: torch.softmax(h, dim=-1)),
                0.90,
            )
            await case(
                f"layer_norm 4096x8192 {dtype}",
                work,
                lambda x16=x16, w16=w16, b16=b16, z16=z16: ops.layer_norm(x16, w16, b16, out=z16),
                on_ts(lambda h=h, wh=wh, bh=bh: torch.nn.functional.layer_norm(h, (k,), wh, bh)),
                0.90,
            )
            await case(
                f"rms_norm 4096x8192 {dtype}",
                work,
                lambda x16=x16, w16=w16, z16=z16: ops.rms_norm(x16, w16, out=z16),
                on_ts(lambda h=h, wh=wh: torch.nn.functional.rms_norm(h, (k,), wh, 1e-6)),
                0.90,
            )
        await case(
            "sum last axis 4096x8192 float32",
            4 * m * k / 1e9,
            lambda: ops.sum(x, -1, out=st),
            on_ts(lambda: torch.sum(a, dim=-1, out=s)),
            0.80,
        )

    async def matvecs() -> None:
        if not wanted("matvec 8192^2 float32"):
            return
        n = 1024 if quick else 8192
        with torch.cuda.stream(ts):
            wm = torch.randn(n, n, device="cuda")
            v = torch.randn(n, device="cuda")
            o = torch.empty(n, device="cuda")
            t_mv = time_torch(lambda: torch.mv(wm, v, out=o), reps)
        wt2, vt, ot = await to_trio(wm), await to_trio(v), await api.empty((n,))
        t_lib = await time_trio(lambda: matvec(ot.partition((MATVEC_ROWS,)), wt2, vt), reps, stream)
        row("library matvec 8192^2 float32", "GB/s", 4 * n * n / 1e9, t_lib, t_mv, 0.90)
        t_ops = await time_trio(lambda: ops.matmul(wt2, vt, out=ot), reps, stream)
        row("ops.matmul as matvec 8192^2 float32", "GB/s", 4 * n * n / 1e9, t_ops, t_mv, 0.90)

    for section in (gemm, elementwise_add, row_ops, matvecs):
        try:
            await section()
        except Exception as err:  # report and go on: one broken case must not hide the others
            print(f"| {section.__name__} | failed: {type(err).__name__}: {err} | | | |", flush=True)
            rows.append({"case": section.__name__, "error": f"{type(err).__name__}: {err}"})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument(
        "--only",
        default="",
        help="comma-separated parts of case names: run only the cases naming one (e.g. 'norm' or 'layer_norm,rms_norm')",
    )
    args = p.parse_args()
    only = tuple(o.strip() for o in args.only.split(",") if o.strip())
    if trio_cuda.backend_name() != "cuda":
        raise SystemExit("bench_ops.py needs a CUDA device")
    rows = trio.run(run, args.reps, args.quick, only)
    day = dt.date.today().isoformat()
    gpu = trio_cuda.device(0).name if hasattr(trio_cuda.device(0), "name") else "GPU"
    lines = [
        f"# trio_cuda.ops vs PyTorch ({day})",
        "",
        f"GPU: {gpu}; reps {args.reps}",
        "",
        "| case | unit | trio-cuda | torch | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['case']} | {r['unit']} | {r['trio']:.1f} | {r['torch']:.1f} | {r['ratio']:.3f} | >= {r['target']} |")
    _results.write(args.out, "ops", "\n".join(lines) + "\n", rows)


if __name__ == "__main__":
    main()
