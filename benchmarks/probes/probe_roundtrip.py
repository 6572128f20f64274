"""Round trips of one tiny op over many batches in one process, beside the GPU's clocks and
trio's scheduler passes: does a slow mode come and go, and with what?

Usage: python benchmarks/probes/probe_roundtrip.py [--batches 20] [--size 500] [--smoke]

Each batch is ``--size`` round trips (``await inc(p)``, each timed), with how often the
submissions stayed on their stream or moved (the default policy's statistics) and the
device's cross-stream waits and frees meanwhile; odd batches also count
trio's task steps per await through a public trio instrument (the count, not the time, is
what they give: an instrument costs time). On CUDA, ``nvidia-smi`` samples the SM clock and
the performance state every 100 ms meanwhile; each batch prints the clocks sampled while it
ran. The comparison peer is bench_host's: the raw cuda.bindings round trip.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import trio_cuda
from benchmarks.bench_runtime import inc, roundtrips_ns
from trio_cuda import api, lowlevel


class _Steps(trio.abc.Instrument):
    """Counts the steps of every task (a step: one resumption by the scheduler)."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: Any) -> None:
        self.steps += 1


def _clocks(log: pathlib.Path, t0: float, t1: float) -> str:
    """The SM clocks (MHz) and performance states nvidia-smi sampled between t0 and t1."""
    sm: list[int] = []
    states: set[str] = set()
    for line in log.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[1].split()[0].isdigit():
            continue
        t = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
        if t0 - 1 <= t <= t1 + 1:
            sm.append(int(parts[1].split()[0]))
            states.add(parts[2])
    return f"SM {min(sm)}-{max(sm)} MHz {'/'.join(sorted(states))}" if sm else "no clock samples"


async def run(args: argparse.Namespace, log: pathlib.Path | None) -> None:
    x = await api.zeros((32,))
    p = x.partition((32,))
    for _ in range(50):
        await inc(p)
    before = lowlevel.notifier_statistics()
    dev = trio_cuda.current_device()
    policy = dev.policy
    pool = policy.statistics() if isinstance(policy, trio_cuda.StreamPoolByLoad) else None
    stats = dev.statistics()
    for b in range(args.batches):
        counter = None
        if b % 2:
            counter = _Steps()
            trio.lowlevel.add_instrument(counter)
        t0 = time.time()
        ns = await roundtrips_ns(p, args.size)
        t1 = time.time()
        if counter is not None:
            trio.lowlevel.remove_instrument(counter)
        ns.sort()
        line = f"batch {b:2d}: round trip median {statistics.median(ns) / 1e3:6.2f} us, p10 {ns[len(ns) // 10] / 1e3:6.2f}"
        if counter is not None:
            line += f", {counter.steps / args.size:.2f} task steps an await"
        if log is not None:
            line += ", " + _clocks(log, t0, t1)
        # What a slow mode could come from: the task's submissions leaving its stream
        # (each move then waits across streams), frees or other work on its stream.
        now = dev.statistics()
        line += f", {now.stream_waits - stats.stream_waits} stream waits, {now.frees - stats.frees} frees"
        stats = now
        if pool is not None:
            p2 = policy.statistics()
            line += f", stream kept {p2.kept - pool.kept} / moved {p2.idle - pool.idle + p2.grown - pool.grown + p2.shared - pool.shared}"
            pool = p2
        print(line, flush=True)
    after = lowlevel.notifier_statistics()
    print(
        f"waits: {after.fast_path - before.fast_path} on the fast path, {after.slow_path - before.slow_path} parked, "
        f"{after.sleeping.timed - before.sleeping.timed} timed sleeps"
    )
    assert (await x.to_host())[0] == 50 + args.batches * args.size, "every launch ran once"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--size", type=int, default=500, help="round trips a batch")
    ap.add_argument("--smoke", action="store_true", help="a few short batches (the simulated device)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.size = 2, 10
    log = smi = None
    if trio_cuda.backend_name() == "cuda" and shutil.which("nvidia-smi"):
        log = pathlib.Path("/tmp/probe_roundtrip_clocks.csv")
        with log.open("w") as f:
            smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,pstate", "--format=csv,noheader", "-lms", "100"], stdout=f
            )
    try:
        trio.run(run, args, log)
    finally:
        if smi is not None:
            smi.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
