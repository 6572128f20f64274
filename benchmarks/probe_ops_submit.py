"""The compiled direct submission of replayed ``ops`` calls (issue 12), on against off,
A/B in one process.

``trio_cuda/_hotpath.c``'s ``TensorOp._submit_now`` (a replayed op whose recipe is one
prepared launch or one prepared GEMM) against the Python method, switched with
``_ops._core._switch_hot_submit`` (the rest of the compiled path stays on). Alternating
rounds: ``ops.add``, ``ops.rms_norm`` and a GEMV (``ops.matmul``, ``--hidden`` square,
fp32) each awaited ``--n`` times, and the decode step of bench_decode.py awaited kernel
by kernel (3 tokens); PyTorch eager's step on the same shapes each round, where
installed. Medians per variant at the end, with the gain in us per await.

    python benchmarks/probe_ops_submit.py [--hidden 2048] [--layers 22] [--rounds 6] [--n 2000]

On the simulated device use small sizes (``--hidden 64 --layers 2 --n 200``): the
figures then mean nothing, the run checks that the probe works.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import trio

import trio_cuda
from trio_cuda import api, ops
from trio_cuda._ops import _core

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_decode import per_kernel_step_figure  # this folder (run as a script)
from probe_gemm_graphs import torch_eager_ms


async def main(hidden: int, layers: int, rounds: int, n: int) -> None:
    if _core._hot_submit is None:
        raise SystemExit("probe_ops_submit: the compiled hot path is not built (or TRIO_CUDA_HOTPATH=0)")
    dev = trio_cuda.current_device()
    dev.policy = trio_cuda.SingleStream(dev)
    decode = await per_kernel_step_figure(hidden, layers)
    x, g, z = await api.ones((hidden,)), await api.ones((hidden,)), await api.zeros((hidden,))
    w = await api.full((hidden, hidden), 1.0 / hidden)
    cases = {
        "ops.add": lambda: ops.add(x, z, out=z),
        "ops.rms_norm": lambda: ops.rms_norm(x, g, 1e-6, out=z),
        "ops.matmul (GEMV)": lambda: ops.matmul(w, x, out=z),
    }
    for make in cases.values():
        for _ in range(3):
            await make()
    res: dict[tuple[str, bool], list[float]] = {}
    eager: list[float] = []
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            _core._switch_hot_submit(on)
            await decode()
            line = [f"round {r} compiled {'on ' if on else 'off'}:"]
            for name, make in cases.items():
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    await make()
                us = (time.perf_counter_ns() - t0) / n / 1e3
                res.setdefault((name, on), []).append(us)
                line.append(f"{name} {us:6.2f} us")
            d = await decode()
            res.setdefault(("decode, ms/token", on), []).append(d)
            line.append(f"decode {d:.3f} ms/token")
            print(" | ".join(line), flush=True)
        e = torch_eager_ms(hidden, layers) if trio_cuda.backend_name() == "cuda" else None
        if e is not None:
            eager.append(e)
            print(f"round {r}: torch eager {e:.3f} ms/token", flush=True)
    _core._switch_hot_submit(True)
    print(f"\n{'median':22s} {'compiled':>9s} {'python':>9s} {'python/compiled':>16s}")
    for name in [*cases, "decode, ms/token"]:
        a, b = statistics.median(res[(name, True)]), statistics.median(res[(name, False)])
        print(f"{name:22s} {a:9.3f} {b:9.3f} {b / a:15.3f}x")
    if eager:
        e = statistics.median(eager)
        d = statistics.median(res[("decode, ms/token", True)])
        print(f"torch eager {e:.3f} ms/token; decode compiled / eager {d / e:.3f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    trio.run(main, args.hidden, args.layers, args.rounds, args.n)
