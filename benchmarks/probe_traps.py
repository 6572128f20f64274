"""``await op`` yielding trio's trap itself, or through trio's checkpoint functions:
A/B in one process (issue 12; see trio_cuda/_traps.py and docs/runtime.md).

The figures of probe_poll.py (the tiny op round trip, awaits/s of 16 and 256 tasks),
measured for both variants in short alternating blocks, with each variant's ratio to
trio's functions within the same cycle. Either backend (on the simulated device the
kernels run in numba's simulator, so only the ratios mean anything).

    python benchmarks/probe_traps.py [--cycles 30]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import trio

from trio_cuda import _traps, api

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from probe_poll import paired, standard_figures, tasks_rate  # this folder (run as a script)


async def main(cycles: int) -> None:
    if not _traps.available:
        raise SystemExit(f"trio {trio.__version__} lacks what the trap path reads: nothing to compare")
    p = (await api.zeros((32,))).partition((32,))
    many = {count: [(await api.zeros((32,))).partition((32,)) for _ in range(count)] for count in (16, 256)}

    def use(on: bool) -> None:
        _traps.on = on

    async def warm_up() -> None:
        await tasks_rate(many[256], 4)

    variants = [("trio's checkpoint functions", lambda: use(False)), ("trio's trap, yielded", lambda: use(True))]
    await paired(standard_figures(p, many), variants, cycles, warm_up)
    use(True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=30)
    args = ap.parse_args()
    trio.run(main, args.cycles)
