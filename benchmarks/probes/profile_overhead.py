"""Where trio-cuda's per-op time goes: cProfile of a 2000-op chain and of 2000 awaits.

Usage: python benchmarks/probes/profile_overhead.py [--null-driver]

With ``--null-driver`` (simulated device only) the driver calls are replaced by no-ops,
which isolates the runtime's own Python cost from the driver's.
"""

import cProfile
import pstats
import sys
import time

import trio

import trio_cuda
from trio_cuda import api

from numba import cuda


@trio_cuda.kernel(sim=lambda x: None)
def inc(x):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += 1.0


def main() -> None:
    if "--null-driver" in sys.argv:
        if trio_cuda.backend_name() != "sim":
            raise SystemExit("--null-driver needs TRIO_CUDA_BACKEND=sim")
        drv = trio_cuda.device(0)._driver
        drv.launch = lambda *a: None  # type: ignore[method-assign]
        drv.record = lambda *a: None  # type: ignore[method-assign]
        drv.query = lambda e: True  # type: ignore[method-assign]

    async def run() -> None:
        x = await api.zeros((32,))
        p = x.partition((32,))
        for _ in range(50):
            await inc(p)
        for label in ("chain", "await each"):
            for profiled in (False, True):
                op = inc(p)
                for _ in range(1999):
                    op = inc(op.first())
                pr = cProfile.Profile()
                t0 = time.perf_counter_ns()
                if profiled:
                    pr.enable()
                if label == "chain":
                    await op
                else:
                    for _ in range(2000):
                        await inc(p)
                if profiled:
                    pr.disable()
                    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
                else:
                    print(f"{label}: {(time.perf_counter_ns() - t0) / 2000 / 1e3:.2f} us/op (unprofiled)")

    trio.run(run)


if __name__ == "__main__":
    main()
