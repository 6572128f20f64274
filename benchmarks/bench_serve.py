"""A FastAPI service under load: trio-cuda against the same app written with PyTorch.

Each service is ``examples/serve_fastapi.py``'s app (the same batcher: up to
``--max-batch`` requests or ``--window-ms`` per batch; the same MLP, ``--depth`` hidden
layers, float32) in a uvicorn process of its own, on 127.0.0.1; only the model's forward
differs:

* ``trio-cuda``: the batch padded up to its bucket (1, 2, 4, ... rows) and awaited on the
  asyncio loop as one upload, one replay of the forward captured as a CUDA graph for that
  bucket, and one read-back.
* ``torch sync``: PyTorch on the GPU called in the handler, then ``torch.cuda.synchronize()``
  and the read-back: the loop is blocked while the GPU works (the common first version).
* ``torch thread``: the same PyTorch call through ``anyio.to_thread.run_sync`` (the common
  fix): the loop is free, a worker thread waits.
* ``torch graph``: the same PyTorch forward captured as a ``torch.cuda.CUDAGraph`` per
  bucket, as trio-cuda's, replayed in the handler, then ``torch.cuda.synchronize()``: the
  peer that takes the graph advantage too (torch sync and torch thread run op by op).
* ``trio-cuda eager`` (the A/B): the batch's DAG of the MLP's ops (upload, 3 ops a layer,
  read-back) built and planned for every batch, awaited once.

The load comes from this process (``serve_fastapi.load_test``, keep-alive HTTP/1.1 over
``--connections`` connections, ``--requests`` requests a round, with a ``GET /health``
every 5 ms meanwhile); every answer is checked against numpy. All services are started
first and loaded one at a time in ``--rounds`` interleaved rounds (the order reversed
every other round; a peer that fails to start is reported and left out). Figures,
medians over the rounds: requests/s, request latency p50 and p99, ``/health`` latency p50
and p99 (how responsive the loop stayed).

The PyTorch services need PyTorch with CUDA; on the simulated device (or without torch)
only the trio-cuda services are measured and the figures mean nothing (``--smoke``: tiny
sizes).

Usage: ``python benchmarks/bench_serve.py [--rounds 3] [--out DIR]``. Writes
``serve-<date>.md`` and ``.json`` under ``--out`` (default benchmarks/results). Exits 1 if
an answer was wrong or a service failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from serve_fastapi import Connection, Model, bucket, load_test, make_app  # noqa: E402

from benchmarks import _results  # noqa: E402

SERVICES = ["trio-cuda", "torch sync", "torch thread", "torch graph", "trio-cuda eager"]
SMOKE = {"rounds": 1, "requests": 60, "connections": 6, "features": 16, "hidden": 32, "outputs": 4, "depth": 1}
HOW = [  # (what each service does a batch, for the results' notes)
    (
        "trio-cuda",
        "trio-cuda replays the forward captured as a CUDA graph per batch bucket (1, 2, 4, ... rows, the batch padded up to it)",
    ),
    ("torch sync", "torch sync runs op by op (eager)"),
    ("torch thread", "torch thread runs op by op (eager) in a worker thread"),
    ("torch graph", "torch graph replays a torch.cuda.CUDAGraph per bucket as trio-cuda does"),
    ("trio-cuda eager", "trio-cuda eager builds and plans each batch's DAG (3 ops a layer)"),
]
FIGURES = [
    ("requests_per_s", "requests/s"),
    ("request_p50_ms", "request p50, ms"),
    ("request_p99_ms", "request p99, ms"),
    ("health_p50_ms", "/health p50, ms"),
    ("health_p99_ms", "/health p99, ms"),
]


class TorchModel:
    """The same MLP in PyTorch on the GPU; ``forward`` blocks the loop (``sync``) or runs
    in a worker thread (``thread``)."""

    def __init__(self, model: Model, mode: str) -> None:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False  # float32 as trio-cuda and numpy compute it
        self.torch = torch
        self.host = model.host
        self.features = model.features
        self.mode = mode
        self.dev: list[tuple[Any, Any]] = []

    async def load(self) -> None:
        self.dev = [(self.torch.from_numpy(w).cuda(), self.torch.from_numpy(b).cuda()) for w, b in self.host]

    def _run(self, x: np.ndarray) -> np.ndarray:
        torch = self.torch
        h = torch.from_numpy(x).cuda()
        for w, b in self.dev[:-1]:
            h = torch.relu(h @ w + b)
        w, b = self.dev[-1]
        y = h @ w + b
        torch.cuda.synchronize()
        return y.cpu().numpy()  # type: ignore[no-any-return]

    async def forward(self, x: np.ndarray) -> np.ndarray:
        if self.mode == "sync":
            return self._run(x)
        import anyio

        return await anyio.to_thread.run_sync(self._run, x)


class TorchGraphModel(TorchModel):
    """The same MLP in PyTorch captured as trio-cuda's is: a ``torch.cuda.CUDAGraph`` per
    bucket of batch sizes into static input and output tensors (PyTorch's own recipe:
    warm-up on a side stream, then the capture), the batch padded up to its bucket;
    replayed in the handler, then ``torch.cuda.synchronize()`` and the read-back (the
    loop blocked, as ``torch sync``). The peer that takes the graph advantage too."""

    def __init__(self, model: Model) -> None:
        super().__init__(model, "sync")
        self.max_batch = model.max_batch
        self.graphs: dict[int, tuple[Any, Any, Any]] = {}

    def _layers(self, h: Any) -> Any:
        for w, b in self.dev[:-1]:
            h = self.torch.relu(h @ w + b)
        w, b = self.dev[-1]
        return h @ w + b

    async def load(self) -> None:
        await super().load()
        torch = self.torch
        for rows in sorted({bucket(n) for n in range(1, self.max_batch + 1)}):
            x = torch.zeros((rows, self.features), device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._layers(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = self._layers(x)
            self.graphs[rows] = (graph, x, y)

    def _run(self, x: np.ndarray) -> np.ndarray:
        n = len(x)
        if bucket(n) not in self.graphs:  # (above --max-batch: the batcher never sends one)
            return super()._run(x)
        graph, xs, ys = self.graphs[bucket(n)]
        xs[:n].copy_(self.torch.from_numpy(x))
        graph.replay()
        self.torch.cuda.synchronize()
        return ys[:n].cpu().numpy()  # type: ignore[no-any-return]


def torch_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA device"
    return None


def model_of(args: argparse.Namespace, graphs: bool = True) -> Model:
    return Model(args.features, args.hidden, args.outputs, args.depth, graphs=graphs, max_batch=args.max_batch)


def serve(args: argparse.Namespace) -> None:
    """The child: one service on ``--port`` until it is terminated."""
    import uvicorn

    model: Any = model_of(args, graphs=args.serve == "trio-cuda")
    if args.serve == "torch graph":
        model = TorchGraphModel(model)
    elif args.serve.startswith("torch"):
        model = TorchModel(model, args.serve.split()[1])
    app = make_app(model, args.max_batch, args.window_ms)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_up(url: str, child: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if child.poll() is not None:
            raise RuntimeError(f"the service exited with code {child.returncode} before answering")
        try:
            conn = await Connection.open(url)
            try:
                if (await conn.request("GET", "/health"))[0] == 200:
                    return
            finally:
                await conn.close()
        except (OSError, asyncio.IncompleteReadError):
            pass  # (not listening yet)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service did not answer /health within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def child_args(args: argparse.Namespace, name: str, port: int) -> list[str]:
    sizes = ["features", "hidden", "outputs", "depth", "max_batch", "window_ms"]
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in sizes]
    return [sys.executable, __file__, "--serve", name, f"--port={port}", *flags]


async def bench(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, list[dict[str, float]]], list[str]]:
    model = model_of(args, graphs=False)  # (for its reference only)
    rng = np.random.default_rng(1)
    problems: list[str] = []
    children: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for name in names:
            port = free_port()
            children[name] = (subprocess.Popen(child_args(args, name, port), env=dict(os.environ)), f"http://127.0.0.1:{port}")
        for name, (child, url) in list(children.items()):
            try:
                await wait_up(url, child, args.start_timeout)
            except RuntimeError as err:
                if name == "trio-cuda":
                    raise
                problems.append(f"{name}: {err}; not measured")  # (the others still are)
                child.kill()
                child.wait()
                del children[name]
        rounds: dict[str, list[dict[str, float]]] = {n: [] for n in children}
        xs = rng.standard_normal((args.requests, model.features), np.float32)
        want = model.reference(xs)  # (once: every round sends the same requests)
        warm = min(len(xs), args.connections * 4)
        for _, url in children.values():
            await load_test(url, xs[:warm], want[:warm], args.connections)  # compile, load, fill the pools
        for r in range(args.rounds):
            for name in list(children) if r % 2 == 0 else reversed(children):
                load = await load_test(children[name][1], xs, want, args.connections)
                problems += [f"{name}: {b}" for b in load.bad[:5]]
                rounds[name].append(load.summary())
    finally:
        for child, _ in children.values():
            child.terminate()
        for name, (child, _) in children.items():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                problems.append(f"{name}: the service did not stop within 30 s of SIGTERM")
    return rounds, problems


def table(rounds: dict[str, list[dict[str, float]]]) -> list[str]:
    names = list(rounds)
    others = names[1:]
    head = ["figure", *names, *(f"{n} / trio-cuda" for n in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label in FIGURES:
        med = {n: statistics.median(r[key] for r in rounds[n]) for n in names}
        cells = [label, *(f"{med[n]:.3g}" for n in names)]
        for n in others:
            cells.append(f"{med[n] / med['trio-cuda']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for the simulated device")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="requests a round")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--outputs", type=int, default=16)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--window-ms", type=float, default=2.0)
    ap.add_argument("--services", default=",".join(SERVICES), help="services to measure, trio-cuda first")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds a service may take to answer first")
    ap.add_argument("--serve", choices=SERVICES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    known, _ = ap.parse_known_args(argv)
    if known.smoke:
        ap.set_defaults(**SMOKE)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    names = [n.strip() for n in args.services.split(",") if n.strip()]
    if not names or names[0] != "trio-cuda" or any(n not in SERVICES for n in names):
        ap.error(f"--services: a comma-separated list of {', '.join(SERVICES)}, trio-cuda first")
    notes = []
    missing = torch_missing()
    if missing and any(n.startswith("torch") for n in names):
        notes.append(f"- {missing}: the PyTorch services are not measured")
        names = [n for n in names if not n.startswith("torch")]
    started = time.perf_counter()
    rounds, problems = asyncio.run(bench(args, names))

    import trio_cuda

    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    gpu = trio_cuda.current_device().name
    text = "\n".join(
        [
            f"# A FastAPI service under load ({stamp})",
            "",
            f"GPU: {gpu}, backend {trio_cuda.backend_name()}, python {sys.version.split()[0]}, trio-cuda "
            f"{trio_cuda.__version__}. MLP {args.features} -> {args.hidden} x {args.depth + 1} -> {args.outputs}, "
            f"float32; batches of up to {args.max_batch} or {args.window_ms} ms; {args.requests} requests a round "
            f"over {args.connections} connections, /health every 5 ms; {args.rounds} interleaved rounds, medians.",
            "",
            *table(rounds),
            "",
            "- " + "; ".join(how for name, how in HOW if name in rounds),
            *notes,
            *(f"- PROBLEM: {p}" for p in problems),
            "- every answer checked against numpy" if not problems else "",
            f"- whole run: {time.perf_counter() - started:.1f} s",
            "",
        ]
    )
    record = {"when": stamp, "gpu": gpu, "args": vars(args), "rounds": rounds, "problems": problems}
    _results.write(args.out, "serve", text, record)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
