"""Why "sync after every op" moves between processes (issue 12): one await of
bench_runtime's tiny ``inc`` after another, in blocks, under changed conditions in one
process: fresh; with the garbage collector off; after an await that parked (the
notifier's helper thread started); after a long dependent chain awaited once (as
bench_host's first figure does before it); with the helper thread started and the
collector off. Per condition the median us per await over 5 blocks of ``--n``, the
hot path's counters that moved, and the raw cuda.bindings peer's figure in the same
process at the end.

    python benchmarks/probe_sync_each.py [--n 1000]
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import sleep

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_runtime import inc  # this folder (run as a script)

try:
    from trio_cuda import _hotpath
except ImportError:
    _hotpath = None


async def main(n: int) -> None:
    x = await api.zeros((32,))
    p = x.partition((32,))
    for _ in range(100):
        await inc(p)
    total = 100

    async def measure(label: str) -> None:
        nonlocal total
        c0 = _hotpath.counters() if _hotpath is not None else {}
        s0 = lowlevel.notifier_statistics()
        t = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                await inc(p)
            t.append((time.perf_counter_ns() - t0) / n / 1e3)
        total += 5 * n
        c1 = _hotpath.counters() if _hotpath is not None else {}
        s1 = lowlevel.notifier_statistics()
        moved = ", ".join(f"{k} {c1[k] - c0[k]}" for k in c1 if c1[k] != c0[k])
        print(
            f"{label:55s} {statistics.median(t):6.2f} us (blocks {min(t):.2f}-{max(t):.2f}); "
            f"parked {s1.slow_path - s0.slow_path}; {moved}",
            flush=True,
        )

    await measure("fresh")
    gc.disable()
    await measure("collector off")
    gc.enable()
    await measure("collector on again")
    chain = inc(p)
    for _ in range(1999):
        chain = inc(chain.first())
    await chain
    total += 2000
    await measure("after a chain of 2000 awaited once")
    counter = (await api.zeros((1,), np.int32)).partition((1,))
    before = lowlevel.notifier_statistics().slow_path
    await sleep(counter, 20_000_000)
    print(f"(a 20 ms sleep kernel awaited: parked {lowlevel.notifier_statistics().slow_path - before})")
    await measure("after a parked await (helper thread started)")
    gc.disable()
    await measure("helper started, collector off")
    gc.enable()
    await measure("helper started, collector on")
    got = await x.to_host()
    if not np.all(got == total):
        raise AssertionError(f"inc computed {got[0]}, expected {total}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    args = ap.parse_args()
    trio.run(main, args.n)
    if trio_cuda.backend_name() == "cuda":
        from benchmarks import _peers

        raw = _peers.run_peer("raw_cuda_bindings", 1000, 3)
        print(f"raw cuda.bindings: sync each {raw['sync_each_us_per_op']:.2f} us, round trip {raw['roundtrip_us']:.2f} us")
