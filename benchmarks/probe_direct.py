"""Direct submissions on and off, in one process (issue 12).

The host of a lent GPU machine changes speed between processes by up to 2x (see
benchmarks/results/host-direct-2026-11-30.md), so the A/B is made inside one process:
rounds alternate ``_submit.direct_on`` (what ``TRIO_CUDA_DIRECT=0`` turns off) and
measure, per round, the tiny round trip (``await inc(p)``), the dependent chain, and the
decode step of ``bench_decode`` awaited per kernel (per token and per kernel kind).
Prints the median, min and max over rounds of each figure.

    python benchmarks/probe_direct.py [--rounds 5] [--smoke]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Any

import trio

import trio_cuda
from trio_cuda import _submit, api

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_decode import per_kernel_ops  # this folder (run as a script)
from bench_runtime import inc
from probe_completion import print_rounds, round_trip_us

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from cuda_graphs_deviceop import build

KINDS = ("rms_norm op", "matmul q op", "matmul o op", "add kernel")


async def one_round(p: Any, makers: list[Any], tokens: int, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out["tiny op round trip, us"] = await round_trip_us(lambda: inc(p), n)
    op = inc(p)
    for _ in range(n - 1):
        op = inc(op.first())
    t0 = time.perf_counter_ns()
    await op
    out["chain awaited once, us/op"] = (time.perf_counter_ns() - t0) / n / 1e3
    t0 = time.perf_counter_ns()
    for _ in range(tokens):
        for make in makers:
            await make()
    out["decode, await per kernel, ms/token"] = (time.perf_counter_ns() - t0) / tokens / 1e6
    for k, kind in enumerate(KINDS):
        mine = makers[k::4]
        t0 = time.perf_counter_ns()
        for _ in range(tokens):
            for make in mine:
                await make()
        out[f"decode {kind}, us/await"] = (time.perf_counter_ns() - t0) / tokens / len(mine) / 1e3
    return out


async def main(rounds: int, hidden: int, layers: int, tokens: int, n: int) -> None:
    dev = trio_cuda.current_device()
    x = await api.zeros((32,))
    p = x.partition((32,))
    m = await build(hidden, layers)
    makers = per_kernel_ops(m)
    default_policy = dev.policy
    for on in (True, False):  # warm-up both ways: compile, record, prepare
        _submit.direct_on = on
        for _ in range(3):
            for make in makers:
                await make()
            await inc(p)
    results: dict[str, list[float]] = {}
    before = _submit.statistics().direct
    for _ in range(rounds):
        for on in (True, False):
            _submit.direct_on = on
            dev.policy = trio_cuda.SingleStream(dev)  # as bench_decode: one stream
            got = await one_round(p, makers, tokens, n)
            dev.policy = default_policy
            for key, v in got.items():
                results.setdefault(f"{key}, direct {'on' if on else 'off'}", []).append(v)
    _submit.direct_on = True
    went = _submit.statistics().direct - before
    ordered = dict(sorted(results.items(), key=lambda kv: (kv[0].rsplit(", direct", 1)[0], kv[0].endswith("off"))))
    print_rounds(ordered, rounds)
    print(f"direct submissions: {went}")
    for key in ordered:
        if key.endswith("direct on"):
            base = key.rsplit(", direct", 1)[0]
            on_, off = statistics.median(results[key]), statistics.median(results[base + ", direct off"])
            print(f"{base:<48} off / on = {off / on_:5.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the simulated device)")
    args = ap.parse_args()
    if args.smoke:
        trio.run(main, args.rounds, 16, 2, 2, 50)
    else:
        trio.run(main, args.rounds, 2048, 22, 20, 2000)
