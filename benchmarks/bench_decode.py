"""The decode step of examples/cuda_graphs_deviceop.py in every execution mode (issue 5).

Hidden 2048, 22 layers of rms_norm -> matvec Q -> matvec O -> residual add (88 kernels
per token: ops.rms_norm, two ops.matmul GEMVs on cuBLASLt and the hand-written add),
float32, on one GPU, in one run. Per token:

* ``trio: await per kernel``: one ``await`` per kernel (a sync after every kernel);
* ``trio: await per token``: the whole step as one DAG, awaited once;
* ``trio: graph replay``: ``await graph.launch()`` of the captured step;
* ``raw cuGraphLaunch``: cuda.bindings ``cuGraphLaunch`` of the same instantiated graph +
  ``cuStreamSynchronize``; and its GPU-only time (timing events around back-to-back
  replays);
* ``kernels only: ...`` / ``ops only: ...``: the step written with the hand-written
  kernels only, and with ``trio_cuda.ops`` only, awaited per token, with their graphs'
  GPU-only time; and per kernel kind the GPU-only time of each (which the example's
  step, ``Model.step``, picks from);
* ``torch eager`` and ``torch CUDA graph`` on the same shapes (rms_norm as PyTorch ops).

Prints a table (ms per token, us per graph node) with the targets, and writes
``decode-<date>.md`` / ``.json`` under ``--out``. On the simulated device it runs with
tiny sizes only as a smoke test (``--hidden 16 --layers 2 --tokens 2``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import sys
import time
from typing import Any

import trio

import trio_cuda
from trio_cuda import ops
from trio_cuda.kernels import MATVEC_ROWS, add, matvec, rms_norm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _results

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from cuda_graphs_deviceop import EPS, build


def per_kernel_ops(m: Any) -> list[Any]:
    """The example's step (Model.step) as 4 ops per layer, to await one by one."""
    hdim = m.hidden
    h1, hn1 = m.h.reshape(hdim), m.hn.reshape(hdim)
    ops_ = []
    for w_norm, wq, wo in m.weights:
        ops_.append(lambda w_norm=w_norm: ops.rms_norm(m.h, w_norm, EPS, out=m.hn))
        ops_.append(lambda wq=wq: ops.matmul(wq, hn1, out=m.q))
        ops_.append(lambda wo=wo: ops.matmul(wo, m.q, out=m.o))
        ops_.append(lambda: add(h1.partition((min(hdim, 256),)), h1, m.o))
    return ops_


async def per_kernel_step_figure(hidden: int, layers: int) -> Any:
    """For the A/B probes: an async function giving ms per step of the example's step
    awaited op by op on one stream, as below (3 steps per call)."""
    makers = per_kernel_ops(await build(hidden, layers))
    dev = trio_cuda.current_device()
    one_stream = trio_cuda.SingleStream(dev)

    async def decode_ms() -> float:
        pool, dev.policy = dev.policy, one_stream
        try:
            t0 = time.perf_counter_ns()
            for _ in range(3):
                for make in makers:
                    await make()
            return (time.perf_counter_ns() - t0) / 3e6
        finally:
            dev.policy = pool

    return decode_ms


async def trio_modes(hidden: int, layers: int, tokens: int) -> tuple[dict[str, float], Any, Any]:
    m = await build(hidden, layers)
    dev = trio_cuda.current_device()
    policy = trio_cuda.SingleStream(dev)  # one stream: the modes differ only in how they wait
    dev.policy = policy
    makers = per_kernel_ops(m)
    for mk in makers:  # warm-up: compile and load every kernel
        await mk()
    await m.step()
    res: dict[str, float] = {}

    t0 = time.perf_counter()
    for _ in range(tokens):
        for mk in makers:
            await mk()
    res["trio: await per kernel"] = (time.perf_counter() - t0) / tokens * 1e3

    t0 = time.perf_counter()
    for _ in range(tokens):
        await m.step()
    res["trio: await per token"] = (time.perf_counter() - t0) / tokens * 1e3

    graph = m.step().graph()
    await graph.launch()
    t0 = time.perf_counter()
    for _ in range(tokens):
        await graph.launch()
    res["trio: graph replay"] = (time.perf_counter() - t0) / tokens * 1e3

    # the step with the hand-written kernels only, and with trio_cuda.ops only
    others = {}
    for label, make in (("kernels only", m.step_kernels), ("ops only", m.step_ops)):
        await make()
        t0 = time.perf_counter()
        for _ in range(tokens):
            await make()
        res[f"{label}: await per token"] = (time.perf_counter() - t0) / tokens * 1e3
        others[label] = make().graph()
    return res, graph, others, kernel_graphs(m)


def kernel_graphs(m: Any) -> dict[str, Any]:
    """Per kernel kind, the hand-written kernel and its ops twin, each as a graph of as
    many launches as a step has of that kind (their GPU-only time decides which the
    example uses)."""
    hdim = m.hidden
    h1, hn1 = m.h.reshape(hdim), m.hn.reshape(hdim)
    w_norm, wq, _ = m.weights[0]
    pairs = {
        "rms_norm": (
            lambda: rms_norm(m.hn.partition((1, hdim)), m.h, w_norm, EPS),
            lambda: ops.rms_norm(m.h, w_norm, EPS, out=m.hn),
        ),
        "matvec": (lambda: matvec(m.q.partition((MATVEC_ROWS,)), wq, hn1), lambda: ops.matmul(wq, hn1, out=m.q)),
        "add": (lambda: add(h1.partition((min(hdim, 256),)), h1, m.o), lambda: ops.add(h1, m.o, out=h1)),
    }
    graphs = {}
    for kind, (hand, via_ops) in pairs.items():
        for label, make in (("hand", hand), ("ops", via_ops)):
            op: Any = trio_cuda.value(None)
            for _ in range(m.layers * (2 if kind == "matvec" else 1)):
                op = op.then(lambda _, make=make: make())
            graphs[f"{kind} {label}"] = (op.graph(), m.layers * (2 if kind == "matvec" else 1))
    return graphs


def raw_graph(graph: Any, tokens: int, label: str = "") -> dict[str, float]:
    from cuda.bindings import driver as cu

    if trio_cuda.backend_name() != "cuda":
        return {}
    exec_ = graph._handle.exec
    s = graph.device.policy.next_stream().handle
    ok = cu.CUresult.CUDA_SUCCESS

    def chk(r: Any) -> Any:
        if r[0] != ok:
            raise RuntimeError(str(r[0]))
        return r[1] if len(r) > 1 else None

    chk(cu.cuGraphLaunch(exec_, s))
    chk(cu.cuStreamSynchronize(s))
    t0 = time.perf_counter()
    for _ in range(tokens):
        chk(cu.cuGraphLaunch(exec_, s))
        chk(cu.cuStreamSynchronize(s))
    out = {f"{label}raw cuGraphLaunch + sync": (time.perf_counter() - t0) / tokens * 1e3}
    start, end = chk(cu.cuEventCreate(0)), chk(cu.cuEventCreate(0))
    chk(cu.cuEventRecord(start, s))
    for _ in range(tokens):
        chk(cu.cuGraphLaunch(exec_, s))
    chk(cu.cuEventRecord(end, s))
    chk(cu.cuEventSynchronize(end))
    out[f"{label}GPU-only time of one replay"] = chk(cu.cuEventElapsedTime(start, end)) / tokens
    cu.cuEventDestroy(start)
    cu.cuEventDestroy(end)
    return out


class TorchSteps:
    """PyTorch's decode step on the example's shapes (rms_norm as PyTorch ops: pow, mean,
    add, rsqrt and two multiplies; two ``torch.mv``; the residual add: 9 kernels per
    layer), on the current CUDA stream, warm."""

    def __init__(self, hidden: int, layers: int) -> None:
        import torch

        self.torch = torch
        dev = torch.device("cuda")
        g = torch.Generator(device="cpu").manual_seed(0)
        self.ws = [
            (
                torch.randn(hidden, generator=g).to(dev),
                (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(dev),
                (torch.randn(hidden, hidden, generator=g) / hidden**0.5 / 2).to(dev),
            )
            for _ in range(layers)
        ]
        self.h = torch.randn(hidden, generator=g).to(dev)
        for _ in range(3):
            self.step(self.h)
            self.step(self.h, sync_each=True)
        torch.cuda.synchronize()

    def step(self, h: Any, sync_each: bool = False) -> Any:
        """One step; ``sync_each``: a ``torch.cuda.synchronize()`` after every op (what an
        await per kernel is), else none."""
        torch = self.torch
        if not sync_each:
            for w, wq, wo in self.ws:
                hn = h * torch.rsqrt(h.pow(2).mean() + EPS) * w
                h = h + torch.mv(wo, torch.mv(wq, hn))
            return h

        def op(t: Any) -> Any:
            torch.cuda.synchronize()
            return t

        for w, wq, wo in self.ws:
            ms = op(op(op(h.pow(2)).mean()) + EPS)
            hn = op(op(h * op(torch.rsqrt(ms))) * w)
            h = op(h + op(torch.mv(wo, op(torch.mv(wq, hn)))))
        return h

    def ms_per_token(self, tokens: int, sync_each: bool = False) -> float:
        """``tokens`` steps, one ``torch.cuda.synchronize()`` per token (and per op with
        ``sync_each``); ms per token."""
        t0 = time.perf_counter()
        for _ in range(tokens):
            self.step(self.h, sync_each)
            self.torch.cuda.synchronize()
        return (time.perf_counter() - t0) / tokens * 1e3


def torch_steps(hidden: int, layers: int) -> tuple[TorchSteps | None, str | None]:
    """:class:`TorchSteps`, or None and why (no PyTorch, no CUDA device, ...)."""
    try:
        return TorchSteps(hidden, layers), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


async def per_kernel_floor(makers: list[Any]) -> Any:
    """The floor of a step awaited kernel by kernel, without trio-cuda's host code: each
    op of ``makers`` captured alone as a one-node graph (a GEMV on cuBLASLt is a graph
    launch on trio-cuda's direct path too; for the other kernels a graph launch costs the
    host a little more than ``cuLaunchKernel``), then per kernel the backend's compiled
    driver calls (``cuGraphLaunch``, ``cuEventRecord``, ``cuEventQuery`` until done) on a
    stream of its own. Returns an async function ``floor(tokens, trio_pass)`` giving ms
    per token (``trio_pass``: one trio schedule point per kernel between the record and
    the first query, as an await has), or None where there is no such path (the
    simulated device, no compiled calls)."""
    dev = trio_cuda.current_device()
    drv = dev._driver  # type: ignore[attr-defined]
    fast, pfn = getattr(drv, "_fast", None), getattr(drv, "_graph_pfn", 0)
    if trio_cuda.backend_name() != "cuda" or fast is None or not pfn:
        return None
    from trio_cuda._backends import _cudafast

    graphs = [make().graph() for make in makers]
    execs = [int(g._handle.exec) for g in graphs]
    stream, event = drv.create_stream(), drv.create_event()
    sh, eh = int(stream), int(event)
    launch, record, query = _cudafast.graph_launch, _cudafast.record, _cudafast.query
    checkpoint = trio.lowlevel.cancel_shielded_checkpoint

    async def floor(tokens: int, trio_pass: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(tokens):
            for x in execs:
                if launch(pfn, x, sh) or record(fast[1], eh, sh):
                    raise RuntimeError("per_kernel_floor: a launch or record failed")
                if trio_pass:
                    await checkpoint()
                while (r := query(fast[2], eh)) != 0:
                    if r != 600:  # CUDA_ERROR_NOT_READY
                        raise RuntimeError(f"per_kernel_floor: cuEventQuery returned {r}")
        return (time.perf_counter() - t0) / tokens * 1e3

    floor.graphs = graphs  # type: ignore[attr-defined]  # (kept alive with the function)
    await floor(1, False)
    return floor


def torch_modes(hidden: int, layers: int, tokens: int) -> tuple[dict[str, float], str | None]:
    steps, err = torch_steps(hidden, layers)
    if steps is None:
        return {}, err
    try:
        torch = steps.torch
        res = {"torch eager": steps.ms_per_token(tokens)}
        static = steps.h.clone()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            out = steps.step(static)
        cg.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            cg.replay()
            torch.cuda.synchronize()
        res["torch CUDA graph"] = (time.perf_counter() - t0) / tokens * 1e3
        del out
        return res, None
    except Exception as e:
        return {}, f"{type(e).__name__}: {e}"


def main() -> int:
    sim = trio_cuda.backend_name() == "sim"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=16 if sim else 2048)
    ap.add_argument("--layers", type=int, default=2 if sim else 22)
    ap.add_argument("--tokens", type=int, default=2 if sim else 100)
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    args = ap.parse_args()

    res, graph, others, kernels = trio.run(trio_modes, args.hidden, args.layers, args.tokens)
    res.update(raw_graph(graph, args.tokens))
    for label, g in others.items():
        res.update(raw_graph(g, args.tokens, f"{label}: "))
    per_kernel: dict[str, float] = {}
    for name, (g, count) in kernels.items():
        t = raw_graph(g, args.tokens).get("GPU-only time of one replay")
        if t is not None:
            per_kernel[name] = t * 1e3 / count  # us per launch
    torch_error = None
    if not sim:
        t, torch_error = torch_modes(args.hidden, args.layers, args.tokens)
        res.update(t)
    nodes = graph.nodes
    lines = ["| mode | ms per token | us per graph node |", "|---|---|---|"]
    for k, v in res.items():
        per_node = (
            f"{v * 1e3 / nodes:.3f}" if ("graph" in k or "replay" in k) and not k.startswith(("kernels only", "ops only")) else ""
        )
        lines.append(f"| {k} | {v:.4f} | {per_node} |")
    checks = []
    if "raw cuGraphLaunch + sync" in res:
        r = res["trio: graph replay"] / res["raw cuGraphLaunch + sync"]
        checks.append(f"- graph replay vs raw cuGraphLaunch (per node): {r:.3f}x (target <= 1.1x)")
        g = res["trio: graph replay"] / res["GPU-only time of one replay"]
        checks.append(f"- graph token time vs its GPU-only time: {g:.3f}x (target <= 1.10x)")
    sp = res["trio: await per kernel"] / res["trio: await per token"]
    checks.append(f"- one await per token vs await per kernel: {sp:.2f}x faster (target >= 1.7x)")
    for label in ("kernels only", "ops only"):
        if f"{label}: GPU-only time of one replay" in res:
            r = res["GPU-only time of one replay"] / res[f"{label}: GPU-only time of one replay"]
            checks.append(f"- the example's step vs the step with {label}, GPU-only per token: {r:.3f}x")
    for kind in ("rms_norm", "matvec", "add"):
        if f"{kind} hand" in per_kernel:
            hand, via_ops = per_kernel[f"{kind} hand"], per_kernel[f"{kind} ops"]
            faster = "ops" if via_ops < hand else "hand-written"
            checks.append(f"- {kind}: hand-written {hand:.2f} us, ops {via_ops:.2f} us per launch (GPU-only): {faster} is faster")
    if torch_error:
        checks.append(f"- torch: {torch_error}")
    dev = trio_cuda.current_device()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"# Decode step ({stamp})\n\nGPU: {dev.name}, backend {trio_cuda.backend_name()}; hidden {args.hidden}, "
        f"{args.layers} layers, {4 * args.layers} kernels per token, graph of {nodes} nodes; {args.tokens} tokens per mode, "
        "one stream.\n\n" + "\n".join(lines) + "\n\n" + "\n".join(checks) + "\n"
    )
    _results.write(
        args.out,
        "decode",
        text,
        {"when": stamp, "gpu": dev.name, "nodes": nodes, "ms_per_token": res, "us_per_kernel": per_kernel},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
