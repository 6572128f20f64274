"""Where the compiled await's host time goes, section by section (issue 12).

Needs the hot path built with ``-DHOTPATH_TIMING`` (then ``_hotpath.timing()`` returns
the time stamp counter's ticks of each section of the submission, the await and the
poll; a normal build returns None and this probe says so). For example, on the GPU
machine::

    gcc -O2 -shared -fPIC -DHOTPATH_TIMING -I"$INC" trio_cuda/_hotpath.c -o trio_cuda/_hotpath$SUF
    python benchmarks/probes/probe_sections.py [--n 2000]

Figures, each the mean over the awaits of one scenario, in ns (the ticks converted
with the counter's rate measured against ``perf_counter_ns`` in the same process):

* ``round trip``: ``await op`` of a tiny kernel made before the clock starts, as
  bench_host's round-trip figure;
* ``await each``: ``await inc(p)`` in a loop (the op made each time), as its "sync
  after every op" figure.

The sections' sum is less than the whole await: what is left is trio's pass (the task
yields between the submission and the first poll), the frames around the C calls and
the probe's loop.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import trio

import trio_cuda
from trio_cuda import api

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench_runtime import inc, roundtrips_ns  # benchmarks/ and this folder (run as a script)

SECTIONS = {
    23: "await: traps on?, cancel check",
    24: "await: the submission stream",
    25: "await: _submit_now lookup, direct/trace flags",
    26: "await: the submission call (whole, sections 0-10)",
    0: "  submit: the thread's submitting flag",
    1: "  submit: the prepared entry (key, lookup)",
    2: "  submit: lock acquire",
    3: "  submit: ready checks (generation, reset, fault, stream, shape, deferred work)",
    4: "  submit: direct_calls (entry points, replaced methods)",
    5: "  submit: op state, start, submitting flag on",
    6: "  submit: enqueue (order, launch, note accesses)",
    20: "    driver: cuLaunchKernel (GIL released)",
    7: "  submit: the event (pool, Event, record)",
    11: "    the event's handle from the pool",
    12: "    the Event object's allocation",
    21: "    driver: cuEventRecord (GIL released)",
    13: "    the stream's last event replaced (the old one's __del__)",
    8: "  submit: flag off, statistics, counters",
    9: "  submit: lock release",
    10: "  submit: names, result tuple, decrefs",
    27: "await: unpack, clock, event checks, to the trap",
    28: "await after the pass: unwrap, cancel check",
    29: "await: the first poll (whole, sections 32-37)",
    32: "  poll: lock acquire",
    33: "  poll: checks (generation, stream, by-stream answer)",
    34: "  poll: direct_calls",
    35: "  poll: the query",
    22: "    driver: cuEventQuery (GIL released)",
    36: "  poll: done marks, decrefs",
    37: "  poll: lock release",
    30: "await: the value given back",
}


def ticks_per_ns(hp: object) -> float:
    _, c0 = hp.timing()  # type: ignore[attr-defined]
    t0 = time.perf_counter_ns()
    time.sleep(0.2)
    _, c1 = hp.timing()  # type: ignore[attr-defined]
    return (c1 - c0) / (time.perf_counter_ns() - t0)


async def scenario(hp: object, name: str, n: int, rate: float) -> None:
    x = await api.zeros((32,))
    p = x.partition((32,))
    for _ in range(200):
        await inc(p)
    hp.timing(True)  # type: ignore[attr-defined]
    c0 = hp.counters()  # type: ignore[attr-defined]
    if name == "round trip":
        whole = sorted(await roundtrips_ns(p, n))
        total = f"median {whole[n // 2]} ns, mean {sum(whole) / n:.0f} ns"
    else:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            await inc(p)
        total = f"mean {(time.perf_counter_ns() - t0) / n:.0f} ns (the op's build included)"
    got, _ = hp.timing(True)  # type: ignore[attr-defined]
    c1 = hp.counters()  # type: ignore[attr-defined]
    extra = ", ".join(f"{k} {c1[k] - c0[k]}" for k in ("pool_picks", "event_reuses", "spins") if k in c1)
    print(f"\n## {name}: {n} awaits, whole await {total}; {extra}")
    print(f"{'section':80s} {'ns':>7s} {'count':>7s}")
    for key, label in SECTIONS.items():
        if key in got:
            ticks, count = got[key]
            print(f"{label:80s} {ticks / count / rate:7.0f} {count:7d}")
    missing = sorted(set(got) - set(SECTIONS))
    if missing:
        print("unnamed sections:", missing)


async def main(n: int) -> None:
    from trio_cuda import _hotpath

    if _hotpath.timing() is None:
        raise SystemExit("probe_sections needs trio_cuda/_hotpath.c built with -DHOTPATH_TIMING (see the docstring)")
    rate = ticks_per_ns(_hotpath)
    dev = trio_cuda.current_device()
    print(f"{dev.name}, backend {trio_cuda.backend_name()}, time stamp counter {rate:.3f} ticks/ns")
    for name in ("round trip", "await each", "round trip", "await each"):
        await scenario(_hotpath, name, n, rate)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    trio.run(main, ap.parse_args().n)
