"""Data-parallel training of a 2-layer MLP across every device, gradients all-reduced
through NCCL as a DeviceOp.

Each device holds a replica of the weights (broadcast from rank 0 at the start) and its
shard of every batch. One training step is one DAG over all devices, submitted without
waiting for the step before it (the weights it reads order it after the previous
step's update, on every stream, automatically):

    forward     h = relu(x @ W1^T + b1);  y = h @ W2^T + b2
    loss        mean((y - t)^2) over the global batch and the outputs (torch's MSELoss)
    backward    dy = 2 (y - t) / (N * outputs);  dW2 = dy^T h;  db2 = sum(dy);  dh = (dy @ W2) * (h > 0)
                dW1 = dh^T x;  db1 = sum(dh)
    all-reduce  the four gradients, summed over the devices (collectives.Group)
    update      W -= lr * dW (SGD)

The data is a fixed random teacher network plus noise; the loss must fall to half or less
(the program exits 1 otherwise) and the replicas must stay identical. On a GPU the
program also prints steps/s; benchmarks/bench_ddp.py compares it with PyTorch DDP.

Usage: python examples/train_mlp_ddp.py [--steps S] [--batch B] [--features F] [--hidden H] [--devices D]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, collectives, lowlevel, ops


def make_data(batch: int, features: int, outputs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets: a random teacher MLP plus a little noise."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, features)).astype(np.float32)
    t1 = rng.standard_normal((features, 64)) / np.sqrt(features)
    t2 = rng.standard_normal((64, outputs)) / 8.0
    t = np.tanh(x @ t1) @ t2 + 0.01 * rng.standard_normal((batch, outputs))
    return x, t.astype(np.float32)


def init_weights(features: int, hidden: int, outputs: int, seed: int = 1) -> list[np.ndarray]:
    """W1 (hidden, features), b1, W2 (outputs, hidden), b2: torch.nn.Linear's layout."""
    rng = np.random.default_rng(seed)
    return [
        (rng.uniform(-1, 1, (hidden, features)) / np.sqrt(features)).astype(np.float32),
        np.zeros(hidden, np.float32),
        (rng.uniform(-1, 1, (outputs, hidden)) / np.sqrt(hidden)).astype(np.float32),
        np.zeros(outputs, np.float32),
    ]


class Replica:
    """One device's weights, gradients, activations and data shard (all allocated once)."""

    def __init__(self, device: trio_cuda.Device) -> None:
        self.device = device

    async def setup(self, weights: list[np.ndarray], x: np.ndarray, t: np.ndarray, hidden: int) -> None:
        d = self.device
        b, o = t.shape
        # every replica starts from its own (different) initialization: the broadcast
        # from rank 0 below is what makes them equal
        noise = [w + np.float32(d.ordinal) for w in weights]
        self.w = list(await trio_cuda.zip(*(api.from_host(w, device=d) for w in noise)))
        self.g = list(await trio_cuda.zip(*(api.zeros(w.shape, device=d) for w in weights)))
        self.x, self.t = await trio_cuda.zip(api.from_host(x, device=d), api.from_host(t, device=d))
        self.h, self.y, self.dh = await trio_cuda.zip(
            api.zeros((b, hidden), device=d), api.zeros((b, o), device=d), api.zeros((b, hidden), device=d)
        )
        self.dy = await api.zeros((b, o), device=d)
        self.loss = await api.zeros((), device=d)

    def forward_backward(self, n_elements: int) -> trio_cuda.DeviceOp[Any]:
        """Forward, loss and backward of this shard into the preallocated buffers
        (``n_elements``: of the global batch's targets, the loss's mean is over them)."""
        w1, b1, w2, b2 = self.w
        gw1, gb1, gw2, gb2 = self.g
        h, y, dy, dh = self.h, self.y, self.dy, self.dh
        fwd = ops.linear(self.x, w1, b1, activation="relu", out=h).then(lambda h: ops.linear(h, w2, b2, out=y))
        err = fwd.then(lambda y: ops.subtract(y, self.t, out=dy))  # y - t, in dy
        loss = err.then(lambda e: ops.sum(e * e, out=self.loss))  # this shard's squared error
        grads = loss.then(
            lambda _: trio_cuda.zip(
                ops.multiply(dy, 2.0 / n_elements, out=dy).then(
                    lambda dy: trio_cuda.zip(
                        ops.matmul(dy.T, h, out=gw2),
                        ops.sum(dy, axis=0, out=gb2),
                        ops.matmul(dy, w2, out=dh).then(lambda dh: ops.where(h, dh, 0.0, out=dh)),
                    )
                )
            )
        )
        return grads.then(lambda _: trio_cuda.zip(ops.matmul(dh.T, self.x, out=gw1), ops.sum(dh, axis=0, out=gb1)))

    def update(self, lr: float) -> trio_cuda.DeviceOp[Any]:
        return trio_cuda.zip(*(ops.subtract(w, ops.multiply(g, lr), out=w) for w, g in zip(self.w, self.g, strict=True)))


def train_step(group: collectives.Group, replicas: list[Replica], n_global: int, lr: float) -> trio_cuda.DeviceOp[Any]:
    """One step on every device as one DAG (``n_global``: the global batch size)."""
    n_elements = n_global * int(replicas[0].t.shape[1])
    local = trio_cuda.zip(*(r.forward_backward(n_elements) for r in replicas))
    reduced = local.then(lambda _: trio_cuda.zip(*(group.all_reduce([r.g[k] for r in replicas]) for k in range(4))))
    return reduced.then(lambda _: trio_cuda.zip(*(r.update(lr) for r in replicas)))


async def build(
    devices: list[trio_cuda.Device], batch: int, features: int, hidden: int, outputs: int
) -> tuple[collectives.Group, list[Replica]]:
    """The group and one replica per device, each with its shard of the data and rank
    0's initialization (broadcast)."""
    n = len(devices)
    x, t = make_data(batch, features, outputs)
    weights = init_weights(features, hidden, outputs)
    group = collectives.Group(devices)
    replicas = [Replica(d) for d in devices]
    for r, xs, ts in zip(replicas, np.split(x, n), np.split(t, n), strict=True):
        await r.setup(weights, xs, ts, hidden)
    for k in range(4):  # rank 0's initialization everywhere
        await group.broadcast([r.w[k] for r in replicas], root=0)
    return group, replicas


async def train(
    group: collectives.Group,
    replicas: list[Replica],
    n_global: int,
    lr: float,
    steps: int,
    report: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """``steps`` training steps, each submitted without waiting for the one before: the
    next step's reads of the weights wait for this step's update on the device, so the
    host plans step k+1 while the GPUs run step k (at most two steps ahead, which bounds
    the memory in flight). ``report(step)`` runs after each submission."""
    in_flight: collections.deque[Any] = collections.deque()
    for step in range(1, steps + 1):
        in_flight.append(await lowlevel.submit(train_step(group, replicas, n_global, lr)))
        if len(in_flight) > 2:
            await in_flight.popleft().wait()
        if report is not None:
            await report(step)
    while in_flight:
        await in_flight.popleft().wait()


async def global_loss(group: collectives.Group, replicas: list[Replica], n_global: int, outputs: int) -> float:
    losses = await group.all_reduce([r.loss for r in replicas])
    return float(await losses[0].to_host()) / (n_global * outputs)


async def main() -> int:
    sim = trio_cuda.backend_name() == "sim"
    ap = argparse.ArgumentParser(description="data-parallel MLP training over NCCL")
    ap.add_argument("--steps", type=int, default=60 if sim else 300)
    ap.add_argument("--batch", type=int, default=96 if sim else 16384, help="global batch")
    ap.add_argument("--features", type=int, default=16 if sim else 1024)
    ap.add_argument("--hidden", type=int, default=32 if sim else 4096)
    ap.add_argument("--outputs", type=int, default=4 if sim else 256)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--devices", type=int, default=0, help="devices to use (0: all)")
    args = ap.parse_args()

    devices = trio_cuda.devices()[: args.devices or None]
    n = len(devices)
    if args.batch % n:
        raise SystemExit(f"--batch must be a multiple of the number of devices ({n})")
    group, replicas = await build(devices, args.batch, args.features, args.hidden, args.outputs)
    print(f"{n} device(s): {devices[0].name}; global batch {args.batch}, {args.features} -> {args.hidden} -> {args.outputs}")

    await train_step(group, replicas, args.batch, args.lr)
    first = await global_loss(group, replicas, args.batch, args.outputs)

    async def report(step: int) -> None:
        if step % 50 == 0:
            print(f"step {step}: loss {await global_loss(group, replicas, args.batch, args.outputs):.5f}")

    t0 = time.perf_counter()
    await train(group, replicas, args.batch, args.lr, args.steps - 1, report)
    elapsed = time.perf_counter() - t0
    final = await global_loss(group, replicas, args.batch, args.outputs)
    print(f"loss {first:.5f} -> {final:.5f}; {(args.steps - 1) / elapsed:.1f} steps/s on {n} device(s)")

    w0 = await replicas[0].w[0].to_host()
    others = [await r.w[0].to_host() for r in replicas[1:]]
    same = all(np.array_equal(w0, w) for w in others)
    group.close()
    if not same:
        print("WRONG: the replicas' weights differ")
        return 1
    if not final <= first / 2:
        print("WRONG: the loss did not fall to half")
        return 1
    print("correct")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
