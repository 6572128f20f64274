"""ops.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention
(issue 35, item 7): the forward, bf16, batch 8, 16 heads, head_dim 128, sequence 1024 and
4096, without and with the causal mask. Target: >= 0.95 of PyTorch's TFLOP/s.

Both sides read the same q, k and v (PyTorch's tensors, adopted through DLPack without a
copy). Each round runs one side ``--reps`` times back to back on one stream (trio-cuda:
``lowlevel.submit`` into a preallocated ``out=``, then one wait; PyTorch: its default
stream and allocator, then ``torch.cuda.synchronize()``), after a warm-up; the time from
the first submission to the end of the last, divided by ``--reps``. The sides alternate
for ``--rounds`` rounds; figures are medians over the rounds. FLOPs: ``4 * batch * heads
* seq^2 * head_dim`` (two products), half that with the causal mask (the work a causal
kernel does, as FlashAttention's benchmarks count). Each case also compares the outputs
(max absolute difference, bf16: must be under 0.02).

``--smoke``: tiny shapes on whatever device is there (the simulated one in CI), checked
against numpy instead of PyTorch; its figures mean nothing. Writes ``attention-<date>.md``
and ``.json`` under ``--out`` (default benchmarks/results). Exits 1 if an output was wrong.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import math
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import trio

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trio_cuda  # noqa: E402
from benchmarks import _results  # noqa: E402
from trio_cuda import api, lowlevel, ops  # noqa: E402

TARGET = 0.95
SHAPES = {"batch": 8, "heads": 16, "head_dim": 128, "seqs": (1024, 4096)}
SMOKE = {"batch": 1, "heads": 2, "head_dim": 16, "seqs": (16, 32)}


def flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    return 4 * b * h * s * s * d / (2 if causal else 1)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v  # type: ignore[no-any-return]


async def time_trio(make: Any, reps: int, stream: trio_cuda.Stream) -> tuple[float, float]:
    """(seconds per call, host seconds per call: the submissions alone)."""
    t0 = time.perf_counter()
    last = None
    for _ in range(reps):
        last = await lowlevel.submit(make(), stream)
    t1 = time.perf_counter()
    assert last is not None
    await last.wait()
    return (time.perf_counter() - t0) / reps, (t1 - t0) / reps


def time_torch(torch: Any, fn: Any, reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def torch_or_none() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


async def run(args: argparse.Namespace, shapes: dict[str, Any], torch: Any) -> tuple[list[dict[str, Any]], list[str]]:
    import ml_dtypes

    b, h, d = shapes["batch"], shapes["heads"], shapes["head_dim"]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    stream = trio_cuda.current_device().create_stream()
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for s in shapes["seqs"]:
        if torch is not None:
            tq, tk, tv = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            torch.cuda.synchronize()
            q, k, v = (api.from_dlpack(t) for t in (tq, tk, tv))
        else:
            host = [np.random.default_rng(i).uniform(-1, 1, (b, h, s, d)).astype(bf16) for i in range(3)]
            q, k, v = [await api.from_host(x) for x in host]
        o = await api.empty((b, h, s, d), dtype=bf16)
        for causal in (False, True):
            case = f"bf16 b{b} h{h} s{s} d{d}{' causal' if causal else ''}"

            make = functools.partial(ops.scaled_dot_product_attention, q, k, v, is_causal=causal, out=o)
            await make()  # warm-up: the plan is built
            got = (await o.to_host()).astype(np.float32)
            if torch is not None:
                peer = functools.partial(torch.nn.functional.scaled_dot_product_attention, tq, tk, tv, is_causal=causal)
                want = peer().float().cpu().numpy()
            else:
                want = reference(*host, causal).astype(np.float32)
            diff = float(np.max(np.abs(got - want)))
            if not diff < 0.02:
                problems.append(f"{case}: the outputs differ by {diff:.3g}")
            t_trio: list[float] = []
            t_host: list[float] = []
            t_torch: list[float] = []
            for _ in range(args.rounds):
                t, host_t = await time_trio(make, args.reps, stream)
                t_trio.append(t)
                t_host.append(host_t)
                if torch is not None:
                    t_torch.append(time_torch(torch, peer, args.reps))
            work = flops(b, h, s, d, causal) / 1e12
            row: dict[str, Any] = {
                "case": case,
                "trio_tflops": work / statistics.median(t_trio),
                "trio_us_per_call": statistics.median(t_trio) * 1e6,
                "trio_host_us_per_call": statistics.median(t_host) * 1e6,
                "max_abs_diff": diff,
            }
            if t_torch:
                row["torch_tflops"] = work / statistics.median(t_torch)
                row["ratio"] = row["trio_tflops"] / row["torch_tflops"]
            rows.append(row)
            print(row, flush=True)
    return rows, problems


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"  # (of the checkout the script runs in)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, checked against numpy (the simulated device)")
    ap.add_argument("--reps", type=int, default=100, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.rounds = 2, 1
    torch = None if args.smoke else torch_or_none()
    if not args.smoke and (trio_cuda.backend_name() != "cuda" or torch is None):
        ap.error("needs a CUDA device and PyTorch with CUDA (--smoke runs anywhere)")
    shapes = SMOKE if args.smoke else SHAPES
    started = time.perf_counter()
    rows, problems = trio.run(run, args, shapes, torch)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    gpu = trio_cuda.current_device().name
    versions = f"python {sys.version.split()[0]}, trio-cuda {trio_cuda.__version__}, commit {commit()}"
    if torch is not None:
        import cudnn

        versions += f", torch {torch.__version__}, cudnn-frontend {cudnn.__version__}, cuDNN {cudnn.backend_version_string()}"
    lines = [
        f"# scaled_dot_product_attention: trio-cuda vs PyTorch ({stamp})",
        "",
        f"GPU: {gpu}, backend {trio_cuda.backend_name()}, {versions}. {args.reps} calls a round, "
        f"{args.rounds} interleaved rounds, medians; causal FLOPs counted half; host: the submissions alone.",
        "",
        "| case | trio-cuda TFLOP/s | torch TFLOP/s | ratio | target | trio-cuda us/call (host) | max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        torch_f = f"{r['torch_tflops']:.1f}" if "torch_tflops" in r else "-"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        per_call = f"{r['trio_us_per_call']:.0f} ({r['trio_host_us_per_call']:.0f})"
        lines.append(
            f"| {r['case']} | {r['trio_tflops']:.1f} | {torch_f} | {ratio} | >= {TARGET} | {per_call} | {r['max_abs_diff']:.2g} |"
        )
    lines += ["", *(f"- PROBLEM: {p}" for p in problems)]
    if not problems:
        lines.append("- every output checked against " + ("PyTorch's" if torch is not None else "numpy's"))
    lines += [f"- whole run: {time.perf_counter() - started:.1f} s", ""]
    record = {"when": stamp, "gpu": gpu, "versions": versions, "args": vars(args), "rows": rows, "problems": problems}
    _results.write(args.out, "attention", "\n".join(lines), record)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
