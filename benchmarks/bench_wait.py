"""What waiting costs: throughput, CPU and loop responsiveness of awaits, and fairness
between tasks (issue 33).

Every case runs in one trio run beside a ticker task (``trio.sleep(0.5 ms)`` in a loop,
recording how late each tick wakes), and reports its throughput, the process's CPU
seconds per second of wall time and the ticker's p99 lateness. In the same run:

* trio-cuda's default (adaptive) wait, and the pure polling wait (``spin``: a budget
  that never ends) whose throughput is the reference;
* peers on CUDA (PyTorch): ``torch.matmul`` + ``torch.cuda.synchronize()`` on the trio
  thread (``torch blocking``), the same in ``trio.to_thread.run_sync`` per step
  (``torch to_thread``), and ``torch.cuda.Event.query()`` polled with ``trio.sleep(0)``
  (``torch event poll``).

Cases (CUDA; the simulated device runs sleep kernels of the same lengths instead of
products, without peers):

1. back-to-back 8192^3 bf16 matmuls (about 1.4 ms) awaited one by one: adaptive >= 98%
   of spin's TFLOP/s, <= 0.10 CPU s/s;
2. the same with 8 products per await (a ``zip``): same targets;
3. 4096^3 bf16 matmuls (about 200 us) one by one: >= 95%, <= 0.25 CPU s/s;
4. 64 tasks each awaiting its own long kernels (sleep kernel, 20 ms): <= 0.10 CPU s/s;
5. head of line: one task keeps a 50 ms kernel in flight while three tasks each await
   50 kernels of 0.1 ms: each short task within 1.5x of its time alone (also shown
   with ``StreamPoolRoundRobin``, the reference's policy);
6. eight independent tasks of 20 x 1 ms kernels: within 1.2x of one alone.

In every case the ticker's p99 lateness is at most the idle loop's plus 0.5 ms.

    python benchmarks/bench_wait.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import _notifier, api, lowlevel, ops
from trio_cuda.kernels import sleep

TICK_S = 0.0005
rows: list[str] = []
verdicts: list[tuple[str, bool]] = []
sleeping_notes: list[str] = []


def _sleeping(a: Any, b: Any) -> str:
    """What the waits between two notifier statistics did."""
    sa, sb = a.sleeping, b.sleeping
    return (
        f"polled to completion {b.fast_path - a.fast_path}, woken by completion {b.slow_path - a.slow_path}; "
        f"timed sleeps {sb.timed - sa.timed}, timer wake-ups {sb.timer_wakes - sa.timer_wakes}, "
        f"early (work done first) {sb.early - sa.early}, late (found done on waking) {sb.late - sa.late}; "
        f"learned wake-up lateness {sb.lateness_us:.0f} us"
    )


def out(line: str) -> None:
    print(line, flush=True)
    rows.append(line)


def check(what: str, ok: bool) -> str:
    verdicts.append((what, ok))
    return "met" if ok else "MISSED"


async def with_ticker(body: Callable[[], Awaitable[float]]) -> tuple[float, float, float, float]:
    """Run ``body`` (returns its work done) beside the ticker: (work, wall s, CPU s/s,
    tick p99 lateness in ms)."""
    late: list[float] = []

    async def ticker(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            t = time.perf_counter()
            await trio.sleep(TICK_S)
            late.append(time.perf_counter() - t - TICK_S)

    async with trio.open_nursery() as n:
        await n.start(ticker)
        cpu0, t0 = time.process_time(), time.perf_counter()
        work = await body()
        wall = time.perf_counter() - t0
        cpu = (time.process_time() - cpu0) / wall
        n.cancel_scope.cancel()
    p99 = statistics.quantiles(late, n=100)[98] * 1e3 if len(late) >= 10 else float("nan")
    return work, wall, cpu, p99


def spinning() -> Any:
    """The pure polling wait, for the reference figure."""

    class _Spin:
        def __enter__(self) -> None:
            self.old = _notifier._budget_ns
            _notifier._budget_ns = 10**12

        def __exit__(self, *exc: object) -> None:
            _notifier._budget_ns = self.old

    return _Spin()


async def run(quick: bool) -> None:
    cuda = trio_cuda.backend_name() == "cuda" and not quick
    torch = None
    if cuda:
        import torch as _torch

        torch = _torch
    dev = trio_cuda.current_device()
    c = await api.zeros((1,), np.int32)
    _, _, _, idle_p99 = await with_ticker(lambda: _idle(1.0))
    out(f"idle loop tick p99 lateness: {idle_p99:.3f} ms (tick {TICK_S * 1e3} ms)\n")
    tick_limit = idle_p99 + 0.5

    out("| case | wait | throughput | unit | vs spin | CPU s/s | tick p99 (ms) | targets |")
    out("|---|---|---|---|---|---|---|---|")

    async def one_by_one(label: str, n: int, reps: int, per_await: int, min_ratio: float, max_cpu: float) -> None:
        if cuda:
            a = await api.from_host(np.ones((n, n), np.float32))
            a = await a.astype("bfloat16")
            outs = [await api.empty((n, n), trio_cuda._checks.check_dtype("bfloat16")) for _ in range(per_await)]
            flop = 2.0 * n**3 * per_await

            def make() -> Any:
                if per_await == 1:
                    return ops.matmul(a, a, out=outs[0])
                return trio_cuda.zip(*[ops.matmul(a, a, out=o) for o in outs])

            unit = "TFLOP/s"
            scale = 1e12
        else:
            ns = 1_400_000 if n >= 8192 else 200_000
            flop = float(per_await)

            cs = [await api.zeros((1,), np.int32) for _ in range(per_await)]  # independent branches

            def make() -> Any:
                if per_await == 1:
                    return sleep(c.partition((1,)), ns)
                return trio_cuda.zip(*[sleep(x.partition((1,)), ns // per_await) for x in cs])

            unit = "awaits/s"
            scale = 1.0
        for _ in range(3):
            await make()

        async def loop() -> float:
            for _ in range(reps):
                await make()
            return flop * reps

        results: dict[str, tuple[float, float, float]] = {}
        with spinning():
            work, wall, cpu, p99 = await with_ticker(loop)
        results["spin"] = (work / wall / scale, cpu, p99)
        await with_ticker(loop)  # the first pass learns
        before = lowlevel.notifier_statistics()
        work, wall, cpu, p99 = await with_ticker(loop)
        results["adaptive"] = (work / wall / scale, cpu, p99)
        sleeping_notes.append(f"{label}: {_sleeping(before, lowlevel.notifier_statistics())}")
        if torch is not None:
            ta = torch.ones(n, n, device="cuda", dtype=torch.bfloat16)
            tout = [torch.empty(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(per_await)]

            def step() -> None:
                for o in tout:
                    torch.matmul(ta, ta, out=o)

            def blocking_step() -> None:
                step()
                torch.cuda.synchronize()

            async def t_block() -> float:
                for _ in range(reps):
                    blocking_step()
                    await trio.lowlevel.checkpoint()
                return flop * reps

            async def t_thread() -> float:
                for _ in range(reps):
                    await trio.to_thread.run_sync(blocking_step)
                return flop * reps

            async def t_poll() -> float:
                for _ in range(reps):
                    step()
                    ev = torch.cuda.Event()
                    ev.record()
                    while not ev.query():
                        await trio.sleep(0)
                return flop * reps

            blocking_step()
            for name, body in (("torch blocking", t_block), ("torch to_thread", t_thread), ("torch event poll", t_poll)):
                work, wall, cpu, p99 = await with_ticker(body)
                results[name] = (work / wall / scale, cpu, p99)
        ref = results["spin"][0]
        for name, (thr, cpu, p99) in results.items():
            targets = ""
            if name == "adaptive":
                targets = (
                    f"throughput >= {min_ratio:.2f}x spin: {check(label + ' throughput', thr >= min_ratio * ref)}; "
                    f"CPU <= {max_cpu}: {check(label + ' CPU', cpu <= max_cpu)}; "
                    f"tick: {check(label + ' tick', p99 <= tick_limit)}"
                )
            out(f"| {label} | {name} | {thr:.1f} | {unit} | {thr / ref:.3f} | {cpu:.2f} | {p99:.3f} | {targets} |")

    big, mid = 8192, 4096
    await one_by_one(
        "matmul 8192^3 bf16, 1 per await" if cuda else "1.4 ms kernel, 1 per await", big, 40 if cuda else 30, 1, 0.98, 0.10
    )
    await one_by_one(
        "matmul 8192^3 bf16, 8 per await" if cuda else "8 kernels of 0.18 ms per await", big, 8 if cuda else 20, 8, 0.98, 0.10
    )
    await one_by_one(
        "matmul 4096^3 bf16, 1 per await" if cuda else "0.2 ms kernel, 1 per await", mid, 400 if cuda else 100, 1, 0.95, 0.25
    )

    # 4. many tasks, long kernels
    async def many() -> float:
        async def one() -> None:
            own = await api.zeros((1,), np.int32)  # its own kernels: nothing to order against others
            for _ in range(5):
                await sleep(own.partition((1,)), 20_000_000)

        async with trio.open_nursery() as n:
            for _ in range(64):
                n.start_soon(one)
        return 64 * 5

    await many()  # learn
    before = lowlevel.notifier_statistics()
    work, wall, cpu, p99 = await with_ticker(many)
    sleeping_notes.append(f"64 tasks: {_sleeping(before, lowlevel.notifier_statistics())}")
    out(
        f"| 64 tasks x 5 kernels of 20 ms | adaptive | {work / wall:.1f} | awaits/s | | {cpu:.2f} | {p99:.3f} | "
        f"CPU <= 0.10: {check('64 tasks CPU', cpu <= 0.10)}; tick: {check('64 tasks tick', p99 <= tick_limit)} |"
    )

    out("\nHow the adaptive waits of each case ended (counts over the measured pass):\n")
    for note in sleeping_notes:
        out(f"- {note}")

    # 5. head of line, 6. independent tasks
    out("\n| case | policy | short tasks' times (ms) | alone (ms) | worst / alone | target |")
    out("|---|---|---|---|---|---|")
    for policy_name in ("StreamPoolByLoad", "StreamPoolRoundRobin"):
        old = dev.policy
        dev.policy = getattr(trio_cuda, policy_name)(dev)
        try:
            await head_of_line(policy_name)
            await independent(policy_name)
        finally:
            dev.policy = old


async def _idle(seconds: float) -> float:
    await trio.sleep(seconds)
    return 0.0


async def _short_task(times: list[float], t0: float) -> None:
    c = await api.zeros((1,), np.int32)
    for _ in range(50):
        await sleep(c.partition((1,)), 100_000)
    times.append((time.perf_counter() - t0) * 1e3)


async def head_of_line(policy_name: str) -> None:
    alone: list[float] = []
    await _short_task([], time.perf_counter())
    await _short_task(alone, time.perf_counter())
    times: list[float] = []
    c = await api.zeros((1,), np.int32)
    async with trio.open_nursery() as n:
        running = trio.Event()

        async def long_task() -> None:
            first = True
            while True:
                op = sleep(c.partition((1,)), 50_000_000)
                sub = await lowlevel.submit(op)
                if first:
                    running.set()
                    first = False
                await sub.wait()

        n.start_soon(long_task)
        await running.wait()
        t0 = time.perf_counter()
        async with trio.open_nursery() as shorts:
            for _ in range(3):
                shorts.start_soon(_short_task, times, t0)
        n.cancel_scope.cancel()
    worst = max(times) / alone[0]
    target = check(f"head of line ({policy_name})", worst <= 1.5) if policy_name == "StreamPoolByLoad" else "(reference)"
    out(
        f"| head of line | {policy_name} | {', '.join(f'{t:.1f}' for t in sorted(times))} | {alone[0]:.1f} | {worst:.2f} | <= 1.5: {target} |"
    )


async def independent(policy_name: str) -> None:
    async def task() -> None:
        c = await api.zeros((1,), np.int32)
        for _ in range(20):
            await sleep(c.partition((1,)), 1_000_000)

    await task()
    t0 = time.perf_counter()
    await task()
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(task)
    eight = time.perf_counter() - t0
    ratio = eight / alone
    target = check(f"eight tasks ({policy_name})", ratio <= 1.2) if policy_name == "StreamPoolByLoad" else "(reference)"
    out(
        f"| 8 tasks x 20 kernels of 1 ms | {policy_name} | {eight * 1e3:.1f} (all) | {alone * 1e3:.1f} | {ratio:.2f} | <= 1.2: {target} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sleep kernels instead of products (any backend)")
    ap.add_argument("--out", default=None, help="write wait.md there")
    args = ap.parse_args()
    trio.run(run, args.quick)
    missed = [w for w, ok in verdicts if not ok]
    out(f"\ntargets: {len(verdicts) - len(missed)} of {len(verdicts)} met" + (f"; missed: {', '.join(missed)}" if missed else ""))
    if args.out:
        dev = trio_cuda.current_device()
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = "?"
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        head = f"# bench_wait ({stamp}, {dev.name}, backend {trio_cuda.backend_name()}, commit {commit or '?'}, cores {os.cpu_count()})\n\n"
        path = pathlib.Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "wait.md").write_text(head + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
