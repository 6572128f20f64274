"""Completion latency of an await: the notifier's fast path against its slow path.

For GPU waits of several lengths (a tiny kernel; the sleep kernel at 0.2, 1 and 5 ms)
this measures, on the current device, the median time of:

* ``spin``: submit, then spin on the event in the calling thread (no trio yield): the floor;
* ``fast path``: ``await op`` with an unlimited polling budget (poll between checkpoints);
* ``slow path``: ``await op`` with no polling budget: the task parks at once and the
  helper thread wakes it (CUDA: host function posting a semaphore);
* ``default``: ``await op`` with the backend's default budget.

Prints a table in microseconds and the slow path's extra latency over spinning; writes
``notifier-<date>.md`` under ``--out``. These figures chose the default budget.
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import statistics
import sys
import time

import numpy as np
import trio

import trio_cuda
from trio_cuda import _notifier, api, lowlevel
from trio_cuda.kernels import sleep

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _results

from numba import cuda


@trio_cuda.kernel(sim=lambda x: None)
def tiny(x):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += 1.0


async def measure(reps: int) -> list[tuple[str, dict[str, float]]]:
    dev = trio_cuda.current_device()
    x = await api.zeros((32,))
    c = await api.zeros((1,), np.int32)
    cases = [("tiny kernel", lambda: tiny(x.partition((32,))))]
    for ms in (0.2, 1.0, 5.0):
        cases.append((f"sleep {ms} ms", lambda ns=int(ms * 1e6): sleep(c.partition((1,)), ns)))
    for _, make in cases:  # warm up
        await make()
    default_budget = _notifier.poll_budget_ns()
    rows = []
    for label, make in cases:
        n = reps if "5 ms" not in label else max(reps // 5, 10)
        res: dict[str, float] = {}
        spin = []
        for _ in range(n):
            op = make()
            t0 = time.perf_counter_ns()
            ev = (await lowlevel.submit(op, dev.policy.next_stream())).event
            while ev is not None and not ev.query():
                pass
            spin.append((time.perf_counter_ns() - t0) / 1e3)
        res["spin"] = statistics.median(spin)
        for mode, budget in (("fast path", 10**12), ("slow path", 0), ("default", default_budget)):
            _notifier._budget_ns = budget
            ts = []
            for _ in range(n):
                op = make()
                t0 = time.perf_counter_ns()
                await op
                ts.append((time.perf_counter_ns() - t0) / 1e3)
            res[mode] = statistics.median(ts)
        _notifier._budget_ns = default_budget
        rows.append((label, res))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    args = ap.parse_args()
    rows = trio.run(measure, args.reps)
    modes = ["spin", "fast path", "slow path", "default"]
    lines = ["| wait | " + " | ".join(f"{m} (us)" for m in modes) + " | slow - spin (us) |", "|---" * (len(modes) + 2) + "|"]
    for label, res in rows:
        lines.append(f"| {label} | " + " | ".join(f"{res[m]:.1f}" for m in modes) + f" | {res['slow path'] - res['spin']:.1f} |")
    dev = trio_cuda.current_device()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"# Await completion latency ({stamp})\n\nGPU: {dev.name}, backend {trio_cuda.backend_name()}; medians of "
        f"{args.reps} awaits (fewer for 5 ms); default budget {_notifier.poll_budget_ns() / 1e3:.0f} us.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    _results.write(args.out, "notifier", text, {"report": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
