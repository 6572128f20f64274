"""Where the decode step's await per kernel spends its host time: each of its four op
kinds awaited alone, and a cProfile of the step (us per await).

Usage: python benchmarks/probes/probe_decode_ops.py [--hidden 2048] [--n 2000] [--profile]

The ops are bench_decode's (``per_kernel_ops``: rms_norm, the two GEMVs as
``ops.matmul``, a residual ``add`` kernel) on one stream. Each row: one op kind of the
first layer awaited ``--n`` times in a row, best of 5 blocks (wall time). With
``--profile``: cProfile of 20 steps, by own time (compiled modules show as their
callers' time; run with them moved aside to see inside them).
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import sys
import time
from typing import Any

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import trio_cuda
from benchmarks import bench_decode
from trio_cuda import lowlevel


async def run(hidden: int, n: int, profile: bool) -> None:
    m = await bench_decode.build(hidden, 2)
    dev = trio_cuda.current_device()
    dev.policy = trio_cuda.SingleStream(dev)
    makers = bench_decode.per_kernel_ops(m)
    for _ in range(3):
        for make in makers:
            await make()
    print(f"backend {trio_cuda.backend_name()}, compiled modules: {len(getattr(lowlevel, 'compiled', tuple)())}")
    for label, make in zip(("rms_norm", "matmul (wq)", "matmul (wo)", "add kernel"), makers[:4], strict=True):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                await make()
            best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
        print(f"{label:16s} {best:8.2f} us per await")
    if profile:
        pr: Any = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            for make in makers:
                await make()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    trio.run(run, args.hidden, args.n, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
