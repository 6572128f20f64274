"""What the compiled fast path saves (issue 12), measured in one process.

1. The three driver calls of an await -- cuLaunchKernel, cuEventRecord, cuEventQuery --
   through cuda.bindings, through trio_cuda's fast path (``_cudafast``), and in a loop
   in C (the driver's own cost).
2. trio-cuda with the fast path on and off (the backend's entry points swapped in
   place), interleaved in rounds next to the raw cuda.bindings figures: a tiny op's
   round trip, a 2000-op chain awaited once, awaits/s of 256 tasks.

Needs a CUDA device, the module built (``pip install -e .`` with a C compiler) and gcc
for the C loop. Prints medians in us.

    python benchmarks/probe_fastpath.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

from cuda.bindings import driver as cu

PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry noop() { ret; }
"""

LOOP_C = r"""
#include <stdint.h>
#include <time.h>
typedef int (*launch_fn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
typedef int (*record_fn)(void*, void*);
typedef int (*query_fn)(void*);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
double loop_launch(void *pfn, int n, void *f, void *s) {
    double t0 = now();
    for (int i = 0; i < n; i++) ((launch_fn)pfn)(f, 1, 1, 1, 32, 1, 1, 0, s, 0, 0);
    return (now() - t0) / n;
}
double loop_record(void *pfn, int n, void *e, void *s) {
    double t0 = now();
    for (int i = 0; i < n; i++) ((record_fn)pfn)(e, s);
    return (now() - t0) / n;
}
double loop_query(void *pfn, int n, void *e) {
    double t0 = now();
    for (int i = 0; i < n; i++) ((query_fn)pfn)(e);
    return (now() - t0) / n;
}
"""


def ok(r):  # type: ignore[no-untyped-def]
    err = r[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(err))
    return r[1] if len(r) == 2 else r[1:]


def pfn(name: str) -> int:
    r = cu.cuGetProcAddress(name.encode(), 12000, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
    assert r[0] == cu.CUresult.CUDA_SUCCESS and int(r[1]), r
    return int(r[1])


def driver_calls() -> None:
    from trio_cuda._backends import _cudafast as fast

    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    mod = ok(cu.cuModuleLoadData(PTX))
    fn = ok(cu.cuModuleGetFunction(mod, b"noop"))
    stream = ok(cu.cuStreamCreate(1))
    ev = ok(cu.cuEventCreate(2))  # timing off
    fi, si, ei = int(fn), int(stream), int(ev)
    pl, pr, pq = pfn("cuLaunchKernel"), pfn("cuEventRecord"), pfn("cuEventQuery")

    with tempfile.TemporaryDirectory() as d:
        so = os.path.join(d, "loop.so")
        src = os.path.join(d, "loop.c")
        with open(src, "w") as f:
            f.write(LOOP_C)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", src, "-o", so], check=True)
        lib = ctypes.CDLL(so)
    for name in ("loop_launch", "loop_record", "loop_query"):
        getattr(lib, name).restype = ctypes.c_double
    vp = ctypes.c_void_p

    batch = 200

    def per_op(fn_batch) -> float:  # type: ignore[no-untyped-def]
        out = []
        for _ in range(60):
            ok(cu.cuStreamSynchronize(stream))
            t0 = time.perf_counter_ns()
            fn_batch()
            out.append((time.perf_counter_ns() - t0) / batch / 1000)
        return statistics.median(out)

    rng = range(batch)
    launch_b = cu.cuLaunchKernel
    launch_f = fast.launch

    def b_launch() -> None:
        for _ in rng:
            launch_b(fn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0)

    def b_launch_int() -> None:
        for _ in rng:
            launch_b(fi, 1, 1, 1, 32, 1, 1, 0, si, 0, 0)

    def f_launch() -> None:
        for _ in rng:
            launch_f(pl, fi, 1, 1, 1, 32, 1, 1, 0, si, 0)

    def c_launch() -> None:
        lib.loop_launch(vp(pl), batch, vp(fi), vp(si))

    def b_record() -> None:
        r = cu.cuEventRecord
        for _ in rng:
            r(ev, stream)

    def f_record() -> None:
        r = fast.record
        for _ in rng:
            r(pr, ei, si)

    def c_record() -> None:
        lib.loop_record(vp(pr), batch, vp(ei), vp(si))

    def b_query() -> None:
        q = cu.cuEventQuery
        for _ in rng:
            q(ev)

    def f_query() -> None:
        q = fast.query
        for _ in rng:
            q(pq, ei)

    def c_query() -> None:
        lib.loop_query(vp(pq), batch, vp(ei))

    def empty() -> None:
        for _ in rng:
            pass

    rows = [
        ("empty Python loop", empty),
        ("cuLaunchKernel, cuda.bindings (CUfunction, CUstream)", b_launch),
        ("cuLaunchKernel, cuda.bindings (int handles)", b_launch_int),
        ("cuLaunchKernel, _cudafast", f_launch),
        ("cuLaunchKernel, C loop", c_launch),
        ("cuEventRecord, cuda.bindings", b_record),
        ("cuEventRecord, _cudafast", f_record),
        ("cuEventRecord, C loop", c_record),
        ("cuEventQuery (done), cuda.bindings", b_query),
        ("cuEventQuery (done), _cudafast", f_query),
        ("cuEventQuery (done), C loop", c_query),
    ]
    res = {name: [] for name, _ in rows}
    for _ in range(3):  # interleaved rounds
        for name, f in rows:
            res[name].append(per_op(f))
    print(f"{'call':58s} {'us (median of 3 rounds x 60 batches of 200)':>12s}")
    for name, _ in rows:
        print(f"{name:58s} {statistics.median(res[name]):8.3f}")
    print("python", sys.version.split()[0], sysconfig.get_platform())


async def on_off(rounds: int) -> None:
    import trio
    from probe_completion import print_rounds, round_trip_us  # this folder (run as a script)

    import trio_cuda
    from trio_cuda import _submit, api

    from numba import cuda

    @trio_cuda.kernel
    def inc(x):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < x.shape[0]:
            x[i] += 1.0

    dev = trio_cuda.current_device()
    drv = dev._driver
    fast = drv._fast
    assert fast is not None, "the fast path is not active"
    x = await api.zeros((32,))
    p = x.partition((32,))
    s = dev.create_stream()
    for _ in range(50):
        await inc(p)
        await _submit.run_async(inc(p), s)
    count = 100
    prepared = next(iter(inc._fast.values()))[3]
    h = s.handle
    ev = ok(cu.cuEventCreate(2))
    results: dict[str, list[float]] = {}

    def note(key: str, v: float) -> None:
        results.setdefault(key, []).append(v)

    n = 1000
    tasks, per = 256, 50
    for _ in range(rounds):
        # raw cuda.bindings: launch + record + busy query; a chain of launches
        rt = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            cu.cuLaunchKernel(prepared.function, 1, 1, 1, 32, 1, 1, 0, h, prepared.params, 0)
            cu.cuEventRecord(ev, h)
            while cu.cuEventQuery(ev)[0] != cu.CUresult.CUDA_SUCCESS:
                pass
            rt.append((time.perf_counter_ns() - t0) / 1e3)
        note("raw round trip, us", statistics.median(rt))
        t0 = time.perf_counter_ns()
        for _ in range(2000):
            cu.cuLaunchKernel(prepared.function, 1, 1, 1, 32, 1, 1, 0, h, prepared.params, 0)
        note("raw chain launches, us/op", (time.perf_counter_ns() - t0) / 2000 / 1e3)
        ok(cu.cuStreamSynchronize(h))
        count += 3000
        for way in (fast, None):
            drv._fast = way
            tag = "on" if way is not None else "off"
            rt = await round_trip_us(lambda: inc(p), n, lambda op: _submit.run_async(op, s))
            note(f"trio-cuda round trip, one stream, fast path {tag}, us", rt)
            rt = await round_trip_us(lambda: inc(p), n)
            note(f"trio-cuda round trip, await op (policy), fast path {tag}, us", rt)
            op = inc(p)
            for _ in range(1999):
                op = inc(op.first())
            t0 = time.perf_counter_ns()
            await _submit.run_async(op, s)
            note(f"trio-cuda chain awaited once, fast path {tag}, us/op", (time.perf_counter_ns() - t0) / 2000 / 1e3)
            count += 2 * n + 2000
            xs = [await api.zeros((32,)) for _ in range(tasks)]

            async def one(i: int, xs: list[object] = xs) -> None:
                q = xs[i].partition((32,))  # type: ignore[attr-defined]
                for _ in range(per):
                    await inc(q)

            t0 = time.perf_counter_ns()
            async with trio.open_nursery() as nursery:
                for i in range(tasks):
                    nursery.start_soon(one, i)
            note(f"trio-cuda awaits/s, 256 tasks, fast path {tag}", tasks * per / ((time.perf_counter_ns() - t0) / 1e9))
            got = await xs[-1].to_host()
            assert (got == per).all()
    drv._fast = fast
    got = await x.to_host()
    assert (got == count).all(), (got[0], count)
    print_rounds(results, rounds)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    driver_calls()
    import trio

    trio.run(on_off, args.rounds)
