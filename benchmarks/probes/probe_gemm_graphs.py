"""Replayed GEMMs as graphs (issue 12): the CUDA backend's graph replay of a replayed
recipe's GEMM, on against off, A/B in one process, and what it replaces.

Parts (``--part``):

* ``ab`` (default): alternating rounds with the replay on and off (the backend's
  ``Gemms.replay``, a test hook): a GEMV (``--hidden`` square,
  fp32) awaited 2000 times, and the decode step of bench_decode.py awaited kernel by
  kernel (3 tokens); PyTorch eager's step on the same shapes each round, where
  installed. Medians per variant at the end.
* ``calls``: the GEMV's host cost per call, enqueue only and with a sync after each:
  cuBLASLt's call (nvmath), its captured graph through ``cuGraphLaunch``, and the
  captured kernel node launched with ``cuLaunchKernel`` (the driver refuses it: see
  benchmarks/results/host-gemm-graphs-2026-12-01.md at bdba8f3).
* ``kinds``: the decode step per kernel kind, awaited through ops and with the
  hand-written kernels, us per await and to make the op.

Parts ab and calls are CUDA only (the simulated device has no graphs); ``--hidden 64
--layers 2`` for a quick look.

    python benchmarks/probes/probe_gemm_graphs.py [--part ab|calls|kinds] [--hidden 2048] [--layers 22]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from bench_decode import per_kernel_ops, per_kernel_step_figure, torch_steps  # benchmarks/ and examples/ (as a script)
from cuda_graphs_deviceop import EPS, build

from trio_cuda.kernels import MATVEC_ROWS, add, matvec, rms_norm

_torch_steps: dict[tuple[int, int], Any] = {}


def torch_eager_ms(hidden: int, layers: int, sync_each: bool = False) -> float | None:
    """PyTorch eager's decode step (bench_decode.TorchSteps, built once per shape), ms per
    token over 10 tokens; ``sync_each``: with a ``torch.cuda.synchronize()`` after every op."""
    if (hidden, layers) not in _torch_steps:
        _torch_steps[hidden, layers] = torch_steps(hidden, layers)[0]
    steps = _torch_steps[hidden, layers]
    return None if steps is None else steps.ms_per_token(10, sync_each)


async def part_ab(hidden: int, layers: int, rounds: int) -> None:
    dev = trio_cuda.current_device()
    dev.policy = trio_cuda.SingleStream(dev)
    gm = dev._driver._gemms  # type: ignore[attr-defined]
    decode = await per_kernel_step_figure(hidden, layers)
    w, x, y = await api.ones((hidden, hidden)), await api.ones((hidden,)), await api.zeros((hidden,))
    for _ in range(3):
        await ops.matmul(w, x, out=y)
    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            gm.replay = on
            await decode()
            t0 = time.perf_counter_ns()
            for _ in range(2000):
                await ops.matmul(w, x, out=y)
            gemv = (time.perf_counter_ns() - t0) / 2000 / 1e3
            d = await decode()
            res[on].append((gemv, d))
            print(
                f"round {r} graphs {'on ' if on else 'off'}: GEMV await {gemv:6.2f} us; decode await per kernel {d:.3f} ms/token"
            )
        eager = torch_eager_ms(hidden, layers)
        if eager is not None:
            print(f"round {r}: torch eager {eager:.3f} ms/token")
    gm.replay = True
    for on in (True, False):
        g = sorted(v[0] for v in res[on])
        d = sorted(v[1] for v in res[on])
        print(f"graphs {'on ' if on else 'off'}: GEMV median {g[len(g) // 2]:.2f} us, decode median {d[len(d) // 2]:.3f} ms")
    print("captures", gm.captures, "replays", gm.replays)


def part_calls(hidden: int, n: int = 3000) -> None:
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cudafast
    from trio_cuda._backends._cuda import fast_path

    def chk(r: Any) -> Any:
        if r[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(r[0]))
        return r[1] if len(r) == 2 else r[1:]

    dev = trio_cuda.current_device()
    rng = np.random.default_rng(0)
    hw = (rng.standard_normal((hidden, hidden)) / hidden**0.5).astype(np.float32)
    hx = rng.standard_normal(hidden).astype(np.float32)
    w, x, y = api.from_host(hw).sync(), api.from_host(hx).sync(), api.zeros((hidden,)).sync()
    for _ in range(3):
        ops.matmul(w, x, out=y).sync()
    want = hw.astype(np.float64) @ hx
    desc = ops.matmul(w, x, out=y)._hit.direct.specs[0][1]  # type: ignore[attr-defined]
    plan = dev._driver._gemms.plan(desc, True)  # type: ignore[attr-defined]
    s = chk(cu.cuStreamCreate(1))
    sh = int(s)
    a, b, d = w.ptr, x.ptr, y.ptr

    def check(label: str) -> None:
        err = float(np.max(np.abs(y.to_host().sync() - want)))
        print(f"  {label}: max error {err:.2e}")

    def timed(label: str, fn: Any) -> None:
        for _ in range(3):
            chk(cu.cuCtxSynchronize())
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            t1 = time.perf_counter_ns()
            chk(cu.cuStreamSynchronize(s))
            t2 = time.perf_counter_ns()
            for _ in range(n):
                fn()
                cu.cuStreamSynchronize(s)
            t3 = time.perf_counter_ns()
            print(f"{label}: enqueue {(t1 - t0) / n / 1e3:.2f} us/call; with a sync after each {(t3 - t2) / n / 1e3:.2f} us")

    plan.run(a, b, d, 0, 0, 0, sh)
    chk(cu.cuStreamSynchronize(s))
    check("cuBLASLt")
    timed("cuBLASLt (nvmath)", lambda: plan.run(a, b, d, 0, 0, 0, sh))
    chk(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    plan.run(a, b, d, 0, 0, 0, sh)
    graph = chk(cu.cuStreamEndCapture(s))
    count = cu.cuGraphGetNodes(graph, 0)[-1]
    nodes = cu.cuGraphGetNodes(graph, count)[1]
    print("captured nodes:", [str(chk(cu.cuGraphNodeGetType(nd))) for nd in nodes])
    exec_ = chk(cu.cuGraphInstantiate(graph, 0))
    chk(cu.cuGraphLaunch(exec_, s))
    chk(cu.cuStreamSynchronize(s))
    check("graph")
    timed("cuGraphLaunch (cuda.bindings)", lambda: cu.cuGraphLaunch(exec_, s))
    fast = fast_path()
    if len(nodes) == 1 and fast is not None:
        p = chk(cu.cuGraphKernelNodeGetParams(nodes[0]))
        func = int(p.func.getPtr()) if hasattr(p.func, "getPtr") else int(p.func)
        args = (fast[0], func, p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ)
        rc = _cudafast.launch(*args, p.sharedMemBytes, sh, int(p.kernelParams))
        print(f"cuLaunchKernel of the captured kernel: CUresult {rc}")
    cu.cuGraphExecDestroy(exec_)
    cu.cuGraphDestroy(graph)
    cu.cuStreamDestroy(s)


async def part_kinds(hidden: int, layers: int, tokens: int = 30) -> None:
    names = ["rms_norm", "GEMV (Q)", "GEMV (O)", "add"]
    m = await build(hidden, layers)
    dev = trio_cuda.current_device()
    dev.policy = trio_cuda.SingleStream(dev)
    via_ops = per_kernel_ops(m)
    h1, hn1 = m.h.reshape(hidden), m.hn.reshape(hidden)
    hand: list[Any] = []
    for w_norm, wq, wo in m.weights:
        hand.append(lambda w_norm=w_norm: rms_norm(m.hn.partition((1, hidden)), m.h, w_norm, EPS))
        hand.append(lambda wq=wq: matvec(m.q.partition((MATVEC_ROWS,)), wq, hn1))
        hand.append(lambda wo=wo: matvec(m.o.partition((MATVEC_ROWS,)), wo, m.q))
        hand.append(lambda: add(h1.partition((min(hidden, 256),)), h1, m.o))
    for f in via_ops + hand:
        await f()
    for r in range(3):
        for label, seq in (("ops", via_ops), ("hand", hand)):
            t0 = time.perf_counter_ns()
            for _ in range(tokens):
                for f in seq:
                    await f()
            token = (time.perf_counter_ns() - t0) / tokens / 1e6
            line = [f"round {r} {label}: token {token:.3f} ms"]
            for k in range(4):
                fs = seq[k::4]
                t0 = time.perf_counter_ns()
                for _ in range(tokens):
                    for f in fs:
                        await f()
                t1 = time.perf_counter_ns()
                for _ in range(tokens):
                    for f in fs:
                        f()
                t2 = time.perf_counter_ns()
                per = tokens * len(fs)
                line.append(f"{names[k]} {(t1 - t0) / per / 1e3:.1f} us (make {(t2 - t1) / per / 1e3:.1f})")
            print(" | ".join(line))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--part", choices=["ab", "calls", "kinds"], default="ab")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if args.part != "kinds" and trio_cuda.backend_name() != "cuda":
        raise SystemExit("probe_gemm_graphs.py: parts ab and calls are CUDA only (the simulated device has no graphs)")
    if args.part == "ab":
        trio.run(part_ab, args.hidden, args.layers, args.rounds)
    elif args.part == "calls":
        part_calls(args.hidden)
    else:
        trio.run(part_kinds, args.hidden, args.layers)


if __name__ == "__main__":
    main()
