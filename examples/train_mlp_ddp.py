"""Data-parallel training of a 2-layer MLP across every device, gradients all-reduced
through NCCL as a DeviceOp.

Each device holds a replica of the weights (broadcast from rank 0 at the start) and its
shard of every batch. Two forms: one process driving every device (a collectives.Group;
the default), or one process per device started by a launcher (``--processes``: a
collectives.ProcessGroup joined from the launcher's environment), e.g.

    mpiexec -n 2 python examples/train_mlp_ddp.py --processes
    torchrun --nproc-per-node 2 examples/train_mlp_ddp.py --processes

One training step is one DAG over this process's devices, submitted without waiting for
the step before it (the weights it reads order it after the previous step's update, on
every stream, automatically):

    forward     h = relu(x @ W1^T + b1);  y = h @ W2^T + b2
    loss        mean((y - t)^2) over the global batch and the outputs (torch's MSELoss)
    backward    dy = 2 (y - t) / (N * outputs);  dW2 = dy^T h;  db2 = sum(dy);  dh = (dy @ W2) * (h > 0)
                dW1 = dh^T x;  db1 = sum(dh)
    all-reduce  the gradients in two buckets, summed over the devices: layer 2's bucket
                on a side stream while layer 1's gradients are computed
    update      W -= lr * dW (SGD), per bucket

The data is a fixed random teacher network plus noise; the loss must fall to half or less
(the program exits 1 otherwise) and the replicas must stay identical. On a GPU the
program also prints steps/s; benchmarks/bench_ddp.py compares it with PyTorch DDP.

Usage: python examples/train_mlp_ddp.py [--steps S] [--batch B] [--features F] [--hidden H] [--devices D | --processes]
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


def _bucket_layout(shapes: list[tuple[int, ...]]) -> tuple[list[int], int]:
    """Offsets of tensors packed in one flat buffer, each 256-byte aligned (as cuBLASLt
    likes its operands), and the buffer's length (float32 elements)."""
    offsets, n = [], 0
    for shape in shapes:
        offsets.append(n)
        n += -(-int(np.prod(shape)) // 64) * 64
    return offsets, n


# The gradient buckets, in the order the backward pass finishes them: layer 2's
# (W2, b2) first, then layer 1's (W1, b1); each bucket is one flat buffer, all-reduced
# by one collective (as PyTorch DDP's buckets).
BUCKETS = ((2, 3), (0, 1))


class Replica:
    """One device's weights, gradients, activations and data shard (all allocated once).

    The weights and gradients live in one flat buffer per bucket (``wb``, ``gb``); the
    tensors ``w[k]``, ``g[k]`` are views into them."""

    def __init__(self, device: trio_cuda.Device) -> None:
        self.device = device

    async def setup(self, weights: list[np.ndarray], x: np.ndarray, t: np.ndarray, hidden: int, offset: float) -> None:
        d = self.device
        b, o = t.shape
        # every replica starts from its own (different) initialization (``offset``): the
        # broadcast from rank 0 is what makes them equal
        self.w: list[Any] = [None] * 4
        self.g: list[Any] = [None] * 4
        self.wb, self.gb = [], []
        for bucket in BUCKETS:
            offsets, n = _bucket_layout([weights[k].shape for k in bucket])
            flat = np.zeros(n, np.float32)
            for k, off in zip(bucket, offsets, strict=True):
                flat[off : off + weights[k].size] = weights[k].ravel() + np.float32(offset)
            wb, gb = await trio_cuda.zip(api.from_host(flat, device=d), api.zeros((n,), device=d))
            self.wb.append(wb)
            self.gb.append(gb)
            for k, off in zip(bucket, offsets, strict=True):
                shape, size = weights[k].shape, weights[k].size
                self.w[k] = wb[off : off + size].reshape(shape)
                self.g[k] = gb[off : off + size].reshape(shape)
        self.x, self.t = await trio_cuda.zip(api.from_host(x, device=d), api.from_host(t, device=d))
        self.h, self.y, self.dh = await trio_cuda.zip(
            api.zeros((b, hidden), device=d), api.zeros((b, o), device=d), api.zeros((b, hidden), device=d)
        )
        self.dy = await api.zeros((b, o), device=d)
        self.loss = await api.zeros((), device=d)

    def head(self, n_elements: int) -> trio_cuda.DeviceOp[Any]:
        """Forward, loss and the backward pass of layer 2 (its gradients: bucket 0, and
        dh) into the preallocated buffers (``n_elements``: of the global batch's targets,
        the loss's mean is over them)."""
        w1, b1, w2, b2 = self.w
        _, _, gw2, gb2 = self.g
        h, y, dy, dh = self.h, self.y, self.dy, self.dh
        fwd = ops.linear(self.x, w1, b1, activation="relu", out=h).then(lambda h: ops.linear(h, w2, b2, out=y))
        err = fwd.then(lambda y: ops.subtract(y, self.t, out=dy))  # y - t, in dy
        loss = err.then(lambda e: ops.sum(e * e, out=self.loss))  # this shard's squared error
        return loss.then(
            lambda _: ops.multiply(dy, 2.0 / n_elements, out=dy).then(
                lambda dy: trio_cuda.zip(
                    ops.matmul(dy.T, h, out=gw2),
                    ops.sum(dy, axis=0, out=gb2),
                    ops.matmul(dy, w2, out=dh).then(lambda dh: ops.where(h, dh, 0.0, out=dh)),
                )
            )
        )

    def tail(self) -> trio_cuda.DeviceOp[Any]:
        """The backward pass of layer 1 (bucket 1)."""
        gw1, gb1 = self.g[0], self.g[1]
        return trio_cuda.zip(ops.matmul(self.dh.T, self.x, out=gw1), ops.sum(self.dh, axis=0, out=gb1))

    def update(self, bucket: int, lr: float) -> trio_cuda.DeviceOp[Any]:
        """SGD on one bucket's weights: ``W -= lr * dW``, over the flat buffers."""
        return ops.subtract(self.wb[bucket], ops.multiply(self.gb[bucket], lr), out=self.wb[bucket])


Groups = collectives.Group | collectives.ProcessGroup


def train_step(group: Groups, replicas: list[Replica], n_global: int, lr: float) -> trio_cuda.DeviceOp[Any]:
    """One step of this process's replicas (every device's with a Group, this rank's with
    a ProcessGroup) as one DAG (``n_global``: the global batch size).

    Bucket 0's all-reduce and update are the second branch of a zip, so they run on a
    side stream while the first branch computes layer 1's gradients on the main one;
    bucket 1's all-reduce and update follow those."""
    n_elements = n_global * int(replicas[0].t.shape[1])

    def reduce(bucket: int) -> trio_cuda.DeviceOp[Any]:
        return group.all_reduce([r.gb[bucket] for r in replicas]).then(
            lambda _: trio_cuda.zip(*(r.update(bucket, lr) for r in replicas))
        )

    head = trio_cuda.zip(*(r.head(n_elements) for r in replicas))
    return head.then(lambda _: trio_cuda.zip(trio_cuda.zip(*(r.tail() for r in replicas)).then(lambda _: reduce(1)), reduce(0)))


async def build(
    devices: list[trio_cuda.Device], batch: int, features: int, hidden: int, outputs: int
) -> tuple[collectives.Group, list[Replica]]:
    """The one-process form: the group and one replica per device, each with its shard
    of the data and rank 0's initialization (broadcast)."""
    n = len(devices)
    x, t = make_data(batch, features, outputs)
    weights = init_weights(features, hidden, outputs)
    group = collectives.Group(devices)
    replicas = [Replica(d) for d in devices]
    for i, (r, xs, ts) in enumerate(zip(replicas, np.split(x, n), np.split(t, n), strict=True)):
        await r.setup(weights, xs, ts, hidden, offset=i)
    for b in range(len(BUCKETS)):  # rank 0's initialization everywhere
        await group.broadcast([r.wb[b] for r in replicas], root=0)
    return group, replicas


async def build_process(group: collectives.ProcessGroup, batch: int, features: int, hidden: int, outputs: int) -> list[Replica]:
    """The one-process-per-device form (started by mpirun/mpiexec/srun, torchrun or
    Ray): this rank's one replica, with its shard of the data and rank 0's weights."""
    n, rank = group.nranks, group.rank
    if batch % n:
        group.close()
        raise SystemExit(f"--batch must be a multiple of the number of processes ({n})")
    x, t = make_data(batch, features, outputs)
    replica = Replica(group.devices[0])
    await replica.setup(init_weights(features, hidden, outputs), np.split(x, n)[rank], np.split(t, n)[rank], hidden, offset=rank)
    for b in range(len(BUCKETS)):
        await group.broadcast(replica.wb[b], root=0)
    return [replica]


async def train(
    group: Groups,
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


async def global_loss(group: Groups, replicas: list[Replica], n_global: int, outputs: int) -> float:
    losses = await group.all_reduce([r.loss for r in replicas])
    return float(await losses[0].to_host()) / (n_global * outputs)


async def replicas_identical(group: Groups, replicas: list[Replica]) -> bool:
    """Whether every replica's weights are bitwise those of rank 0 (in a ProcessGroup:
    every rank's, gathered to every rank)."""
    if isinstance(group, collectives.ProcessGroup):
        for wb in replicas[0].wb:
            every = np.split(await (await group.all_gather(wb))[0].to_host(), group.nranks)
            if not all(np.array_equal(every[0], w) for w in every[1:]):
                return False
        return True
    for b in range(len(BUCKETS)):
        every = [await r.wb[b].to_host() for r in replicas]
        if not all(np.array_equal(every[0], w) for w in every[1:]):
            return False
    return True


def verdict(same: bool, first: float, final: float) -> str | None:
    """What is wrong with a data-parallel run, or None: the replicas must end identical
    and the loss at most half its first value."""
    if not same:
        return "the replicas' weights differ"
    if not final <= first / 2:
        return "the loss did not fall to half"
    return None


async def main() -> int:
    sim = trio_cuda.backend_name() == "sim"
    ap = argparse.ArgumentParser(description="data-parallel MLP training over NCCL")
    ap.add_argument("--steps", type=int, default=60 if sim else 300)
    ap.add_argument("--batch", type=int, default=96 if sim else 16384, help="global batch")
    ap.add_argument("--features", type=int, default=16 if sim else 1024)
    ap.add_argument("--hidden", type=int, default=32 if sim else 4096)
    ap.add_argument("--outputs", type=int, default=4 if sim else 256)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--devices", type=int, default=0, help="devices to use (0: all; the one-process form)")
    ap.add_argument("--processes", action="store_true", help="one process per device, started by mpirun/mpiexec/srun or torchrun")
    args = ap.parse_args()

    group: Groups
    if args.processes:
        group = await collectives.ProcessGroup.from_env()
        replicas = await build_process(group, args.batch, args.features, args.hidden, args.outputs)
        n, lead, where = group.nranks, group.rank == 0, f"{group.nranks} process(es) ({group.launcher})"
    else:
        devices = trio_cuda.devices()[: args.devices or None]
        n = len(devices)
        if args.batch % n:
            raise SystemExit(f"--batch must be a multiple of the number of devices ({n})")
        group, replicas = await build(devices, args.batch, args.features, args.hidden, args.outputs)
        lead, where = True, f"{n} device(s)"
    say = print if lead else (lambda *a, **k: None)
    say(f"{where}: {replicas[0].device.name}; global batch {args.batch}, {args.features} -> {args.hidden} -> {args.outputs}")

    await train_step(group, replicas, args.batch, args.lr)
    first = await global_loss(group, replicas, args.batch, args.outputs)

    async def report(step: int) -> None:
        if step % 50 == 0:
            say(f"step {step}: loss {await global_loss(group, replicas, args.batch, args.outputs):.5f}")

    t0 = time.perf_counter()
    await train(group, replicas, args.batch, args.lr, args.steps - 1, report)
    elapsed = time.perf_counter() - t0
    final = await global_loss(group, replicas, args.batch, args.outputs)
    say(f"loss {first:.5f} -> {final:.5f}; {(args.steps - 1) / elapsed:.1f} steps/s on {where}")

    same = await replicas_identical(group, replicas)
    group.close()
    wrong = verdict(same, first, final)
    if wrong is not None:
        print(f"WRONG: {wrong}")
        return 1
    say("correct")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
