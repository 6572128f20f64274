"""A data-parallel MLP forward pass over every device, one DAG per shard, awaited once.

The reference's async MLP: the weights of a 2-layer MLP are uploaded once and ``dup``'d
to every device; the batch is split across the devices and, on each device, across
several trio tasks; each task runs its shard's whole forward pass

    upload x -> linear(x, W1, b1, relu) -> linear(., W2, b2) -> read back

as one DAG awaited once, inside a nursery. The result is checked against numpy. On a
GPU it then times the forward pass with the shards already on their devices, on one
device and on all of them, prints the speed-up, and the time of a whole batch with its
uploads and read-backs (the layers run on cuBLASLt with the bias and relu fused;
float32, no TF32).

On the simulated device the sizes are small (the ops run their numpy twins there).

Usage: python examples/async_mlp.py [--batch B] [--features F] [--hidden H] [--tasks T] [--reps R]
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


async def upload_weights(host: list[np.ndarray], devices: list[trio_cuda.Device]) -> list[list[trio_cuda.Tensor]]:
    """The weights uploaded once (to the first device) and dup'd to every other one."""
    first = list(await trio_cuda.zip(*(api.from_host(w, device=devices[0]) for w in host)))
    copies = [first]
    for dev in devices[1:]:
        copies.append(list(await trio_cuda.zip(*(api.dup(w, device=dev) for w in first))))
    return copies


def forward(x: np.ndarray, w: list[trio_cuda.Tensor], device: trio_cuda.Device) -> trio_cuda.DeviceOp[np.ndarray]:
    """One shard's forward pass as one DAG (nothing runs until it is awaited)."""
    w1, b1, w2, b2 = w
    h = ops.linear(api.from_host(x, device=device), w1, b1, activation="relu")
    return ops.linear(h, w2, b2).to_host()


async def run(x: np.ndarray, weights: list[list[trio_cuda.Tensor]], devices: list[trio_cuda.Device], tasks: int) -> np.ndarray:
    """The whole batch: split over the devices, then over ``tasks`` tasks per device."""
    shards = np.array_split(x, len(devices) * tasks)
    out: list[Any] = [None] * len(shards)

    async def shard(i: int) -> None:
        d = i // tasks
        out[i] = await forward(shards[i], weights[d], devices[d])

    async with trio.open_nursery() as nursery:
        for i in range(len(shards)):
            nursery.start_soon(shard, i)
    return np.concatenate(out)


async def main() -> int:
    sim = trio_cuda.backend_name() == "sim"
    ap = argparse.ArgumentParser(description="data-parallel MLP forward pass")
    ap.add_argument("--batch", type=int, default=96 if sim else 32768)
    ap.add_argument("--features", type=int, default=24 if sim else 4096)
    ap.add_argument("--hidden", type=int, default=40 if sim else 8192)
    ap.add_argument("--tasks", type=int, default=2, help="tasks per device")
    ap.add_argument("--reps", type=int, default=0 if sim else 5, help="timed passes (GPU)")
    args = ap.parse_args()

    devices = trio_cuda.devices()
    rng = np.random.default_rng(0)
    f, hdim = args.features, args.hidden
    host = [
        (rng.standard_normal((hdim, f)) / np.sqrt(f)).astype(np.float32),  # W1 (out, in), as torch.nn.Linear
        (0.1 * rng.standard_normal(hdim)).astype(np.float32),
        (rng.standard_normal((f, hdim)) / np.sqrt(hdim)).astype(np.float32),
        (0.1 * rng.standard_normal(f)).astype(np.float32),
    ]
    x = rng.standard_normal((args.batch, f)).astype(np.float32)
    weights = await upload_weights(host, devices)
    print(f"{len(devices)} device(s): {devices[0].name}; batch {args.batch}, {f} -> {hdim} -> {f}, {args.tasks} tasks per device")

    y = await run(x, weights, devices, args.tasks)
    x64 = x.astype(np.float64)
    want = np.maximum(x64 @ host[0].T.astype(np.float64) + host[1], 0) @ host[2].T.astype(np.float64) + host[3]
    err = float(np.max(np.abs(y - want)) / np.max(np.abs(want)))
    print(f"max relative error against numpy: {err:.2e}")
    if y.shape != want.shape or err > 1e-4:
        print("WRONG: the result differs from numpy")
        return 1

    if args.reps:
        # the batch's shards uploaded once; each pass is the two GEMMs of every shard, one
        # DAG per shard awaited in its task (uploads and read-backs are host memory copies
        # that one host process shares between its GPUs: timed apart, they hide the GPUs)
        flops = 2 * 2 * args.batch * f * hdim
        times = {}
        for label, devs in (("1 device", devices[:1]), (f"{len(devices)} devices", devices)):
            shards = np.array_split(x, len(devs) * args.tasks)
            xs = [await api.from_host(sh, device=devs[i // args.tasks]) for i, sh in enumerate(shards)]

            async def one(i: int, devs: list[trio_cuda.Device] = devs, xs: list[Any] = xs) -> None:
                w1, b1, w2, b2 = weights[devices.index(devs[i // args.tasks])]
                await ops.linear(ops.linear(xs[i], w1, b1, activation="relu"), w2, b2)

            async def one_pass(n: int = len(xs), one: Any = one) -> None:
                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(one, i)

            await one_pass()  # warm-up
            t0 = time.perf_counter()
            for _ in range(args.reps):
                await one_pass()
            times[label] = (time.perf_counter() - t0) / args.reps
            print(f"{label}: {times[label] * 1e3:.1f} ms per pass ({flops / times[label] / 1e12:.1f} TFLOP/s)")
        t0 = time.perf_counter()
        await run(x, weights, devices, args.tasks)
        print(f"with uploads and read-backs, {len(devices)} device(s): {(time.perf_counter() - t0) * 1e3:.1f} ms per batch")
        if len(devices) > 1:
            print(f"speed-up on {len(devices)} devices over one: {times['1 device'] / times[f'{len(devices)} devices']:.2f}x")
    print("correct")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
