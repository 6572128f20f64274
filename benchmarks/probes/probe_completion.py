"""A/B of the completion path in one process, interleaved (issue 12's choice of defaults).

Machine noise between processes on the H200 host was as large as the effects measured
(a raw launch at 4.1 us in one run, 5.0 us in the next), so every variant here runs in
the same process, in rounds, each round visiting every variant once; figures are
medians over rounds. Variants:

* completion words on or off: a stream made while the device's free words are hidden
  gets none (its events are answered by queries), one made normally gets one;
* spin 0 or 20 us (``_notifier._spin_ns``);
* stream: the pool's next stream (``await op``), or the stream of the op's last write
  (``run_async(op, stream)``: what a policy with affinity to the written buffer would do).

Figures: the one-op round trip (us), a 2000-op chain awaited once (us/op), and awaits/s of
16 and 256 tasks each awaiting tiny kernels on its own tensor.

Usage: ``TRIO_CUDA_COMPLETION_WORDS=1 python benchmarks/probes/probe_completion.py [--rounds 5]``
(on the simulated device it runs as a smoke test: its figures mean nothing there).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

import trio_cuda
from trio_cuda import _notifier, _submit, api

from numba import cuda

ns = time.perf_counter_ns


@trio_cuda.kernel
def inc(x):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += 1.0


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


def _stream(dev: Any, words: bool) -> Any:
    if words:
        return dev.create_stream()
    free, dev._flag_free = dev._flag_free, []
    try:
        return dev.create_stream()
    finally:
        dev._flag_free = free


async def main(rounds: int) -> None:
    dev = trio_cuda.current_device()
    if dev._flags is None:
        raise SystemExit("run with TRIO_CUDA_COMPLETION_WORDS=1 (the A/B needs words to exist)")
    streams = {w: _stream(dev, w) for w in (True, False)}
    assert streams[True]._flag >= 0 and streams[False]._flag < 0
    x = await api.zeros((32,))
    p = x.partition((32,))
    for s in streams.values():
        for _ in range(20):
            await _submit.run_async(inc(p), s)
    results: dict[str, list[float]] = {}

    def note(key: str, v: float) -> None:
        results.setdefault(key, []).append(v)

    spin0 = 20_000
    n_rt = 1000
    count = 0

    async def round_trips(s: Any) -> float:
        """The median of n_rt awaits of one tiny op, on ``s`` (None: the pool's next stream)."""
        rt = []
        for _ in range(n_rt):
            op = inc(p)
            t0 = ns()
            if s is None:
                await op
            else:
                await _submit.run_async(op, s)
            rt.append((ns() - t0) / 1e3)
        return statistics.median(rt)

    for _ in range(rounds):
        for words in (True, False):
            s = streams[words]
            for spin in (0, spin0):
                _notifier._spin_ns = spin
                # affinity: always the same stream (the written buffer's)
                rt = await round_trips(s)
                count += n_rt
                note(f"round trip, words {'on' if words else 'off'}, spin {spin // 1000} us, one stream", rt)
            _notifier._spin_ns = 0
            # chain awaited once on that stream
            op = inc(p)
            for _ in range(1999):
                op = inc(op.first())
            t0 = ns()
            await _submit.run_async(op, s)
            note(f"chain, words {'on' if words else 'off'}, us/op", (ns() - t0) / 2000 / 1e3)
            count += 2000
        # the pool's next stream (pool streams have words: made before the hiding)
        for spin in (0, spin0):
            _notifier._spin_ns = spin
            rt = await round_trips(None)
            count += n_rt
            note(f"round trip, words on, spin {spin // 1000} us, pool's next stream", rt)
        _notifier._spin_ns = 0
        for tasks in (16, 256):
            per = 12_800 // tasks
            xs = [await api.zeros((32,)) for _ in range(tasks)]
            for words in (True, False):
                ss = [_stream(dev, words) for _ in range(4)]

                async def one(i: int, ss: list[Any] = ss, xs: list[Any] = xs, per: int = per) -> None:
                    q = xs[i].partition((32,))
                    s = ss[i % 4]
                    for _ in range(per):
                        await _submit.run_async(inc(q), s)

                t0 = ns()
                async with trio.open_nursery() as nursery:
                    for i in range(tasks):
                        nursery.start_soon(one, i)
                note(f"{tasks} tasks awaits/s, words {'on' if words else 'off'}, 4 streams", tasks * per / ((ns() - t0) / 1e9))
            for i, t in enumerate(xs):
                got = await t.to_host()
                assert (got == 2 * per).all(), (tasks, i, got[0])
    got = await x.to_host()
    assert (got == 40 + count).all(), (got[0], 40 + count)
    print_rounds(results, rounds)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    trio.run(main, ap.parse_args().rounds)
