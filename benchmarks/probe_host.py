"""Where the host time of one awaited op goes (issue 12's profile), on one GPU.

Measured in one process, each figure a median over many repetitions:

1. Unit costs of the driver calls on the hot path through cuda.bindings (stream passed
   as a ``CUstream`` and as an int) and through ctypes straight into libcuda.
2. trio's own costs: one ``checkpoint()`` (a scheduler pass) with one task, and
   ``current_statistics()``.
3. The GPU's latency: from the return of ``cuEventRecord`` after a tiny launch to the
   first ``cuEventQuery`` that reports it done, busy-polling.
4. trio-cuda's round trip cut into parts: the one-step submission (plan, launch,
   record), the wait as ``await`` does it, and the same wait done by busy polling
   without yielding (what a spin would give).
5. A chain's submission with the driver's launch replaced by a no-op, in the same
   process: the runtime's Python cost per op without the driver.

Usage: ``python benchmarks/probe_host.py [--n 5000]``; prints one table.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from typing import Any

import trio

import trio_cuda
from trio_cuda import api

from numba import cuda


@trio_cuda.kernel
def inc(x):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += 1.0


ns = time.perf_counter_ns
rows: list[tuple[str, float]] = []


def row(label: str, us: float) -> None:
    rows.append((label, us))
    print(f"{label:<70} {us:8.3f} us", flush=True)


def per_call(n: int, fn: Any, *args: Any) -> float:
    """us per call of ``fn(*args)``, median of 5 runs of ``n`` calls."""
    runs = []
    for _ in range(5):
        t0 = ns()
        for _ in range(n):
            fn(*args)
        runs.append((ns() - t0) / n / 1e3)
    return statistics.median(runs)


async def main(n: int) -> None:
    if trio_cuda.backend_name() != "cuda":
        raise SystemExit("probe_host.py measures the CUDA driver: it needs a GPU")
    dev = trio_cuda.current_device()
    drv = dev._driver
    x = await api.zeros((32,))
    p = x.partition((32,))
    for _ in range(50):
        await inc(p)
    stream = dev.policy.next_stream()
    op = inc(p)
    done = op._submit_now(stream)
    assert done is not None, "the one-step submission path was not taken"
    await trio_cuda._notifier.wait_event(done[1])
    prepared = next(iter(inc._fast.values()))[3]
    h = stream.handle
    from cuda.bindings import driver as cu

    f = prepared.function
    params = prepared.params
    launch = cu.cuLaunchKernel

    hint = int(h)
    ev_plain = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    ev_ours = drv.create_event()
    record, query = cu.cuEventRecord, cu.cuEventQuery

    cu.cuStreamSynchronize(h)
    row("cuda.bindings cuLaunchKernel, CUstream", per_call(n, launch, f, 1, 1, 1, 32, 1, 1, 0, h, params, 0))
    cu.cuStreamSynchronize(h)
    row("cuda.bindings cuLaunchKernel, int stream", per_call(n, launch, f, 1, 1, 1, 32, 1, 1, 0, hint, params, 0))
    cu.cuStreamSynchronize(h)
    row("driver.launch (ours)", per_call(n, drv.launch, prepared, h))
    cu.cuStreamSynchronize(h)
    row("cuda.bindings cuEventRecord, timing off", per_call(n, record, ev_plain, h))
    cu.cuStreamSynchronize(h)
    row("cuda.bindings cuEventRecord, timing off + blocking sync", per_call(n, record, ev_ours, h))
    cu.cuStreamSynchronize(h)
    row("cuda.bindings cuEventQuery (done)", per_call(n, query, ev_plain))
    row("driver.query (ours, done)", per_call(n, drv.query, ev_plain))

    lib = ctypes.CDLL("libcuda.so.1")
    c_launch = lib.cuLaunchKernel
    c_launch.restype = ctypes.c_int
    c_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fptr, sptr = int(f), hint

    c_rec = lib.cuEventRecord
    c_rec.restype = ctypes.c_int
    c_rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    c_q = lib.cuEventQuery
    c_q.restype = ctypes.c_int
    c_q.argtypes = [ctypes.c_void_p]
    eptr = int(ev_plain)

    row("ctypes cuLaunchKernel", per_call(n, c_launch, fptr, 1, 1, 1, 32, 1, 1, 0, sptr, params, None))
    cu.cuStreamSynchronize(h)
    row("ctypes cuEventRecord", per_call(n, c_rec, eptr, sptr))
    cu.cuStreamSynchronize(h)
    row("ctypes cuEventQuery (done)", per_call(n, c_q, eptr))

    # trio's costs
    t0 = ns()
    for _ in range(n):
        await trio.lowlevel.checkpoint()
    row("trio checkpoint (one task)", (ns() - t0) / n / 1e3)
    t0 = ns()
    for _ in range(n):
        await trio.lowlevel.cancel_shielded_checkpoint()
    row("trio cancel_shielded_checkpoint (one task)", (ns() - t0) / n / 1e3)
    t0 = ns()
    for _ in range(n):
        trio.lowlevel.current_statistics()
    row("trio current_statistics()", (ns() - t0) / n / 1e3)

    # GPU latency, raw
    lat, polls = [], []
    for _ in range(2000):
        launch(f, 1, 1, 1, 32, 1, 1, 0, h, params, 0)
        record(ev_plain, h)
        t0 = ns()
        k = 0
        while query(ev_plain)[0] != cu.CUresult.CUDA_SUCCESS:
            k += 1
        lat.append((ns() - t0) / 1e3)
        polls.append(k)
    row("GPU latency: record return -> first done query (raw)", statistics.median(lat))
    row("  queries needed (median count)", statistics.median(polls))
    rt = []
    for _ in range(2000):
        t0 = ns()
        launch(f, 1, 1, 1, 32, 1, 1, 0, h, params, 0)
        record(ev_plain, h)
        while query(ev_plain)[0] != cu.CUresult.CUDA_SUCCESS:
            pass
        rt.append((ns() - t0) / 1e3)
    row("raw round trip (launch, record, busy query)", statistics.median(rt))

    # trio-cuda's round trip in parts
    sub, polled, waitpart = [], [], []
    for _ in range(2000):
        op = inc(p)
        t0 = ns()
        done = op._submit_now(stream)
        t1 = ns()
        ev = done[1]
        while not dev.poll(ev):
            pass
        t2 = ns()
        await trio.lowlevel.cancel_shielded_checkpoint()
        sub.append((t1 - t0) / 1e3)
        polled.append((t2 - t0) / 1e3)
    row("trio-cuda one-step submission (plan, launch, record)", statistics.median(sub))
    row("trio-cuda submission + busy poll to done (no trio)", statistics.median(polled))
    for _ in range(2000):
        op = inc(p)
        t0 = ns()
        done = op._submit_now(stream)
        t1 = ns()
        await trio_cuda._notifier.wait_event(done[1])
        waitpart.append((ns() - t1) / 1e3)
    row("trio-cuda wait_event after submission", statistics.median(waitpart))

    async def round_trips(run: Any, built_inside: bool = False) -> float:
        """Median us of 2000 ``await run(inc(p))``; the op is made before the clock
        starts unless ``built_inside``."""
        times = []
        for _ in range(2000):
            op = None if built_inside else inc(p)
            t0 = ns()
            await run(inc(p) if op is None else op)
            times.append((ns() - t0) / 1e3)
        return statistics.median(times)

    def as_is(op: Any) -> Any:
        return op

    row("trio-cuda await inc(p) round trip (policy stream)", await round_trips(as_is))
    row("trio-cuda await inc(p) incl. op construction", await round_trips(as_is, built_inside=True))
    row(
        "trio-cuda run_async(inc(p), one fixed stream)",
        await round_trips(lambda op: trio_cuda._submit.run_async(op, stream)),
    )

    # the wait with and without the spin on the completion word
    saved = trio_cuda._notifier._spin_ns
    for spin in (0, saved):
        trio_cuda._notifier._spin_ns = spin
        row(f"trio-cuda await inc(p), spin {spin / 1000:.0f} us", await round_trips(as_is, built_inside=True))
    trio_cuda._notifier._spin_ns = saved

    # chain: runtime Python with the launch a no-op, vs real; and the wait after it
    chain = 2000
    for real in (True, False):
        times, waits, syncs = [], [], []
        for _ in range(5):
            op = inc(p)
            for _ in range(chain - 1):
                op = inc(op.first())
            if not real:
                drv.launch = lambda *a: None  # type: ignore[method-assign]
            t0 = ns()
            plan, _, need = trio_cuda._submit.begin(op, stream)
            t1 = ns()
            if not real:
                del drv.launch
            assert need is None
            if real:
                # how long the GPU still had to go when the submission returned
                while not dev.reached(plan.event) and not dev.poll(plan.event):
                    pass
                syncs.append((ns() - t1) / 1e3)
            t2 = ns()
            await trio_cuda._notifier.wait_event(plan.event)
            waits.append((ns() - t2) / 1e3)
            times.append((t1 - t0) / chain / 1e3)
        label = "real launch" if real else "launch a no-op"
        row(f"chain submission per op ({label})", statistics.median(times))
        if real:
            row("  chain: GPU still busy after the submission returned, us (whole chain)", statistics.median(syncs))
        row(f"  chain: wait_event once done, us ({label})", statistics.median(waits))
    # raw chain for comparison: launches, then the GPU's tail
    tails = []
    for _ in range(5):
        t0 = ns()
        for _ in range(chain):
            launch(f, 1, 1, 1, 32, 1, 1, 0, h, params, 0)
        t1 = ns()
        record(ev_plain, h)
        while query(ev_plain)[0] != cu.CUresult.CUDA_SUCCESS:
            pass
        tails.append(((t1 - t0) / chain / 1e3, (ns() - t1) / 1e3))
    row("raw chain launches per op", statistics.median(t[0] for t in tails))
    row("  raw chain: GPU tail after the last launch, us (whole chain)", statistics.median(t[1] for t in tails))
    got = await x.to_host()
    print("checksum", got[0])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    a = ap.parse_args()
    print(trio_cuda.backend_name(), sys.version.split()[0])
    trio.run(main, a.n)
