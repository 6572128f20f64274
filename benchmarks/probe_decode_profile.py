"""Where the time of the decode step awaited kernel by kernel goes (issue 12).

On the example's decode step (bench_decode.py, 88 kernels per token), per kernel kind:
the time to build the op (the ``ops``/kernel call, no await) and the time of its
``await``; a trio checkpoint alone; one event query; then cProfile over a few tokens
(top functions by own time). On the simulated device use tiny sizes
(``--hidden 64 --layers 2 --n 50``): the figures mean nothing there.

    python benchmarks/probe_decode_profile.py [--hidden 2048] [--layers 22] [--n 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pathlib
import pstats
import statistics
import sys
import time
from typing import Any

import trio

import trio_cuda

try:
    from trio_cuda import _hotpath
except ImportError:
    _hotpath = None

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_decode import build, per_kernel_ops  # this folder (run as a script)
from bench_runtime import inc
from probe_gemm_graphs import torch_eager_ms

from benchmarks import _peers


def driver_floor(dev: Any) -> None:
    """The driver calls of one submission and one completed poll, alone: the compiled
    calls the backend makes (_cudafast), on a stream and an event of its own, with the
    prepared launch of bench_runtime's inc (found among the live objects)."""
    from trio_cuda._backends import _cuda, _cudafast

    drv = dev._driver
    fast = drv._fast
    if fast is None:
        print("driver floor: no compiled fast path")
        return
    preps = [o for o in gc.get_objects() if type(o) is _cuda._Prepared and "inc" in o.name]
    if not preps:
        print("driver floor: no prepared launch of inc found")
        return
    p = preps[0]
    s = drv.create_stream()
    ev = drv.create_event()
    sh, eh = int(s), int(ev)
    n = 2000

    def launch() -> int:
        return _cudafast.launch(fast[0], p.fn, p.gx, p.gy, p.gz, p.bx, p.by, p.bz, 0, sh, p.params)

    out = {}
    for _ in range(2):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            launch()
        t1 = time.perf_counter_ns()
        for _ in range(n):
            _cudafast.record(fast[1], eh, sh)
        t2 = time.perf_counter_ns()
        while _cudafast.query(fast[2], eh) != 0:
            pass
        t3 = time.perf_counter_ns()
        for _ in range(n):
            _cudafast.query(fast[2], eh)
        t4 = time.perf_counter_ns()
        rt = []
        for _ in range(n):
            r0 = time.perf_counter_ns()
            launch()
            _cudafast.record(fast[1], eh, sh)
            while _cudafast.query(fast[2], eh) != 0:
                pass
            rt.append(time.perf_counter_ns() - r0)
        first = []
        for _ in range(n):
            launch()
            _cudafast.record(fast[1], eh, sh)
            while True:  # wait until done without querying, then time the first query
                time.sleep(0)
                r0 = time.perf_counter_ns()
                q = _cudafast.query(fast[2], eh)
                first.append(time.perf_counter_ns() - r0)
                if q == 0:
                    break
                first.pop()
        out = {
            "launch": (t1 - t0) / n / 1e3,
            "record": (t2 - t1) / n / 1e3,
            "query, done, again": (t4 - t3) / n / 1e3,
            "first query that finds it done": statistics.median(first) / 1e3,
            "launch + record + query until done": statistics.median(rt) / 1e3,
        }
    print("driver floor (compiled calls, us): " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))


async def main(hidden: int, layers: int, n: int, tokens: int) -> None:
    dev = trio_cuda.current_device()
    dev.policy = trio_cuda.SingleStream(dev)
    makers = per_kernel_ops(await build(hidden, layers))
    for _ in range(3):
        for make in makers:
            await make()
    kinds = ["rms_norm", "GEMV q", "GEMV o", "add kernel"]
    print(f"per kind, {n} each, us (median of 5 blocks): build | await | both")

    def moved(c0: dict[str, int]) -> str:
        c1 = _hotpath.counters() if _hotpath is not None else {}
        return ", ".join(f"{k} {c1[k] - c0[k]}" for k in c1 if c1[k] != c0[k])

    for k, make in enumerate(makers[:4]):
        c0 = _hotpath.counters() if _hotpath is not None else {}
        b, a, w = [], [], []
        for _ in range(5):
            tb = ta = 0
            t00 = time.perf_counter_ns()
            for _ in range(n):
                t0 = time.perf_counter_ns()
                op = make()
                t1 = time.perf_counter_ns()
                await op
                t2 = time.perf_counter_ns()
                tb += t1 - t0
                ta += t2 - t1
            w.append((time.perf_counter_ns() - t00) / n / 1e3)
            b.append(tb / n / 1e3)
            a.append(ta / n / 1e3)
        print(f"  {kinds[k]:12s} {statistics.median(b):7.2f} | {statistics.median(a):7.2f} | {statistics.median(w):7.2f}")
        print(f"    counters: {moved(c0)}")
    x = await trio_cuda.api.zeros((32,))
    px = x.partition((32,))
    for label, pol in (("one stream", dev.policy), ("stream pool", trio_cuda.StreamPoolRoundRobin(dev))):
        old, dev.policy = dev.policy, pol
        for _ in range(20):
            await inc(px)
        c0 = _hotpath.counters() if _hotpath is not None else {}
        t = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                await inc(px)
            t.append((time.perf_counter_ns() - t0) / n / 1e3)
        dev.policy = old
        print(f"tiny kernel (bench_runtime's inc), build + await, {label}: {statistics.median(t):.2f} us")
        print(f"    counters: {moved(c0)}")
    # the await's pieces, one by one (what await_op does, timed between the steps)
    old, dev.policy = dev.policy, trio_cuda.SingleStream(dev)
    for label, make in (("tiny kernel (inc)", lambda: inc(px)), ("add kernel", makers[3]), ("GEMV q", makers[1])):
        parts = [0, 0, 0, 0, 0]
        first_done = 0
        for _ in range(n):
            op = make()
            t0 = time.perf_counter_ns()
            st = dev._submission_stream()
            t1 = time.perf_counter_ns()
            done = op._submit_now(st)
            t2 = time.perf_counter_ns()
            await trio.lowlevel.cancel_shielded_checkpoint()
            t3 = time.perf_counter_ns()
            ev = done[1]
            if dev.poll(ev):
                first_done += 1
            t4 = time.perf_counter_ns()
            while not dev.poll(ev):
                pass
            t5 = time.perf_counter_ns()
            for i, d in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                parts[i] += d
        names_ = ("stream", "submit", "trio pass", "first poll", "spin to done")
        print(
            f"{label} pieces, us: "
            + ", ".join(f"{nm} {v / n / 1e3:.2f}" for nm, v in zip(names_, parts, strict=True))
            + f"; first poll done {first_done}/{n}"
        )
    dev.policy = old
    cp = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            await trio.lowlevel.checkpoint()
        cp.append((time.perf_counter_ns() - t0) / n / 1e3)
    print(f"trio.lowlevel.checkpoint(): {statistics.median(cp):.2f} us")
    t0 = time.perf_counter_ns()
    for _ in range(tokens):
        for make in makers:
            await make()
    plain = (time.perf_counter_ns() - t0) / tokens / 1e6
    print(f"decode, await per kernel: {plain:.3f} ms/token ({plain * 1e3 / len(makers):.2f} us/kernel)")
    if trio_cuda.backend_name() == "cuda":
        raw = _peers.run_peer("raw_cuda_bindings", 1000, 3)
        print(
            f"raw cuda.bindings tiny kernel: sync each {raw['sync_each_us_per_op']:.2f} us, round trip {raw['roundtrip_us']:.2f} us"
        )
        for sync in (False, True):
            e = torch_eager_ms(hidden, layers, sync_each=sync)
            if e is not None:
                print(f"torch eager decode{', sync after every op' if sync else ''}: {e:.3f} ms/token")
    if trio_cuda.backend_name() == "cuda":
        driver_floor(dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(tokens):
        for make in makers:
            await make()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(30)
    print(s.getvalue())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args()
    trio.run(main, args.hidden, args.layers, args.n, args.tokens)
