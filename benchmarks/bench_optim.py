"""A fused AdamW step over a 100M-parameter model against torch.optim.AdamW(fused=True) (issue 35).

The parameters are a transformer's list of tensors (``--vocab`` x ``--d`` embedding, then
``--layers`` blocks of QKV, output projection, MLP up and down with their biases and two
layer norms: 105M float32 parameters by default), each with a gradient and two zeroed
float32 moments. Both sides update the same shapes, their gradients fixed, ``--reps``
steps back to back after a warm-up, timed from the first submission to the end of the
last (GPU throughput with the host's work queued ahead):

* ``trio eager``: ``ops.adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr=lr, step=step)``
  with ``lr`` and ``step`` 0-d tensors, multi-tensor launches (8 parameters each), submitted per step;
* ``trio graph``: the same step and the step count's increment (``ops.add(step, 1,
  out=step)``) captured once, the graph launched per step (lr and step are read from
  their tensors at each replay);
* ``torch fused``: ``torch.optim.AdamW(params, lr, fused=True).step()`` (its multi-tensor
  kernels, the step count kept on the device as ``capturable`` would not need).

Figure: GB/s, counting the bytes each step must move (read parameter, gradient and both
moments, write parameter and moments: 28 bytes per float32 parameter). The ratio is
trio's figure over torch's; the target is >= 0.90 for the graph. Before timing, one step
from the same data on both sides is compared (without PyTorch, against numpy's PyTorch
formula).

Usage: ``python benchmarks/bench_optim.py [--reps 50] [--out DIR]``; ``--smoke`` runs tiny
shapes on any backend (the simulated device: the figures mean nothing). Writes
``optim-<date>.md`` and ``.json`` under ``--out`` (default benchmarks/results). Exits 1 if
a result was wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import trio_cuda
from benchmarks import _results
from trio_cuda import api, lowlevel, ops

TARGET = 0.90
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
SMOKE = {"d": 32, "layers": 2, "vocab": 64, "reps": 3}


def shapes(d: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(layers):
        out += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [*out, (d,), (d,)]


def adamw_ref(p: Any, g: Any, m: Any, v: Any, step: int) -> Any:
    """PyTorch's AdamW update (decoupled weight decay, bias correction), float64."""
    b1, b2 = BETAS
    p = p * (1 - LR * WD)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - LR / (1 - b1**step) * m / (np.sqrt(v) / np.sqrt(1 - b2**step) + EPS)


async def trio_side(sh: list[tuple[int, ...]], reps: int, host: list[np.ndarray], grads: list[np.ndarray]) -> dict[str, Any]:
    ps = [await api.from_host(a) for a in host]
    gs = [await api.from_host(g) for g in grads]
    ms = [await api.zeros(s) for s in sh]
    vs = [await api.zeros(s) for s in sh]
    lr = await api.from_host(np.array(LR, np.float32))
    step = await api.from_host(np.array(1, np.int64))

    def make() -> Any:
        return ops.adamw_step(ps, gs, ms, vs, lr=lr, step=step, betas=BETAS, eps=EPS, weight_decay=WD)

    await make()  # the check: one step from the data given
    first = [await p.to_host() for p in ps[:3]]
    stream = trio_cuda.device(0).create_stream()

    async def timed(submit: Any) -> float:
        for _ in range(2):
            await (await lowlevel.submit(submit(), stream)).wait()
        t0 = time.perf_counter()
        last = None
        for _ in range(reps):
            last = await lowlevel.submit(submit(), stream)
        assert last is not None
        await last.wait()
        return (time.perf_counter() - t0) / reps

    eager = await timed(make)
    graph = (
        ops.add(step, 1, out=step)
        .then(lambda s: ops.adamw_step(ps, gs, ms, vs, lr=lr, step=s, betas=BETAS, eps=EPS, weight_decay=WD))
        .graph()
    )
    replay = await timed(graph.launch)
    return {"first": first, "trio eager": eager, "trio graph": replay, "steps after": await step.item()}


def torch_setup(host: list[np.ndarray], grads: list[np.ndarray]) -> tuple[list[np.ndarray], Any]:
    """PyTorch's first step from the data (the check of every variant) and a timer of its
    fused steps."""
    import torch

    params = [torch.nn.Parameter(torch.from_numpy(a).cuda()) for a in host]
    for p, g in zip(params, grads, strict=True):
        p.grad = torch.from_numpy(g).cuda()
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    opt.step()
    first = [p.detach().cpu().numpy() for p in params[:3]]

    def timer(reps: int) -> float:
        for _ in range(2):
            opt.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    return first, timer


def torch_side(sh: list[tuple[int, ...]], reps: int, host: list[np.ndarray], grads: list[np.ndarray]) -> dict[str, Any]:
    first, timer = torch_setup(host, grads)
    return {"first": first, "torch fused": timer(reps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for the simulated device")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    sh = shapes(args.d, args.layers, args.vocab)
    n = sum(int(np.prod(s)) for s in sh)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s, np.float32) for s in sh]
    grads = [rng.standard_normal(s, np.float32) for s in sh]
    res = trio.run(trio_side, sh, args.reps, host, grads)
    have_torch = trio_cuda.backend_name() == "cuda" and importlib.util.find_spec("torch") is not None
    peer = torch_side(sh, args.reps, host, grads) if have_torch else None
    wrong = []
    for i in range(3):  # one step from the same data: trio against torch (or numpy's formula)
        want = peer["first"][i] if peer else adamw_ref(host[i].astype(np.float64), grads[i].astype(np.float64), 0.0, 0.0, 1)
        if not np.allclose(res["first"][i], want, rtol=1e-5, atol=1e-6):
            wrong.append(f"param {i}: max error {np.abs(res['first'][i] - want).max():.3g}")
    # the graph's steps counted themselves: 1 (eager) then 2 warm-ups + reps replays
    if res["steps after"] != 1 + 2 + args.reps:
        wrong.append(f"the captured step count is {res['steps after']}, not {3 + args.reps}")
    nbytes = 28 * n
    lines = [
        f"# Fused AdamW step, {n / 1e6:.1f}M float32 parameters in {len(sh)} tensors ({trio_cuda.backend_name()})",
        "",
        f"d {args.d}, layers {args.layers}, vocab {args.vocab}; {args.reps} steps after a warm-up; "
        f"GB/s of the 28 bytes per parameter each step must move; target trio graph / torch fused >= {TARGET}",
        "",
        "| case | ms/step | GB/s | vs torch fused |",
        "|---|---|---|---|",
    ]
    record: dict[str, Any] = {"params": n, "tensors": len(sh), "reps": args.reps, "target": TARGET, "cases": {}}
    base = peer["torch fused"] if peer else None
    for name, t in [
        ("trio eager", res["trio eager"]),
        ("trio graph", res["trio graph"]),
        *([("torch fused", base)] if base else []),
    ]:
        ratio = f"{base / t:.3f}" if base else "n/a"
        lines.append(f"| {name} | {t * 1e3:.3f} | {nbytes / t / 1e9:.1f} | {ratio} |")
        record["cases"][name] = {"s_per_step": t, "GB_per_s": nbytes / t / 1e9, "ratio": base / t if base else None}
    if not peer:
        lines += ["", "PyTorch not measured (needs CUDA and torch): checked against numpy's formula of PyTorch's AdamW."]
    lines += [
        "",
        "PROBLEM: " + "; ".join(wrong) if wrong else "every result checked (one step from the same data; the step count).",
    ]
    record["problems"] = wrong
    _results.write(args.out, "optim", "\n".join(lines) + "\n", record)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
