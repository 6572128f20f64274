"""This session's host-path changes to ``await``, A/B in one process (issue 12).

Variants, alternated in short blocks (a lent machine's host changes speed between
processes, see benchmarks/results/host-direct-2026-11-30.md at bdba8f3):

* ``before``: awaits through trio's checkpoint functions, and a replayed ``ops``
  GEMM run on a lane each time (the code before this session);
* ``traps``: awaits yield trio's trap themselves (trio_cuda/_traps.py);
* ``traps + prepared GEMM``: also the GEMM of a replayed ``ops.matmul`` prepared once
  (its aligned descriptor and addresses; _core.prepared_step): the code now.

Figures: the tiny op round trip (``await inc(p)``, median of 200) and awaits/s of 16
and 256 tasks, as in probe_poll.py; the round trip of a GEMV (``ops.matmul`` of a
2048 x 2048 float32 matrix and a vector, median of 200); and the decode step of
bench_decode.py awaited per kernel on one stream, as there (88 awaits: ops.rms_norm,
two ops.matmul GEMVs and the add kernel per layer; ms per token, over 3 tokens). Each variant's ratio to ``before`` within the
same cycle is printed (> 1 is better). Either backend (on the simulated device the
kernels run in numba's simulator, so only the ratios mean anything; use --hidden 16
--layers 2 there).

    python benchmarks/probes/probe_await_ab.py [--cycles 20] [--hidden 2048] [--layers 22]
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from trio_cuda import _traps, api, ops
from trio_cuda._ops import _core

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from bench_decode import per_kernel_step_figure  # benchmarks/, this folder and examples/ (run as a script)
from probe_completion import round_trip_us
from probe_poll import decode_ab_main, paired, standard_figures, tasks_rate


def _prepared_gemms(on: bool) -> None:
    """Prepared GEMMs on, or every recipe's one step run on a lane (as before)."""
    _core.prepare_steps = on
    for recipe in _core._cache.values():
        st = recipe.direct
        if st is not None and st.kernel is None:
            st.ready = None  # prepared again at the next direct submission, if on


async def main(cycles: int, hidden: int, layers: int) -> None:
    if not _traps.available:
        raise SystemExit("this trio lacks what the trap path reads: nothing to compare")
    p = (await api.zeros((32,))).partition((32,))
    many = {count: [(await api.zeros((32,))).partition((32,)) for _ in range(count)] for count in (16, 256)}
    w, x, y = await api.ones((hidden, hidden)), await api.ones((hidden,)), await api.zeros((hidden,))
    decode_ms = await per_kernel_step_figure(hidden, layers)

    figures = standard_figures(p, many)
    figures["GEMV round trip, us"] = lambda: round_trip_us(lambda: ops.matmul(w, x, out=y), 200)
    figures["decode step, await per kernel, ms"] = decode_ms

    async def warm_up() -> None:
        await tasks_rate(many[256], 4)
        await decode_ms()

    def use(traps: bool, gemm: bool) -> None:
        _traps.on = traps
        _prepared_gemms(gemm)

    variants: list[tuple[str, Any]] = [
        ("before", lambda: use(False, False)),
        ("traps", lambda: use(True, False)),
        ("traps + prepared GEMM", lambda: use(True, True)),
    ]
    await paired(figures, variants, cycles, warm_up)
    use(True, True)


if __name__ == "__main__":
    decode_ab_main(main, __doc__)
