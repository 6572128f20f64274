"""Event flags and stream-aware polls, A/B in one process (issue 12).

Variants, alternated in short blocks (a lent machine's host changes speed between
processes, see benchmarks/results/host-direct-2026-11-30.md at bdba8f3):

* event flags: timing off (now), or timing off plus blocking sync (before 2026-11-30);
* polls: ask the driver about the awaited event only, or answer from the stream first
  (``trio_cuda._device.poll_by_stream``: the last point of the stream a poll saw done,
  then a query of the stream's newest event; see docs/notifier.md).

Figures: the tiny op round trip (one task, ``await inc(p)``, median of 200) and
awaits/s of 16 and 256 concurrent tasks, each awaiting ``inc`` on its own tensor
(about 1000-2000 awaits). Each cycle measures every figure for every variant in a
short block, the variants' order rotating; the host's drift over seconds then hits
all variants alike. Prints the median, min and max over cycles, and the median of each
variant's ratio to the first one within the same cycle. CUDA backend only.

    python benchmarks/probes/probe_poll.py [--cycles 30]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

import trio_cuda
from trio_cuda import _device, api

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench_runtime import inc  # benchmarks/ and this folder (run as a script)


async def round_trip_us(make: Callable[[], Any], n: int, run: Callable[[Any], Awaitable[Any]] | None = None) -> float:
    """The median over ``n`` round trips of ``await make()`` (or ``await run(make())``),
    timing the await only, in us."""
    rt = []
    for _ in range(n):
        op = make()
        t0 = time.perf_counter_ns()
        await (op if run is None else run(op))
        rt.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(rt)


def print_rounds(results: dict[str, list[float]], rounds: int) -> None:
    """The table of an interleaved A/B: per variant, the median, min and max over rounds."""
    print(f"{'variant':<64} {'median':>10} {'min':>10} {'max':>10}  (over {rounds} rounds)")
    for key, vs in results.items():
        print(f"{key:<64} {statistics.median(vs):10.2f} {min(vs):10.2f} {max(vs):10.2f}")


async def tasks_rate(parts: list[Any], k: int) -> float:
    """awaits/s of ``len(parts)`` concurrent tasks, each awaiting ``inc`` ``k`` times."""

    async def worker(p: Any) -> None:
        for _ in range(k):
            await inc(p)

    t0 = time.perf_counter_ns()
    async with trio.open_nursery() as nursery:
        for p in parts:
            nursery.start_soon(worker, p)
    return len(parts) * k / ((time.perf_counter_ns() - t0) / 1e9)


def standard_figures(p: Any, many: dict[int, list[Any]]) -> dict[str, Callable[[], Awaitable[float]]]:
    """The round trip of ``inc(p)`` and the awaits/s of 16 and 256 tasks (``many``)."""
    return {
        "tiny op round trip, us": lambda: round_trip_us(lambda: inc(p), 200),
        "awaits/s, 16 tasks (k)": lambda: tasks_rate(many[16], 64),
        "awaits/s, 256 tasks (k)": lambda: tasks_rate(many[256], 8),
    }


async def main(cycles: int) -> None:
    dev = trio_cuda.current_device()
    drv = dev._driver
    if not hasattr(drv, "_event_flags"):
        raise SystemExit("the CUDA backend only (event flags are a driver setting)")
    from cuda.bindings import driver as cu

    timing_off = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    blocking = timing_off | int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
    # (name, event flags, polls answered from the stream); the first is the code before
    # 2026-11-30 13:00 UTC.
    variants = [
        ("blocking sync, polls by event", blocking, False),
        ("blocking sync, polls by stream", blocking, True),
        ("timing off, polls by event", timing_off, False),
        ("timing off, polls by stream", timing_off, True),
    ]
    pools: dict[int, collections.deque[Any]] = {timing_off: collections.deque(), blocking: collections.deque()}
    x = await api.zeros((32,))
    p = x.partition((32,))
    many = {count: [(await api.zeros((32,))).partition((32,)) for _ in range(count)] for count in (16, 256)}
    figures = standard_figures(p, many)

    async def warm_up() -> None:
        await tasks_rate(many[256], 4)

    def setup(flags: int, by_stream: bool) -> Callable[[], None]:
        def use() -> None:
            drv._event_flags = flags
            dev._event_pool = pools[flags]
            _device.poll_by_stream = by_stream

        return use

    await paired(figures, [(name, setup(flags, by_stream)) for name, flags, by_stream in variants], cycles, warm_up)
    setup(timing_off, True)()


async def paired(
    figures: dict[str, Callable[[], Awaitable[float]]],
    variants: list[tuple[str, Callable[[], None]]],
    cycles: int,
    warm_up: Callable[[], Awaitable[object]],
) -> None:
    """Measure every figure for every variant (its function sets it up) in short blocks,
    ``cycles`` times, the variants' order rotating; print the figures and each
    variant's ratio to the first within the same cycle. A figure named "awaits/s..."
    is a rate (reported in thousands), any other a time."""
    for _ in range(3):  # warm-up: compile, load, fill the pools
        await warm_up()
    values: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for cycle in range(cycles):
        for fig, measure in figures.items():
            got = {}
            # rotate the order so no variant always runs first after another figure
            for i in range(len(variants)):
                name, use = variants[(i + cycle) % len(variants)]
                use()
                v = await measure()
                got[name] = v / 1e3 if "awaits/s" in fig else v
            base = got[variants[0][0]]
            for name, v in got.items():
                values.setdefault((fig, name), []).append(v)
                # > 1: better than the first variant (a rate higher, a time lower)
                ratios.setdefault((fig, name), []).append(v / base if "awaits/s" in fig else base / v)
    print_rounds({f"{fig}: {name}": vs for (fig, name), vs in values.items()}, cycles)
    print()
    print(f"{'paired gain over ' + variants[0][0] + ' (same cycle; > 1 is better)':<64} {'median':>10} {'min':>10} {'max':>10}")
    for (fig, name), rs in ratios.items():
        print(f"{fig + ': ' + name:<64} {statistics.median(rs):10.3f} {min(rs):10.3f} {max(rs):10.3f}")


def decode_ab_main(main: Callable[[int, int, int], Awaitable[None]], doc: str) -> None:
    """The command line of an A/B probe that includes the decode step:
    ``main(cycles, hidden, layers)`` in trio."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    args = ap.parse_args()
    trio.run(main, args.cycles, args.hidden, args.layers)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=30)
    args = ap.parse_args()
    trio.run(main, args.cycles)
