"""A FastAPI service under uvicorn (asyncio) whose model runs on trio-cuda.

Concurrent requests are batched dynamically: a batcher task gathers up to ``--max-batch``
requests, or what arrived within ``--window-ms`` of the first, and runs the whole batch
as one await. The MLP's forward is captured once as a CUDA graph per batch-size bucket
(1, 2, 4, 8, 16, 32 rows): a batch is padded up to its bucket and costs one upload, one
graph replay and one read-back (``--eager``: build and plan the batch's DAG of the MLP's
ops every time instead). The event loop keeps serving other requests and ``/health``
while the GPU works. Each request may carry a deadline:
when it passes, that request answers 504 and stops waiting; a request still queued is
dropped before its batch is submitted, and a batch already on the GPU finishes for the
other requests in it.

    pip install "trio-cuda[serve]"
    python examples/serve_fastapi.py                 # serve on 127.0.0.1:8000
    python examples/serve_fastapi.py --self-check    # serve, load-test itself, check every answer

Endpoints: ``POST /infer`` with ``{"x": [FEATURES floats], "deadline_ms": 50}``
(deadline optional) gives ``{"y": [...]}``; ``GET /health`` gives the batcher's counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import trio_cuda
from trio_cuda import api, ops

try:
    import uvicorn
    from fastapi import FastAPI, HTTPException
except ImportError:  # pragma: no cover - the [serve] extra is missing
    sys.exit('serve_fastapi.py needs FastAPI and uvicorn: pip install "trio-cuda[serve]"')


def bucket(n: int) -> int:
    """The rows of the captured forward that serves a batch of ``n`` requests: the
    power of two at or above ``n`` (1, 2, 4, 8, 16, 32, ...)."""
    if n < 1:
        raise ValueError(f"a batch needs at least one request, got {n}")
    return 1 << (n - 1).bit_length()


class Replay:
    """The forward captured as a CUDA graph for batches of up to ``rows`` requests, with
    buffers of its own: the input ``x`` (rows, features), the hidden layers' two
    ping-pong buffers and the output ``y`` (rows, outputs). A batch of ``n <= rows``
    requests is one await of three steps: an upload into ``x[:n]``, one replay of the
    graph, the read-back of ``y[:n]`` (the rows past ``n`` hold an older batch's values:
    each row of an MLP depends on its own input row only, and they are not read back)."""

    def __init__(self, rows: int, x: trio_cuda.Tensor, y: trio_cuda.Tensor, graph: trio_cuda.CudaGraph[Any]) -> None:
        self.rows = rows
        self.x = x
        self.y = y
        self.graph = graph

    def run(self, x: np.ndarray) -> trio_cuda.DeviceOp[np.ndarray]:
        n = len(x)
        if not 0 < n <= self.rows:
            raise ValueError(f"a replay for up to {self.rows} rows got a batch of {n}")
        return api.memcpy(self.x[:n], x).then(lambda _: self.graph.launch()).then(lambda _: self.y[:n].to_host())


class Model:
    """An MLP: ``relu(x @ w1 + b1)``, then ``depth`` hidden layers ``relu(h @ w + b)``,
    then ``h @ w2 + b2``; the weights resident on the device.

    With ``graphs`` (the default) each batch is padded up to its :func:`bucket` and runs
    as a replay of the forward captured for that bucket (:class:`Replay`): one upload,
    one graph launch and one read-back, instead of building and planning some 3 ops a
    layer. ``load()`` captures the buckets up to ``max_batch``; a larger batch, or a
    second batch of a bucket while the first is in flight, captures another replay at
    first need (so concurrent batches never share buffers). Without ``graphs`` each
    batch builds its DAG (:meth:`eager`)."""

    def __init__(
        self,
        features: int,
        hidden: int,
        outputs: int,
        depth: int = 0,
        seed: int = 0,
        *,
        graphs: bool = True,
        max_batch: int = 32,
    ) -> None:
        rng = np.random.default_rng(seed)
        shapes = [(features, hidden)] + [(hidden, hidden)] * depth + [(hidden, outputs)]
        self.host = [
            ((rng.standard_normal(io) / np.sqrt(io[0])).astype(np.float32), (rng.standard_normal(io[1]) * 0.1).astype(np.float32))
            for io in shapes
        ]
        self.features = features
        self.hidden = hidden
        self.outputs = outputs
        self.graphs = graphs
        self.max_batch = max_batch
        self.dev: list[tuple[trio_cuda.Tensor, trio_cuda.Tensor]] = []
        self.idle: dict[int, list[Replay]] = {}  # bucket -> its replays not in use
        self.captured = 0  # replays captured
        self.replayed = 0  # batches answered by a replay

    async def load(self) -> None:
        self.dev = [(await api.from_host(w), await api.from_host(b)) for w, b in self.host]
        if self.graphs:
            for rows in sorted({bucket(n) for n in range(1, self.max_batch + 1)}):
                self.idle.setdefault(rows, []).append(await self.capture(rows))

    def layers(self, h: Any, bufs: tuple[trio_cuda.Tensor, ...] | None = None) -> trio_cuda.DeviceOp[trio_cuda.Tensor]:
        """The layers over ``h`` (a tensor or an op); with ``bufs`` (two hidden buffers
        and the output) every op writes into them (``out=``), as a capture needs."""
        last = len(self.dev) - 1
        for i, (w, b) in enumerate(self.dev):
            out = None if bufs is None else bufs[2 if i == last else i % 2]
            h = ops.add(ops.matmul(h, w, out=out), b, out=out)
            if i < last:
                h = ops.relu(h, out=out)
        return h  # type: ignore[no-any-return]

    def eager(self, x: np.ndarray) -> trio_cuda.DeviceOp[np.ndarray]:
        """The batch's whole DAG, built and planned now, awaited once: upload, the
        layers, read-back."""
        return self.layers(api.from_host(x)).to_host()

    async def capture(self, rows: int) -> Replay:
        """A new :class:`Replay` for batches of up to ``rows`` requests."""
        x = await api.zeros((rows, self.features))
        bufs = (await api.zeros((rows, self.hidden)), await api.zeros((rows, self.hidden)), await api.zeros((rows, self.outputs)))
        # Run the same ops once first: a capture runs nothing, and must find every kernel
        # compiled (and every GEMM planned) for these shapes, or it would compile them
        # in this thread, the loop's.
        await self.layers(x, bufs)
        graph = self.layers(x, bufs).graph()
        self.captured += 1
        return Replay(rows, x, bufs[2], graph)

    async def forward(self, x: np.ndarray) -> np.ndarray:
        """The answers to a batch (one row a request)."""
        if not self.graphs:
            return await self.eager(x)
        idle = self.idle.setdefault(bucket(len(x)), [])
        replay = idle.pop() if idle else await self.capture(bucket(len(x)))
        try:
            y = await replay.run(x)
        finally:
            # Back in the pool also when the await was cancelled with the replay still
            # on the GPU: the runtime orders the next batch's upload into x after this
            # replay's read of it, and its replay after this read-back of y, so the
            # buffers are not reused early (docs/runtime.md: cancelled after submission).
            idle.append(replay)
        self.replayed += 1
        return y

    def reference(self, x: np.ndarray) -> np.ndarray:
        for w, b in self.host[:-1]:
            x = np.maximum(x @ w + b, 0)
        w, b = self.host[-1]
        y: np.ndarray = x @ w + b
        return y


@dataclass
class Request:
    x: np.ndarray
    answer: asyncio.Future[np.ndarray] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Batcher:
    """Gathers requests into batches and runs each batch as one await."""

    def __init__(self, model: Model, max_batch: int, window_s: float) -> None:
        self.model = model
        self.max_batch = max_batch
        self.window_s = window_s
        self.queue: asyncio.Queue[Request] = asyncio.Queue()
        self.batches = 0
        self.served = 0
        self.dropped = 0  # requests whose deadline passed before their batch was submitted
        self.largest = 0

    async def run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            closes = time.perf_counter() + self.window_s
            while len(batch) < self.max_batch:
                left = closes - time.perf_counter()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
            live = [r for r in batch if not r.answer.done()]  # (a passed deadline cancels the future)
            self.dropped += len(batch) - len(live)
            if not live:
                continue
            try:
                y = await self.model.forward(np.stack([r.x for r in live]))
            except Exception as exc:  # (a device fault: every request of the batch gets it)
                for r in live:
                    if not r.answer.done():
                        r.answer.set_exception(exc)
                continue
            self.batches += 1
            self.largest = max(self.largest, len(live))
            for r, row in zip(live, y, strict=True):
                if not r.answer.done():
                    r.answer.set_result(row)
                    self.served += 1


def make_app(model: Model, max_batch: int = 32, window_ms: float = 2.0) -> FastAPI:
    batcher = Batcher(model, max_batch, window_ms / 1e3)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await model.load()
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app = FastAPI(lifespan=lifespan)
    app.state.batcher = batcher

    @app.post("/infer")
    async def infer(body: dict[str, Any]) -> dict[str, Any]:
        # Bad input answers 422 before the request is queued (no GPU work for an answer
        # nobody reads); a deadline must be finite (a NaN timer would break the loop's
        # ordering of timers).
        try:
            x = np.asarray(body.get("x"), np.float32)
        except (TypeError, ValueError):  # (not numbers, or ragged)
            x = None
        if x is None or x.shape != (model.features,):
            raise HTTPException(422, f"x must be a list of {model.features} numbers")
        deadline = body.get("deadline_ms")
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline)
        ):
            raise HTTPException(422, f"deadline_ms must be a finite number of milliseconds, not {deadline!r}")
        req = Request(x)
        batcher.queue.put_nowait(req)
        try:
            async with asyncio.timeout(None if deadline is None else deadline / 1e3):
                y = await asyncio.shield(req.answer)
        except TimeoutError:
            req.answer.cancel()  # a queued request is dropped; its batch, if running, goes on
            raise HTTPException(504, "deadline passed") from None
        return {"y": y.tolist()}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "ok": True,
            "batches": batcher.batches,
            "served": batcher.served,
            "dropped": batcher.dropped,
            "largest_batch": batcher.largest,
            "queued": batcher.queue.qsize(),
        }

    return app


@dataclass
class Load:
    """What a load test saw: its wall time, each request's and each /health probe's
    latency, and what went wrong (wrong answers, failed requests)."""

    elapsed_s: float
    request_ms: list[float]
    health_ms: list[float]
    bad: list[str]

    def summary(self) -> dict[str, float]:
        req50, req99 = np.percentile(self.request_ms, [50, 99]) if self.request_ms else (np.nan, np.nan)
        h50, h99 = np.percentile(self.health_ms, [50, 99]) if self.health_ms else (np.nan, np.nan)
        return {
            "requests_per_s": len(self.request_ms) / self.elapsed_s,
            "request_p50_ms": float(req50),
            "request_p99_ms": float(req99),
            "health_p50_ms": float(h50),
            "health_p99_ms": float(h99),
        }


class Connection:
    """One keep-alive HTTP/1.1 connection to the service. A load generator must cost far
    less a request than the service it measures; a general client (httpx) spends
    milliseconds a request in Python, which would make the client the bottleneck."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader = reader
        self.writer = writer
        self.host = host

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port or 80))
        return cls(reader, writer, f"{host}:{port}")

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Send one request; its status and body."""
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if length is None:  # (uvicorn gives JSON answers a length; no chunked reading here)
            raise RuntimeError(f"{method} {path}: an answer without Content-Length")
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def load_test(url: str, xs: np.ndarray, want: np.ndarray, connections: int, probe_every_s: float = 0.005) -> Load:
    """Send one ``POST /infer`` per row of ``xs`` over ``connections`` connections (and
    ``GET /health`` every ``probe_every_s`` on one more meanwhile); check each answer
    against ``want`` afterwards (the bodies are encoded before and decoded after the
    timed part, so the client's cost a request stays small)."""
    bodies = [json.dumps({"x": row.tolist()}).encode() for row in xs]
    answers: list[tuple[int, bytes]] = [(0, b"")] * len(xs)
    request_ms: list[float] = []
    health_ms: list[float] = []
    bad: list[str] = []
    conns = [await Connection.open(url) for _ in range(connections + 1)]
    next_i = 0

    async def connection(conn: Connection) -> None:
        nonlocal next_i
        while next_i < len(xs):
            i, next_i = next_i, next_i + 1
            t = time.perf_counter()
            answers[i] = await conn.request("POST", "/infer", bodies[i])
            request_ms.append((time.perf_counter() - t) * 1e3)

    async def prober(conn: Connection, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            status, body = await conn.request("GET", "/health")
            health_ms.append((time.perf_counter() - t) * 1e3)
            if status != 200 or not json.loads(body)["ok"]:
                bad.append("health failed")
            await asyncio.sleep(probe_every_s)

    try:
        start = time.perf_counter()
        stop = asyncio.Event()
        probe = asyncio.create_task(prober(conns[-1], stop))
        async with asyncio.TaskGroup() as tg:
            for conn in conns[:-1]:
                tg.create_task(connection(conn))
        elapsed = time.perf_counter() - start
        stop.set()
        await probe
    finally:
        for conn in conns:
            await conn.close()
    for i, (status, body) in enumerate(answers):
        if status != 200:
            bad.append(f"request {i}: HTTP {status}")
        elif not np.allclose(json.loads(body)["y"], want[i], rtol=1e-3, atol=1e-3):
            bad.append(f"request {i}: wrong answer")
    return Load(elapsed, request_ms, health_ms, bad)


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """Serve ``app`` under uvicorn on a free port of 127.0.0.1 while the block runs; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # (it failed to start: its error)
            await task
            raise RuntimeError("uvicorn stopped before it started serving")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def self_check(model: Model, args: argparse.Namespace) -> int:
    """Serve on a free port of 127.0.0.1, send ``--requests`` requests over
    ``--connections`` connections (and /health probes meanwhile), check every answer."""
    xs = np.random.default_rng(1).standard_normal((args.requests, model.features), np.float32)
    want = model.reference(xs)
    async with serving(make_app(model, args.max_batch, args.window_ms)) as url:
        load = await load_test(url, xs, want, args.connections)
        bad = load.bad
        conn = await Connection.open(url)
        try:
            # A deadline that cannot be met answers 504; the service goes on answering.
            status, _ = await conn.request("POST", "/infer", json.dumps({"x": xs[0].tolist(), "deadline_ms": 0}).encode())
            if status != 504:
                bad.append(f"a passed deadline answered HTTP {status}, not 504")
            status, body = await conn.request("POST", "/infer", json.dumps({"x": xs[1].tolist()}).encode())
            if status != 200 or not np.allclose(json.loads(body)["y"], want[1], rtol=1e-3, atol=1e-3):
                bad.append("the request after a deadline failed")
            stats = json.loads((await conn.request("GET", "/health"))[1])
        finally:
            await conn.close()
    f = load.summary()
    print(
        f"{args.requests} requests over {args.connections} connections in {load.elapsed_s:.2f} s "
        f"({f['requests_per_s']:.0f} req/s), {stats['batches']} batches (largest {stats['largest_batch']}); "
        f"/health p50 {f['health_p50_ms']:.2f} ms, p99 {f['health_p99_ms']:.2f} ms"
    )
    if model.graphs:
        print(f"{model.replayed} batches by graph replay, {model.captured} graphs captured")
        if model.replayed != stats["batches"]:
            bad.append(f"{stats['batches']} batches, but {model.replayed} graph replays")
    if bad:
        print("FAILED:", *bad[:10], sep="\n  ")
        return 1
    print(f"all {args.requests} answers correct (checked against numpy)")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--outputs", type=int, default=16)
    p.add_argument("--depth", type=int, default=0, help="hidden-to-hidden layers between the first and the last")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--window-ms", type=float, default=2.0)
    p.add_argument("--eager", action="store_true", help="build and plan each batch's DAG instead of replaying a captured graph")
    p.add_argument("--self-check", action="store_true", help="serve, load-test on 127.0.0.1, check every answer, exit")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--connections", type=int, default=20)
    args = p.parse_args()
    model = Model(args.features, args.hidden, args.outputs, args.depth, graphs=not args.eager, max_batch=args.max_batch)
    if args.self_check:
        sys.exit(asyncio.run(self_check(model, args)))
    uvicorn.run(make_app(model, args.max_batch, args.window_ms), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
