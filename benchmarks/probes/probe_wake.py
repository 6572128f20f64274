"""How fast each wake-up mechanism sees the GPU finish, and what it costs in CPU (issue 33).

For the sleep kernel at several lengths, on one stream, each mechanism waits for the
kernel's event and notes when the waiting thread runs again; the figure is that time
from submission, less the median of spinning on the event (the floor), and the CPU
seconds the process used per second of waiting.

* ``spin``: ``cuEventQuery`` in a loop in the calling thread (the floor);
* ``host fn + sem``: a host function posting a POSIX semaphore after the event (on a
  side stream, as the notifier arms today), waited with ``sem_timedwait``;
* ``blocking sync``: an event made with ``CU_EVENT_BLOCKING_SYNC`` recorded after the
  kernel, waited with ``cuEventSynchronize``;
* ``sleep then spin``: ``time.sleep`` until 150 us before the spin median, then spin;
* ``trio: blocking sync in a thread``: a trio task parks; a thread waits the blocking
  event and reschedules the task through ``run_sync_soon``: the time until the task runs;
* ``trio: host fn (budget 0)``: today's slow path (``await op`` that parks at once).

    python benchmarks/probes/probe_wake.py [--reps 40]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import outcome
import trio
from cuda.bindings import driver as cu

import trio_cuda
from trio_cuda import _notifier, api, lowlevel
from trio_cuda._backends import backend
from trio_cuda.kernels import sleep


def _ok(res):  # type: ignore[no-untyped-def]
    err = res[0] if isinstance(res, tuple) else res
    assert int(err) == 0, res
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


async def measure(reps: int) -> None:
    dev = trio_cuda.current_device()
    drv = dev._driver
    c = await api.zeros((1,), np.int32)
    flags = cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
    bev = _ok(cu.cuEventCreate(flags))
    waker = backend().new_waker()
    token = trio.lowlevel.current_trio_token()
    stream = dev.policy.next_stream()

    async def launch(ns: int):  # type: ignore[no-untyped-def]
        sub = await lowlevel.submit(sleep(c.partition((1,)), ns), stream)
        return sub.event

    for _ in range(5):
        ev = await launch(100_000)
        while not ev.query():
            pass

    def thread_waits(ev_handle: object, task: trio.lowlevel.Task, woke: list[int]) -> None:
        drv._current()
        _ok(cu.cuEventSynchronize(ev_handle))
        woke.append(time.perf_counter_ns())
        token.run_sync_soon(trio.lowlevel.reschedule, task, outcome.Value(None))

    print(f"# probe_wake: {dev.name}, {reps} reps per figure; us over the spin median; CPU s/s")
    print("| kernel | mechanism | median (us) | p90 (us) | CPU s/s |")
    print("|---|---|---|---|---|")
    for ms in (0.05, 0.2, 1.0, 5.0):
        ns = int(ms * 1e6)
        results: dict[str, tuple[list[float], float]] = {}

        async def run(name: str, body) -> None:  # type: ignore[no-untyped-def]
            ts = []
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(reps):
                t0 = time.perf_counter_ns()
                t1 = await body()
                ts.append((t1 - t0) / 1e3)
            cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
            results[name] = (ts, cpu)  # noqa: B023 (run within the iteration)

        async def spin() -> int:
            ev = await launch(ns)  # noqa: B023 (run within the iteration)
            while not ev.query():
                pass
            return time.perf_counter_ns()

        async def host_fn() -> int:
            ev = await launch(ns)  # noqa: B023 (run within the iteration)
            dev.arm(ev, waker)
            waker.wait(1.0)
            return time.perf_counter_ns()

        async def blocking() -> int:
            await launch(ns)  # noqa: B023 (run within the iteration)
            _ok(cu.cuEventRecord(bev, stream.handle))
            _ok(cu.cuEventSynchronize(bev))
            return time.perf_counter_ns()

        async def trio_thread() -> int:
            await launch(ns)  # noqa: B023 (run within the iteration)
            _ok(cu.cuEventRecord(bev, stream.handle))
            woke: list[int] = []
            t = threading.Thread(target=thread_waits, args=(bev, trio.lowlevel.current_task(), woke))
            t.start()
            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
            now = time.perf_counter_ns()
            t.join()
            return now

        async def trio_budget0() -> int:
            op = sleep(c.partition((1,)), ns)  # noqa: B023 (run within the iteration)
            old = _notifier._budget_ns
            _notifier._budget_ns = 0
            try:
                await op
            finally:
                _notifier._budget_ns = old
            return time.perf_counter_ns()

        await run("spin", spin)
        floor = statistics.median(results["spin"][0])

        async def sleep_spin() -> int:
            ev = await launch(ns)  # noqa: B023 (run within the iteration)
            lead = floor - 150.0  # noqa: B023 (run within the iteration)
            if lead > 0:
                time.sleep(lead / 1e6)
            while not ev.query():
                pass
            return time.perf_counter_ns()

        for name, body in (
            ("host fn + sem", host_fn),
            ("blocking sync", blocking),
            ("sleep then spin", sleep_spin),
            ("trio: blocking sync in a thread", trio_thread),
            ("trio: host fn (budget 0)", trio_budget0),
        ):
            await run(name, body)
        for name, (ts, cpu) in results.items():
            q = statistics.quantiles(ts, n=10)
            extra = 0.0 if name == "spin" else floor
            print(f"| {ms} ms | {name} | {statistics.median(ts) - extra:.1f} | {q[-1] - extra:.1f} | {cpu:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    trio.run(measure, args.reps)


if __name__ == "__main__":
    main()
