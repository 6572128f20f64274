"""Host cost of an awaited op, with the driver replaced by no-ops (simulated device only).

Each op is awaited in a loop on the same operands, so after the first calls every one
is a replayed recipe and, where it is one launch or one GEMM, a direct submission (see
docs/runtime.md). Prints us per await (best of 3 rounds) and the ratio to a hand-written
kernel on the same sizes.

    TRIO_CUDA_BACKEND=sim python benchmarks/probes/probe_ops_host.py [--n 5000]
"""

from __future__ import annotations

import argparse
import time

import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import add


async def main(n: int) -> None:
    x, y, z = await api.ones((2048,)), await api.ones((2048,)), await api.zeros((2048,))
    w, g = await api.ones((2048, 2048)), await api.ones((2048,))
    zp = z.partition((256,))
    cases = {
        "hand-written add kernel": lambda: add(zp, x, y),
        "ops.add": lambda: ops.add(x, y, out=z),
        "ops.matmul (GEMV)": lambda: ops.matmul(w, x, out=z),
        "ops.rms_norm": lambda: ops.rms_norm(x, g, 1e-6, out=z),
    }
    for make in cases.values():  # recorded, prepared
        for _ in range(3):
            await make()
    drv = trio_cuda.current_device()._driver
    drv.launch = lambda *a: None
    drv.record = lambda *a: None
    drv.query = lambda e: True
    drv.matmul = lambda *a, **k: None
    best = dict.fromkeys(cases, float("inf"))
    before = lowlevel.submission_statistics().direct
    for _ in range(3):
        for name, make in cases.items():
            t0 = time.perf_counter_ns()
            for _ in range(n):
                await make()
            best[name] = min(best[name], (time.perf_counter_ns() - t0) / n / 1e3)
    went_direct = lowlevel.submission_statistics().direct - before
    base = best["hand-written add kernel"]
    print(f"{'await of':26s} {'us':>7s}  vs kernel")
    for name, us in best.items():
        print(f"{name:26s} {us:7.2f}  {us / base:5.2f}x")
    print(f"direct submissions: {went_direct} of {3 * n * len(cases)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000)
    args = ap.parse_args()
    if trio_cuda.backend_name() != "sim":
        raise SystemExit("probe_ops_host replaces the driver with no-ops: run it with TRIO_CUDA_BACKEND=sim")
    trio.run(main, args.n)
