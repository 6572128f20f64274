"""Launch variants of the fused AdamW step (issue 35): each a replayed graph of the whole step over bench_optim's parameters, against torch.optim.AdamW(fused=True) in the same process.

A variant sets the module constants of ``trio_cuda._ops._optim``: ``TENSORS_PER_LAUNCH``
(K, tensors per multi-tensor launch; K=1 is one launch per tensor, as before), ``BLOCK``
(threads per block), ``UNROLL`` (elements per thread per pass, their loads issued
together) and ``CHUNKS`` (passes per block: a block updates BLOCK * UNROLL * CHUNKS
elements of one tensor). For each: one eager step from the same data, checked against
PyTorch's first step (numpy's formula without PyTorch) and its launches counted, then the
step and the step count's increment captured as one graph. Then ``--rounds`` rounds, each
timing ``--reps`` back-to-back replays of every variant and ``--reps`` steps of PyTorch's
fused AdamW, in turn (median over rounds). The table: ms/step, GB/s of the 28 bytes per
float32 parameter a step must move, and the ratio to PyTorch (the target is >= 0.90).
Pick the best and set it as the defaults in ``trio_cuda/_ops/_optim.py``.

Usage (about a minute on an H200, most of it compiling each variant's kernels once):
``python3 benchmarks/probes/probe_optim.py [--rounds 5] [--reps 20] [--variants NAME,...]``;
``--smoke`` runs tiny shapes on any backend (the figures then mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import trio_cuda
from benchmarks.bench_optim import BETAS, EPS, LR, SMOKE, TARGET, WD, adamw_ref, shapes, torch_setup
from trio_cuda import api, lowlevel, ops
from trio_cuda._ops import _optim

# name: (TENSORS_PER_LAUNCH, BLOCK, UNROLL, CHUNKS); one constant changed from "default" each
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "per-tensor": (1, 256, 4, 1),
    "default": (_optim.TENSORS_PER_LAUNCH, _optim.BLOCK, _optim.UNROLL, _optim.CHUNKS),
    "K4": (4, 256, 4, 4),
    "K12": (12, 256, 4, 4),
    "chunks1": (8, 256, 4, 1),
    "chunks16": (8, 256, 4, 16),
    "block128": (8, 128, 4, 8),
    "block512": (8, 512, 4, 2),
    "unroll8": (8, 256, 8, 2),
}


def set_variant(v: tuple[int, int, int, int]) -> None:
    _optim.TENSORS_PER_LAUNCH, _optim.BLOCK, _optim.UNROLL, _optim.CHUNKS = v


async def trio_side(
    sh: list[tuple[int, ...]],
    host: list[np.ndarray],
    grads: list[np.ndarray],
    names: list[str],
    want: list[np.ndarray],
    args: Any,
) -> dict[str, Any]:
    ps = [await api.from_host(a) for a in host]
    start = [await api.from_host(a) for a in host]  # each variant's check starts from here
    gs = [await api.from_host(g) for g in grads]
    zeros = [await api.zeros(s) for s in sh]
    ms = [await api.zeros(s) for s in sh]
    vs = [await api.zeros(s) for s in sh]
    lr = await api.from_host(np.array(LR, np.float32))
    step = await api.from_host(np.array(1, np.int64))
    dev = trio_cuda.device(0)
    stream = dev.create_stream()
    graphs: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    saved = (_optim.TENSORS_PER_LAUNCH, _optim.BLOCK, _optim.UNROLL, _optim.CHUNKS)
    try:
        for name in names:
            set_variant(VARIANTS[name])
            t0 = time.perf_counter()
            for dst, src in (*zip(ps, start, strict=True), *zip(ms, zeros, strict=True), *zip(vs, zeros, strict=True)):
                await api.memcpy(dst, src)
            await api.memcpy(step, np.array(1, np.int64))
            before = dev.statistics().launches
            await ops.adamw_step(ps, gs, ms, vs, lr=lr, step=step, betas=BETAS, eps=EPS, weight_decay=WD)
            launches = dev.statistics().launches - before
            got = [await ps[i].to_host() for i in range(len(want))]
            err = max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))
            right = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want, strict=True))
            graphs[name] = (
                ops.add(step, 1, out=step)
                .then(lambda s: ops.adamw_step(ps, gs, ms, vs, lr=lr, step=s, betas=BETAS, eps=EPS, weight_decay=WD))
                .graph()
            )
            info[name] = {
                "launches": launches,
                "max_error": err,
                "right": right,
                "setup_s": time.perf_counter() - t0,
                "times": [],
            }
    finally:
        set_variant(saved)

    async def timed(submit: Any) -> float:
        for _ in range(2):
            await (await lowlevel.submit(submit(), stream)).wait()
        t0 = time.perf_counter()
        last = None
        for _ in range(args.reps):
            last = await lowlevel.submit(submit(), stream)
        assert last is not None
        await last.wait()
        return (time.perf_counter() - t0) / args.reps

    for r in range(args.rounds):
        if args.torch is not None:
            info.setdefault("torch fused", {"times": []})["times"].append(args.torch(args.reps))
        for name in names if r % 2 == 0 else names[::-1]:
            info[name]["times"].append(await timed(graphs[name].launch))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for the simulated device")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    if args.smoke:
        args.d, args.layers, args.vocab, args.reps, args.rounds = SMOKE["d"], SMOKE["layers"], SMOKE["vocab"], 2, 2
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        ap.error(f"unknown variants {unknown} (known: {', '.join(VARIANTS)})")
    t_start = time.perf_counter()
    sh = shapes(args.d, args.layers, args.vocab)
    n = sum(int(np.prod(s)) for s in sh)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s, np.float32) for s in sh]
    grads = [rng.standard_normal(s, np.float32) for s in sh]
    args.torch = None
    if trio_cuda.backend_name() == "cuda" and importlib.util.find_spec("torch") is not None:
        want, args.torch = torch_setup(host, grads)
    else:
        want = [adamw_ref(host[i].astype(np.float64), grads[i].astype(np.float64), 0.0, 0.0, 1) for i in range(3)]
    info = trio.run(trio_side, sh, host, grads, names, want, args)
    base = statistics.median(info["torch fused"]["times"]) if "torch fused" in info else None
    print(f"# AdamW step variants, {n / 1e6:.1f}M float32 parameters in {len(sh)} tensors ({trio_cuda.backend_name()})")
    print()
    print(
        f"d {args.d}, layers {args.layers}, vocab {args.vocab}; median of {args.rounds} rounds of {args.reps} replays; target >= {TARGET}"
    )
    print()
    print("| variant | K | block | unroll | chunks | launches/step | setup s | max error | ms/step | GB/s | vs torch fused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    wrong = []
    for name in names:
        k, b, u, c = VARIANTS[name]
        i = info[name]
        t = statistics.median(i["times"])
        ratio = f"{base / t:.3f}" if base else "n/a"
        print(
            f"| {name} | {k} | {b} | {u} | {c} | {i['launches']} | {i['setup_s']:.1f} | {i['max_error']:.2g} | "
            f"{t * 1e3:.3f} | {28 * n / t / 1e9:.1f} | {ratio} |"
        )
        if not i["right"]:
            wrong.append(name)
    if base:
        print(f"| torch fused | | | | | | | | {base * 1e3:.3f} | {28 * n / base / 1e9:.1f} | 1.000 |")
    print()
    print(f"checked: one step of each variant against {'PyTorch' if base else 'numpy'}", end="")
    print(f"; PROBLEM: {', '.join(wrong)} wrong" if wrong else "; every variant right", end="")
    print(f"; {time.perf_counter() - t_start:.0f} s in all")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
