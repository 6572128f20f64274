"""One decode step of a 22-layer model as DeviceOps, captured once as a CUDA graph.

Each layer is rms_norm -> matvec Q -> matvec O -> residual add, on a hidden state of
size 2048 (the weights are random: this shows the execution model, not a language
model): ops.rms_norm and ops.matmul (cuBLASLt) with the hand-written add kernel, the
faster of each pair as measured (see Model.step). The script

1. uploads the weights as shared ops, joined with zip;
2. builds the step as one DAG, runs it eagerly, and captures it as a graph;
3. checks that a replay of the graph gives the eager result;
4. generates tokens one at a time: graph.update(memcpy(input, embedding)) + launch,
   reads the hidden state back, picks the next token, and prints tokens/s.

On the simulated device the defaults are smaller (hidden 16, 2 layers, 2 tokens),
because numba's simulator runs every GPU thread as a Python thread. Exits non-zero if
the graph and the eager run disagree.

Usage: python examples/cuda_graphs_deviceop.py [--hidden N] [--layers L] [--tokens T]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, ops
from trio_cuda.kernels import MATVEC_ROWS, add, matvec, rms_norm

EPS = 1e-5
VOCAB = 512


class Model:
    """Weights and activation buffers of the toy decoder (all allocated before capture)."""

    def __init__(
        self, hidden: int, layers: int, weights: list[tuple[Any, Any, Any]], bufs: tuple[Any, ...], embedding: np.ndarray
    ) -> None:
        self.hidden = hidden
        self.layers = layers
        self.weights = weights
        self.h, self.hn, self.q, self.o = bufs
        self.embedding = embedding

    def step(self, add_kernel: bool = True) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        """One decode step over all layers, as one DAG of 4 kernels per layer: for each
        kind the faster of trio_cuda.ops and the hand-written kernels of
        trio_cuda.kernels, as measured by benchmarks/bench_decode.py on an H200
        (2026-11-30, hidden 2048, GPU-only per launch): ops.rms_norm 2.7 us vs 4.0,
        ops.matmul (cuBLASLt GEMV) 4.6 us vs 11.3 for the matvec kernel, and the
        hand-written add 1.05 us vs 1.12 for ops.add (``add_kernel=False``: ops.add, the
        step with trio_cuda.ops only)."""
        h1 = self.h.reshape(self.hidden)

        def residual() -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
            if add_kernel:
                return add(h1.partition((min(self.hidden, 256),)), h1, self.o)
            return ops.add(h1, self.o, out=h1)

        op: trio_cuda.DeviceOp = trio_cuda.value(None)  # type: ignore[type-arg]
        for w_norm, wq, wo in self.weights:
            op = (
                op.then(lambda _, w_norm=w_norm: ops.rms_norm(self.h, w_norm, EPS, out=self.hn))
                .then(lambda _, wq=wq: ops.matmul(wq, self.hn.reshape(self.hidden), out=self.q))
                .then(lambda _, wo=wo: ops.matmul(wo, self.q, out=self.o))
                .then(lambda _: residual())
            )
        return op.map(lambda _: self.h)

    def step_ops(self) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        """The same step with trio_cuda.ops only (rms_norm, cuBLASLt GEMVs, add)."""
        return self.step(add_kernel=False)

    def step_kernels(self) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        """The same step with the hand-written kernels only (rms_norm, matvec, add)."""
        hdim = self.hidden
        h1 = self.h.reshape(hdim)
        hn1 = self.hn.reshape(hdim)
        op: trio_cuda.DeviceOp = trio_cuda.value(None)  # type: ignore[type-arg]
        for w_norm, wq, wo in self.weights:
            op = (
                op.then(lambda _, w_norm=w_norm: rms_norm(self.hn.partition((1, hdim)), self.h, w_norm, EPS))
                .then(lambda _, wq=wq: matvec(self.q.partition((MATVEC_ROWS,)), wq, hn1))
                .then(lambda _, wo=wo: matvec(self.o.partition((MATVEC_ROWS,)), wo, self.q))
                .then(lambda _: add(h1.partition((min(hdim, 256),)), h1, self.o))
            )
        return op.map(lambda _: self.h)


async def build(hidden: int, layers: int, seed: int = 0) -> Model:
    if hidden % MATVEC_ROWS or (hidden > 256 and hidden % 256):
        raise SystemExit(f"--hidden must be a multiple of {MATVEC_ROWS} (and of 256 above 256)")
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(hidden)
    host = [
        (
            (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
            (rng.standard_normal((hidden, hidden)) * scale).astype(np.float32),
            (rng.standard_normal((hidden, hidden)) * scale * 0.5).astype(np.float32),
        )
        for _ in range(layers)
    ]
    # Shared weight uploads, joined with zip: one await uploads everything, pipelined
    # over the stream pool.
    uploads = [trio_cuda.zip(*(api.from_host(w).shared() for w in layer)) for layer in host]
    weights = list(await trio_cuda.zip(*uploads))
    bufs = await trio_cuda.zip(api.zeros((1, hidden)), api.zeros((1, hidden)), api.zeros((hidden,)), api.zeros((hidden,)))
    embedding = rng.standard_normal((VOCAB, 1, hidden)).astype(np.float32)
    return Model(hidden, layers, weights, tuple(bufs), embedding)


async def main() -> int:
    sim = trio_cuda.backend_name() == "sim"
    ap = argparse.ArgumentParser(description="decode steps as a CUDA graph")
    ap.add_argument("--hidden", type=int, default=16 if sim else 2048)
    ap.add_argument("--layers", type=int, default=2 if sim else 22)
    ap.add_argument("--tokens", type=int, default=2 if sim else 200)
    args = ap.parse_args()

    m = await build(args.hidden, args.layers)
    dev = trio_cuda.current_device()
    print(f"{dev.name}: hidden {m.hidden}, {m.layers} layers, {4 * m.layers} kernels per token")

    # Eager reference: one await runs the whole step.
    await api.memcpy(m.h, m.embedding[1])
    eager = await m.step().to_host()

    # Capture the same DAG once (nothing runs), then replay it.
    graph = m.step().graph()
    out = graph.take_output()
    graph.update(api.memcpy(m.h, m.embedding[1]))
    await graph.launch()
    replay = await out.to_host()
    err = float(np.max(np.abs(replay - eager)) / max(1e-30, float(np.max(np.abs(eager)))))
    print(f"graph: {graph.nodes} nodes; replay vs eager: max relative difference {err:.2e}")
    if not np.allclose(replay, eager, rtol=1e-5, atol=1e-5):
        print("WRONG: the graph's result differs from the eager run")
        return 1

    # Token generation: update the input buffer, replay, read back, pick the next token.
    token = 1
    tokens = []
    host = np.empty((1, m.hidden), np.float32)
    start = time.perf_counter()
    for _ in range(args.tokens):
        graph.update(api.memcpy(m.h, m.embedding[token]))
        await graph.launch()
        await api.memcpy(host, m.h)
        token = int(np.argmax(host)) % VOCAB
        tokens.append(token)
    elapsed = time.perf_counter() - start
    print(f"generated {len(tokens)} tokens: {tokens[:12]}{' ...' if len(tokens) > 12 else ''}")
    print(f"{len(tokens) / elapsed:.1f} tokens/s ({elapsed / len(tokens) * 1e3:.3f} ms per token, graph replay + read-back)")
    print("correct")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
