"""Awaits under trio, asyncio and asyncio on uvloop, side by side in one process.

The same await code runs under each loop (started with ``anyio.run``, whose trio backend
is trio itself and whose asyncio backend runs plain asyncio tasks); the figures are
measured in ``--rounds`` interleaved rounds, one ``anyio.run`` per loop per round, the
order reversed every other round, so that a drift of the machine's host speed falls on
every loop alike. The device, its tensors and the decode model are made once and shared
by every run. Figures (medians over the rounds):

* ``round trip, us``: one tiny kernel (``bench_runtime.inc``: ``x[i] += 1`` on 32 floats)
  made beforehand, then ``await op``; median over ``--roundtrips`` round trips.
* ``sync after every op, us/op``: ``await inc(p)`` made and awaited ``--sync`` times.
* ``decode step, await per kernel, ms/token``: the decode step of
  ``examples/cuda_graphs_deviceop.py`` (``--hidden``, ``--layers``: 4 kernels a layer)
  awaited kernel by kernel on one stream (``bench_decode.per_kernel_ops``).
* ``awaits/s, T tasks``: T tasks of one anyio task group, each awaiting ``inc`` on its
  own tensor, ``--awaits`` awaits in all, under the device's default policy.

Every tensor is read back at the end and checked (each element equals the launches made
on it). The ratios are each loop's figure over trio's in the same rounds (for awaits/s,
trio's over the loop's, so that above 1 is slower everywhere); the target is 1.5x.

Usage: ``python benchmarks/bench_loops.py [--rounds 5] [--out DIR]``; ``--smoke`` runs
tiny sizes (for the simulated device, ``TRIO_CUDA_BACKEND=sim``, where the figures mean
nothing). Writes ``loops-<date>.md`` and ``.json`` under ``--out`` (default
benchmarks/results). Exits 1 if a result was wrong.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import pathlib
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import trio_cuda
from benchmarks import _results, bench_decode, bench_runtime
from trio_cuda import api

#: name: (anyio backend, backend options)
LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "trio": ("trio", {}),
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
}

SMOKE = {"rounds": 2, "roundtrips": 10, "sync": 10, "hidden": 16, "layers": 2, "tokens": 2, "tasks": 8, "awaits": 64}

TARGET = 1.5


class Shared:
    """What every loop's runs use: made once, in the first run."""

    def __init__(self) -> None:
        self.p: Any = None
        self.x: Any = None
        self.launches = 0  # on x
        self.task_tensors: list[Any] = []
        self.task_launches = 0  # on each of task_tensors
        self.makers: list[Any] = []

    async def make(self, args: argparse.Namespace) -> None:
        self.x = await api.zeros((32,))
        self.p = self.x.partition((32,))
        for _ in range(20):  # compile and load the kernel, fill the pools
            await bench_runtime.inc(self.p)
        self.launches = 20
        self.task_tensors = [await api.zeros((32,)) for _ in range(args.tasks)]
        model = await bench_decode.build(args.hidden, args.layers)
        self.makers = bench_decode.per_kernel_ops(model)
        for make in self.makers:
            await make()


async def measure(shared: Shared, args: argparse.Namespace) -> dict[str, float]:
    if shared.p is None:
        await shared.make(args)
    inc, p = bench_runtime.inc, shared.p
    rt = await bench_runtime.roundtrips_ns(p, args.roundtrips)
    t0 = time.perf_counter_ns()
    for _ in range(args.sync):
        await inc(p)
    sync_us = (time.perf_counter_ns() - t0) / args.sync / 1e3
    shared.launches += args.roundtrips + args.sync

    dev = trio_cuda.current_device()
    policy = dev.policy
    dev.policy = trio_cuda.SingleStream(dev)  # bench_decode's "await per kernel": one stream
    try:
        t0 = time.perf_counter_ns()
        for _ in range(args.tokens):
            for make in shared.makers:
                await make()
        decode_ms = (time.perf_counter_ns() - t0) / args.tokens / 1e6
    finally:
        dev.policy = policy

    k = max(1, args.awaits // args.tasks)

    async def worker(q: Any) -> None:
        for _ in range(k):
            await inc(q)

    t0 = time.perf_counter_ns()
    async with anyio.create_task_group() as tg:
        for t in shared.task_tensors:
            tg.start_soon(worker, t.partition((32,)))
    rate = args.tasks * k / ((time.perf_counter_ns() - t0) / 1e9)
    shared.task_launches += k
    return {
        "roundtrip_us": statistics.median(rt) / 1e3,
        "sync_each_us": sync_us,
        "decode_ms_per_token": decode_ms,
        "awaits_per_s": rate,
    }


async def check(shared: Shared) -> list[str]:
    wrong = []
    got = await shared.x.to_host()
    if not np.all(got == shared.launches):
        wrong.append(f"the round-trip tensor holds {sorted(set(got.tolist()))[:3]}, expected {shared.launches}")
    for i, t in enumerate(shared.task_tensors):
        got = await t.to_host()
        if not np.all(got == shared.task_launches):
            wrong.append(f"task tensor {i} holds {sorted(set(got.tolist()))[:3]}, expected {shared.task_launches}")
    return wrong


FIGURES = [
    ("roundtrip_us", "round trip, us", False),
    ("sync_each_us", "sync after every op, us/op", False),
    ("decode_ms_per_token", "decode step, await per kernel, ms/token", False),
    ("awaits_per_s", "awaits/s, {tasks} tasks", True),
]


def table(args: argparse.Namespace, rounds: dict[str, list[dict[str, float]]]) -> list[str]:
    loops = list(rounds)
    others = [n for n in loops if n != "trio"]
    head = ["figure", *loops, *(f"{n} / trio" for n in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, higher_better in FIGURES:
        med = {n: statistics.median(r[key] for r in rounds[n]) for n in loops}
        cells = [label.format(tasks=args.tasks), *(f"{med[n]:,.0f}" if med[n] >= 100 else f"{med[n]:.3g}" for n in loops)]
        for n in others:
            per_round = [
                (t[key] / o[key]) if higher_better else (o[key] / t[key]) for t, o in zip(rounds["trio"], rounds[n], strict=True)
            ]
            ratio = statistics.median(per_round)
            verdict = "met" if ratio <= TARGET else "MISSED"
            cells.append(f"{ratio:.2f}x ({min(per_round):.2f}-{max(per_round):.2f}) {verdict}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for the simulated device")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--roundtrips", type=int, default=300)
    ap.add_argument("--sync", type=int, default=500)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--awaits", type=int, default=51_200, help="awaits per round of the awaits/s figure (all tasks)")
    ap.add_argument("--loops", default=",".join(LOOPS), help="loops to measure, trio first")
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    known, _ = ap.parse_known_args(argv)
    if known.smoke:
        ap.set_defaults(**SMOKE)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.loops.split(",") if n.strip()]
    if not names or names[0] != "trio" or any(n not in LOOPS for n in names):
        ap.error(f"--loops: a comma-separated list of {', '.join(LOOPS)}, trio first")
    notes = []
    if "uvloop" in names:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            names.remove("uvloop")
            notes.append("- uvloop is not installed: not measured")

    started = time.perf_counter()
    shared = Shared()
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            backend, options = LOOPS[name]
            rounds[name].append(anyio.run(measure, shared, args, backend=backend, backend_options=options))
    wrong = anyio.run(check, shared, backend="trio")

    dev = trio_cuda.current_device()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = [f"python {sys.version.split()[0]}", f"trio-cuda {trio_cuda.__version__}"]
    for dist in ("anyio", "trio", "uvloop"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    text = "\n".join(
        [
            f"# Awaits under trio, asyncio and uvloop ({stamp})",
            "",
            f"GPU: {dev.name}, backend {trio_cuda.backend_name()}, {', '.join(versions)}. "
            f"{args.rounds} interleaved rounds; {args.roundtrips} round trips, {args.sync} synced ops, "
            f"decode hidden {args.hidden} x {args.layers} layers, {args.tokens} tokens, "
            f"{args.tasks} tasks x {max(1, args.awaits // args.tasks)} awaits a round. "
            f"Ratios: median of the per-round ratios to trio (range), target <= {TARGET}x.",
            "",
            *table(args, rounds),
            "",
            *notes,
            *(f"- WRONG RESULT: {w}" for w in wrong),
            "- every result checked" if not wrong else "",
            f"- whole run: {time.perf_counter() - started:.1f} s",
            "",
        ]
    )
    record = {"when": stamp, "gpu": dev.name, "backend": trio_cuda.backend_name(), "args": vars(args), "rounds": rounds}
    _results.write(args.out, "loops", text, record)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
