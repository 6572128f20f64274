"""Data-dependent pipelines and cancellation: a host round trip, the same on the device, and a cut.

The running example is soft thresholding, ``y = sign(x) * max(|x| - t, 0)`` written as
``relu(x - t) - relu(-x - t)``, where the threshold ``t = 0.5 * rms(x)`` comes from a
reduction of the same data, so the second step depends on the value of the first.

(a) **Through the host.** The reduction's result is read back (``to_host().map(...)``
    computes ``t`` on the host once the data is there), and the next ops take ``t`` as a
    scalar. That costs two submissions and a wait in between: a ``then`` callback cannot
    read the data, because callbacks run while the submission is planned, before any of
    its GPU work has run (``then`` over a ``to_host()`` value is refused for that reason).
(b) **On the device.** ``t`` stays a 0-d device tensor, shared by both uses and broadcast
    against ``x``: the whole computation, read-back included, is one submission awaited
    once. It must equal (a) element for element, and both must match numpy.
(c) **Cancellation.** A pipeline of ``--steps`` steps, each three chained ops awaited once
    (``(x * 2 + 2) * 0.5``, which adds exactly 1), runs in a task started with
    ``nursery.start``; the task hands back its cancel scope, and the parent cancels it
    once the pipeline reports half of its steps done (an event, no sleeps). Steps not yet
    submitted never run. A step in flight completes on the device anyway; its await ends
    with ``Cancelled`` if it was still waiting, or returns if the work was done when the
    await ended (on a GPU a tiny step can be, so a step or two may complete after the
    halfway mark). Afterwards the last completed step holds exactly
    ``x0 + completed``, the device still computes correctly, and once the dropped
    tensors are freed its memory in use (``Device.memory_in_use()``) is back to the
    baseline taken before the pipeline.

Runs on a GPU or on the simulated device. Exits non-zero if any check fails.

Usage: python examples/async_and_then.py [--rows R] [--cols C] [--steps S] [--seed N]
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, ops

HALF = np.float32(0.5)  # t = HALF * rms(x); a float32 scalar, so both paths round alike


def shrink(x: Any, t: Any) -> trio_cuda.DeviceOp[Any]:
    """``sign(x) * max(|x| - t, 0)`` as ops; ``t`` a scalar, a tensor or a (shared) op."""
    return ops.relu(x - t) - ops.relu(-x - t)


async def through_host(x: trio_cuda.Tensor) -> tuple[np.ndarray, float, int]:
    """(a): the threshold goes to the host and comes back as a scalar. Returns the
    result, the threshold and the number of submissions."""
    dev = trio_cuda.current_device()
    before = dev.statistics().submissions
    # map runs on the host once the mean is there; then would be refused here.
    t = await ops.mean(x * x).to_host().map(lambda ms: HALF * np.sqrt(ms))
    y = await shrink(x, t).to_host()  # a launch that depends on a host value
    return y, float(t), dev.statistics().submissions - before


async def on_device(x: trio_cuda.Tensor) -> tuple[np.ndarray, int]:
    """(b): the threshold stays on the device. Returns the result and the number of
    submissions (one)."""
    dev = trio_cuda.current_device()
    before = dev.statistics().submissions
    t = (ops.sqrt(ops.mean(x * x)) * HALF).shared()  # a 0-d tensor, used twice
    y = await shrink(x, t).to_host()
    return y, dev.statistics().submissions - before


def settle() -> None:
    """Collect garbage and let the device finish and free what was dropped (plain code:
    run it with ``trio.to_thread.run_sync``)."""
    gc.collect()
    trio_cuda.current_device().synchronize()


async def pipeline(
    x: trio_cuda.Tensor,
    steps: int,
    halfway: trio.Event,
    state: dict[str, Any],
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Add 1 to ``x`` ``steps`` times, one small DAG awaited per step, under a cancel scope
    handed to the parent. ``state`` gets the last completed tensor and the step count."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        for i in range(steps):
            x = await ((x * 2.0 + 2.0) * 0.5)  # three chained ops: exactly x + 1
            state["x"], state["completed"] = x, i + 1
            if i + 1 == steps // 2:
                halfway.set()


async def cancel_halfway(rows: int, cols: int, steps: int) -> bool:
    """(c): cut a long pipeline half-way; check the data, the device and its memory (the
    baseline includes the tensors the caller holds)."""
    dev = trio_cuda.current_device()
    await trio.to_thread.run_sync(settle)
    baseline = dev.memory_in_use()

    start = (np.arange(rows * cols) % 4096).astype(np.float32).reshape(rows, cols)  # + steps stays exact
    x0 = await api.from_host(start)
    halfway = trio.Event()
    state: dict[str, Any] = {"x": x0, "completed": 0}
    async with trio.open_nursery() as nursery:
        scope = await nursery.start(pipeline, x0, steps, halfway, state)
        await halfway.wait()
        scope.cancel()
    completed = state["completed"]
    print(f"(c) pipeline of {steps} steps ({3 * steps} ops) cancelled after {completed} completed steps")
    ok = steps // 2 <= completed < steps and bool(scope.cancelled_caught)

    expected = start + np.float32(completed)
    last = await state["x"].to_host()
    data_ok = bool(np.array_equal(last, expected))
    print(f"    last completed step holds x0 + {completed}: {'ok' if data_ok else 'WRONG'}")

    small = await (api.arange(8) * 3.0 + 1.0).to_host()
    works = bool(np.array_equal(small, 3 * np.arange(8, dtype=np.float32) + 1))
    print(f"    the device still works after the cancel: {'ok' if works else 'WRONG'}")

    del x0, state, last
    await trio.to_thread.run_sync(settle)
    in_use = dev.memory_in_use()
    memory_ok = in_use == baseline
    print(f"    device memory in use: {in_use} bytes, baseline {baseline}: {'ok' if memory_ok else 'WRONG'}")
    return ok and data_ok and works and memory_ok


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--steps", type=int, default=400, help="pipeline steps of (c), three ops each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rows < 1 or args.cols < 1 or not 2 <= args.steps <= 1 << 20:
        parser.error("--rows and --cols must be positive, --steps between 2 and 2**20")

    print(f"on {trio_cuda.current_device().name} ({trio_cuda.backend_name()}), x: {args.rows}x{args.cols} float32")
    x_host = np.random.default_rng(args.seed).standard_normal((args.rows, args.cols), dtype=np.float32)
    x = await api.from_host(x_host)

    y_host, t, subs_host = await through_host(x)
    print(f"(a) threshold read to the host: t = {t:.6f}; {subs_host} submissions")
    y_dev, subs_dev = await on_device(x)
    print(f"(b) threshold kept on the device: {subs_dev} submission")

    x64 = x_host.astype(np.float64)
    t_ref = 0.5 * np.sqrt(np.mean(x64 * x64))
    y_ref = np.sign(x64) * np.maximum(np.abs(x64) - t_ref, 0.0)
    same = bool(np.array_equal(y_host, y_dev))
    numpy_ok = bool(np.allclose(y_host, y_ref, rtol=1e-5, atol=1e-5)) and abs(t - t_ref) <= 1e-5 * t_ref
    print(f"    (b) equals (a) element for element: {'ok' if same else 'WRONG'}")
    print(f"    (a) matches numpy (max |error| {float(np.abs(y_host - y_ref).max()):.2g}): {'ok' if numpy_ok else 'WRONG'}")
    ok = same and numpy_ok and subs_dev == 1 and subs_host == 2

    ok = await cancel_halfway(args.rows, args.cols, args.steps) and ok
    print("correct" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
