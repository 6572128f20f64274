"""Two host-path switches of issue 12, A/B in one process: the compiled direct
submission of replayed ``ops`` calls, and the spin after an await's first poll.

``--switch submit`` (default): ``trio_cuda/_hotpath.c``'s ``TensorOp._submit_now`` (a
replayed op whose recipe is one prepared launch or one prepared GEMM) against the Python
method, switched with ``_ops._core._switch_hot_submit`` (the rest of the compiled path
stays on). ``--switch gemm_replay``: the compiled replay of a kept GEMM graph
(``gemm_replay``) against the backend's Python branch (``CudaDevice.matmul``), the latter
by a wrapper of the backend's method set on the driver object, which the compiled path
hands to the Python. ``--switch spin``: the spin time after an await's first poll found its work
pending (``_notifier._spin_ns``, what ``TRIO_CUDA_SPIN_US`` sets), each of
``--spins`` (us; 0 is no spin). Rounds in alternating order: ``ops.add``,
``ops.rms_norm`` and a GEMV (``ops.matmul``, ``--hidden`` square, fp32) each awaited
``--n`` times, and the decode step of bench_decode.py awaited kernel by kernel (3
tokens); PyTorch eager's step on the same shapes each round, where installed. Medians
per variant at the end, against the first variant.

    python benchmarks/probes/probe_ops_submit.py [--switch submit|spin|gemm_replay] [--spins 0,10,20,50]
        [--hidden 2048] [--layers 22] [--rounds 6] [--n 2000]

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
from trio_cuda import _hotpath, _notifier, api, ops
from trio_cuda._ops import _core

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench_decode import per_kernel_step_figure  # benchmarks/ and this folder (run as a script)
from probe_gemm_graphs import torch_eager_ms


async def main(switch: str, spins: list[float], hidden: int, layers: int, rounds: int, n: int) -> None:
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
    drv = dev._driver
    own_matmul = type(drv).matmul

    def python_matmul(*args: object) -> None:
        own_matmul(drv, *args)

    if switch in ("submit", "gemm_replay"):
        variants = ["compiled", "python"]
    else:
        variants = [f"spin {us:g} us" for us in spins]
    spin_was = _notifier._spin_ns

    def use(i: int) -> None:
        if switch == "submit":
            _core._switch_hot_submit(i == 0)
        elif switch == "gemm_replay":
            if i == 0:
                vars(drv).pop("matmul", None)
            else:
                drv.matmul = python_matmul
        else:
            _notifier._spin_ns = int(spins[i] * 1000)

    res: dict[tuple[str, str], list[float]] = {}
    eager: list[float] = []
    for r in range(rounds):
        order = range(len(variants)) if r % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            use(i)
            await decode()
            c0 = _hotpath.counters()
            line = [f"round {r} {variants[i]}:"]
            for name, make in cases.items():
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    await make()
                us = (time.perf_counter_ns() - t0) / n / 1e3
                res.setdefault((name, variants[i]), []).append(us)
                line.append(f"{name} {us:6.2f} us")
            d = await decode()
            res.setdefault(("decode, ms/token", variants[i]), []).append(d)
            c1 = _hotpath.counters()
            line.append(f"decode {d:.3f} ms/token")
            line.append(
                f"(rest {c1['awaits_rest'] - c0['awaits_rest']}, spins {c1['spins'] - c0['spins']}, done {c1['spins_done'] - c0['spins_done']}, "
                f"GEMM replays in C {c1['gemm_replays'] - c0['gemm_replays']})"
            )
            print(" | ".join(line), flush=True)
        e = torch_eager_ms(hidden, layers) if trio_cuda.backend_name() == "cuda" else None
        if e is not None:
            eager.append(e)
            print(f"round {r}: torch eager {e:.3f} ms/token", flush=True)
    _core._switch_hot_submit(True)
    _notifier._spin_ns = spin_was
    vars(drv).pop("matmul", None)
    print(f"\n{'median':22s}" + "".join(f" {v:>16s}" for v in variants) + f"  (ratio to {variants[0]})")
    for name in [*cases, "decode, ms/token"]:
        med = [statistics.median(res[(name, v)]) for v in variants]
        print(f"{name:22s}" + "".join(f" {m:9.3f} ({m / med[0]:.3f})" for m in med))
    if eager:
        e = statistics.median(eager)
        print(
            f"torch eager {e:.3f} ms/token; decode / eager: "
            + ", ".join(f"{v} {statistics.median(res[('decode, ms/token', v)]) / e:.3f}x" for v in variants)
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=["submit", "spin", "gemm_replay"], default="submit")
    ap.add_argument("--spins", default="0,10,20,50", help="spin times to compare, us (--switch spin)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    spins = [float(v) for v in args.spins.split(",")]
    trio.run(main, args.switch, spins, args.hidden, args.layers, args.rounds, args.n)
