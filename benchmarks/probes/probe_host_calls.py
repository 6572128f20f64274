"""What the host calls of one await cost on this backend, one by one (us per call).

Usage: python benchmarks/probes/probe_host_calls.py [--n 4000]

Rows, each the best of 7 blocks of ``--n`` calls (wall time): the driver's launch of a
prepared tiny kernel (the block's drain included), its event record and its query of a
completed event (the three driver calls of every await), a trio schedule point (``trio.lowlevel.checkpoint``), one
``await inc(p)`` on one stream, and a dependent chain of ``--n`` launches awaited once
(per op). Read beside bench_host: what an await costs above its driver calls and trio's
pass is trio-cuda's own host code. Prints which runtime modules run compiled.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import trio_cuda
from benchmarks import bench_runtime
from trio_cuda import api, lowlevel


def best_of(n: int, block: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter_ns()
        block()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


async def best_of_async(n: int, block: Callable[[], Awaitable[None]]) -> float:
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter_ns()
        await block()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


async def run(n: int) -> None:
    inc = bench_runtime.inc
    dev = trio_cuda.current_device()
    x = await api.zeros((32,))
    p = x.partition((32,))
    for _ in range(50):
        await inc(p)
    # (a probe: the prepared launch and the driver are read from the runtime's internals)
    prepared: Any = next(iter(inc._fast.values()))[3]
    drv: Any = dev._driver
    s = dev.create_stream()
    h = s.handle
    ev = drv.create_event()

    def drain() -> None:
        drv.record(ev, h)
        while not drv.query(ev):
            time.sleep(0)  # (the simulated device's threads need the GIL)

    def launches() -> None:
        for _ in range(n):
            drv.launch(prepared, h)
        drain()

    def records() -> None:
        for _ in range(n):
            drv.record(ev, h)

    def queries() -> None:
        for _ in range(n):
            drv.query(ev)

    async def checkpoints() -> None:
        for _ in range(n):
            await trio.lowlevel.checkpoint()

    async def awaits() -> None:
        for _ in range(n):
            await inc(p)

    rows = [
        ("driver launch (enqueue only)", best_of(n, launches)),
        ("driver record", best_of(n, records)),
    ]
    drain()
    rows.append(("driver query (done event)", best_of(n, queries)))
    rows.append(("trio checkpoint", await best_of_async(n, checkpoints)))
    rows.append(("await inc(p)", await best_of_async(n, awaits)))

    async def chain() -> None:
        op = inc(p)
        for _ in range(n - 1):
            op = inc(op.first())
        await op

    rows.append(("chain awaited once, per op (build included)", await best_of_async(n, chain)))
    print(f"backend {trio_cuda.backend_name()}, compiled modules: {len(lowlevel.compiled())}")
    for label, us in rows:
        print(f"{label:48s} {us:8.2f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000)
    args = ap.parse_args(argv)
    trio.run(run, args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
