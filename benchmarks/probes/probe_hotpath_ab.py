"""The compiled hot path (trio_cuda/_hotpath.c) against the Python methods it replaces,
A/B in one process (issue 12).

Variants, alternated in short blocks (a lent machine's host changes speed between
processes, see benchmarks/results/host-direct-2026-11-30.md at bdba8f3):

* ``python``: ``_Launch._submit_now``, ``Device.poll``, ``_Launch._plan`` and the
  plan's walk and step loop in Python (as with ``TRIO_CUDA_HOTPATH=0``);
* ``compiled, Python await``: all of these in C, ``DeviceOp.__await__`` the Python
  generator (_submit.await_op);
* ``compiled``: all in C, the await too, with the launch, record and query made
  straight through the driver's entry points where the backend offers them (CUDA
  with its fast path).

Figures: the tiny op round trip (``await inc(p)``, median of 200); awaits of
``inc(p)`` in a loop, the op made each time (us per await, the "sync after every op"
figure of bench_host); awaits/s of 16 and 256 tasks, as in probe_poll.py; and the
decode step of bench_decode.py awaited per kernel on one stream (88 awaits: ops and
the add kernel; ms per token over 3 tokens); a dependent chain of 500 launches
awaited once (us per op, bench_host's chain figure: the general planner's walk and
steps). Each variant's ratio to ``python`` within
the same cycle is printed (> 1 is better). Either backend (on the simulated device use
--hidden 16 --layers 2; only the ratios mean anything there).

    python benchmarks/probes/probe_hotpath_ab.py [--cycles 20] [--hidden 2048] [--layers 22]
"""

from __future__ import annotations

import pathlib
import sys
import time
from typing import Any

from trio_cuda import _kernel, api
from trio_cuda._op import DeviceOp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from bench_decode import per_kernel_step_figure  # benchmarks/, this folder and examples/ (run as a script)
from bench_runtime import inc
from probe_poll import decode_ab_main, paired, standard_figures, tasks_rate


async def main(cycles: int, hidden: int, layers: int) -> None:
    if not _kernel.use_hotpath(True):
        raise SystemExit("trio_cuda._hotpath is not built (or TRIO_CUDA_HOTPATH=0): nothing to compare")
    p = (await api.zeros((32,))).partition((32,))
    many = {count: [(await api.zeros((32,))).partition((32,)) for _ in range(count)] for count in (16, 256)}
    decode_ms = await per_kernel_step_figure(hidden, layers)

    async def sync_each_us() -> float:
        """us per ``await inc(p)`` in a loop of 500 (the op made each time)."""
        t0 = time.perf_counter_ns()
        for _ in range(500):
            await inc(p)
        return (time.perf_counter_ns() - t0) / 500e3

    async def chain_us() -> float:
        """us per op of a dependent chain of 500 ``inc`` launches awaited once (built
        beforehand, as bench_host's chain figure)."""
        op = inc(p)
        for _ in range(499):
            op = inc(op.first())
        t0 = time.perf_counter_ns()
        await op
        return (time.perf_counter_ns() - t0) / 500e3

    figures = standard_figures(p, many)
    figures["await per op in a loop, us"] = sync_each_us
    figures["dependent chain awaited once, us/op"] = chain_us
    figures["decode step, await per kernel, ms"] = decode_ms

    async def warm_up() -> None:
        await tasks_rate(many[256], 4)
        await decode_ms()

    def python_await() -> None:
        _kernel.use_hotpath(True)
        DeviceOp.__await__ = _kernel._await_py  # type: ignore[method-assign]

    variants: list[tuple[str, Any]] = [
        ("python", lambda: _kernel.use_hotpath(False)),
        ("compiled, Python await", python_await),
        ("compiled", lambda: _kernel.use_hotpath(True)),
    ]
    await paired(figures, variants, cycles, warm_up)
    _kernel.use_hotpath(True)
    from trio_cuda import _hotpath

    print()
    print("compiled hot path counters (whole run):", _hotpath.counters())


if __name__ == "__main__":
    decode_ab_main(main, __doc__)
