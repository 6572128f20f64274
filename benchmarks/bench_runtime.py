"""Runtime overheads of trio-cuda against raw cuda.bindings, cuda.core, CuPy and PyTorch.

Measured in one run, on one GPU (issue 3's benchmark). Figures:

* ``chain``: a dependent chain of N tiny kernels (one block of 32 threads,
  ``x[i] += 1`` on the same 32-element buffer), submitted and awaited once; us per op.
  trio-cuda builds the chain as ``op = inc(op.first())`` N times; we report submission
  plus wait of the prebuilt DAG (the figure the target is about) and, separately, the
  cost of building it.
* ``sync each``: the same kernel with a wait after every op (trio-cuda: ``await`` per op).
* ``round trip``: one tiny op submitted and waited for (trio-cuda: ``await`` in trio);
  median over many.
* ``16 independent``: 16 one-block kernels that each sleep about 1 ms, (a) spread over the
  default pool of 4 streams (trio-cuda: 16 tasks in a nursery), (b) on one stream;
  the speed-up is (b)/(a).

Usage: ``python benchmarks/bench_runtime.py [--n 2000] [--reps 5] [--out DIR]``.
Prints a table of each figure and its ratio to raw cuda.bindings, and writes
``runtime-<date>.md`` and ``.json`` under ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import statistics
import sys
import time
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda.kernels import sleep

from numba import cuda

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _peers, _results


@trio_cuda.kernel
def inc(x):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += 1.0


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


async def chain_us(p: Any, n: int) -> tuple[float, float]:
    """A chain of ``n`` dependent ``inc`` launches on partition ``p``, built (``op =
    inc(op.first())``) and then awaited once: (build, await) in us per op."""
    t0 = time.perf_counter_ns()
    op = inc(p)
    for _ in range(n - 1):
        op = inc(op.first())
    t1 = time.perf_counter_ns()
    await op
    t2 = time.perf_counter_ns()
    return (t1 - t0) / n / 1e3, (t2 - t1) / n / 1e3


async def roundtrips_ns(p: Any, k: int) -> list[int]:
    """``k`` round trips: ``await op`` of one ``inc`` launch on ``p``, made before the
    clock starts; each one's nanoseconds."""
    ns = []
    for _ in range(k):
        op = inc(p)
        t0 = time.perf_counter_ns()
        await op
        ns.append(time.perf_counter_ns() - t0)
    return ns


async def _trio_figures(n: int, reps: int) -> dict[str, Any]:
    dev = trio_cuda.current_device()
    x = await api.zeros((32,))
    p = x.partition((32,))
    # warm-up: compile and load the kernels, fill the pools
    for _ in range(20):
        await inc(p)
    await sleep(api.zeros((1,), np.int32).partition((1,)), 1000)

    build, chain = [], []
    for _ in range(reps):
        b, c = await chain_us(p, n)
        build.append(b)
        chain.append(c)

    sync_each = []
    m = max(n // 4, 100)
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(m):
            await inc(p)
        sync_each.append((time.perf_counter_ns() - t0) / m / 1e3)

    rt = [ns / 1e3 for ns in await roundtrips_ns(p, 2000)]

    counters = [await api.zeros((1,), np.int32) for _ in range(16)]

    async def sixteen() -> float:
        t0 = time.perf_counter_ns()
        async with trio.open_nursery() as nursery:
            for c in counters:
                nursery.start_soon(_await, sleep(c.partition((1,)), 1_000_000))
        return (time.perf_counter_ns() - t0) / 1e6

    pool_ms = _median([await sixteen() for _ in range(reps)])
    old = dev.policy
    dev.policy = trio_cuda.SingleStream(dev)
    one_ms = _median([await sixteen() for _ in range(reps)])
    dev.policy = old
    got = await x.to_host()
    expected = 20 + reps * n + reps * m + 2000
    if not np.all(got == expected):
        raise AssertionError(f"inc chain computed {got[0]}, expected {expected}")
    return {
        "name": "trio-cuda",
        "chain_us_per_op": _median(chain),
        "chain_build_us_per_op": _median(build),
        "sync_each_us_per_op": _median(sync_each),
        "roundtrip_us": _median(rt),
        "independent16_pool_ms": pool_ms,
        "independent16_one_stream_ms": one_ms,
        "independent16_speedup": one_ms / pool_ms,
        "error": None,
    }


async def _await(op: Any) -> None:
    await op


FIGURES = [
    ("chain_us_per_op", "chain, await once (us/op)", "<= 1.25x raw"),
    ("sync_each_us_per_op", "sync after every op (us/op)", ""),
    ("roundtrip_us", "one tiny op round trip (us)", "<= 1.3x raw"),
    ("independent16_pool_ms", "16 x 1 ms kernels, pool of 4 (ms)", ""),
    ("independent16_one_stream_ms", "16 x 1 ms kernels, one stream (ms)", ""),
    ("independent16_speedup", "16 independent: one stream / pool", ">= 3.8x"),
]


def table(rows: list[dict[str, Any]]) -> str:
    raw = next((r for r in rows if r["name"] == "raw_cuda_bindings"), None)
    names = [r["name"] for r in rows]
    out = ["| figure | " + " | ".join(names) + " | target |", "|---" * (len(names) + 2) + "|"]
    for key, label, target in FIGURES:
        cells = []
        for r in rows:
            v = r.get(key)
            if v is None:
                cells.append("n/a")
                continue
            cell = f"{v:.2f}"
            if raw is not None and raw.get(key) and r is not raw and key != "independent16_speedup":
                cell += f" ({v / raw[key]:.2f}x raw)"
            cells.append(cell)
        out.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")
    trio_row = next(r for r in rows if r["name"] == "trio-cuda")
    out.append("")
    out.append(f"trio-cuda chain build cost (not in the figure above): {trio_row['chain_build_us_per_op']:.2f} us/op")
    for r in rows:
        if r.get("error"):
            out.append(f"- {r['name']}: {r['error']}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    args = ap.parse_args()

    ours = trio.run(_trio_figures, args.n, args.reps)
    rows = [ours, *_peers.run_all(n=args.n, reps=args.reps)]
    order = ["raw_cuda_bindings", "trio-cuda"]
    rows.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else 2)
    dev = trio_cuda.current_device()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"# Runtime overheads ({stamp})\n\n"
        f"GPU: {dev.name} (cc {dev.compute_capability[0]}.{dev.compute_capability[1]}), backend {trio_cuda.backend_name()}, "
        f"python {sys.version.split()[0]}, N={args.n}, reps={args.reps}; medians.\n"
    )
    text = header + "\n" + table(rows) + "\n"
    _results.write(args.out, "runtime", text, {"when": stamp, "gpu": dev.name, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
