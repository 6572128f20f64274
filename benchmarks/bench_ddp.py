"""Data-parallel MLP training: examples/train_mlp_ddp.py against PyTorch DDP, same
model, sizes and per-device batch, on 1 and on every device (issue 10 targets).

trio-cuda: one process, a collectives.Group over the devices, one DAG per step (forward,
backward, four NCCL all-reduces, SGD), submitted up to two steps ahead. PyTorch: one
process per GPU (torch.multiprocessing), DistributedDataParallel over NCCL, the same
2-layer MLP (nn.Linear, ReLU, nn.Linear), MSE loss, SGD, float32 without TF32 on both.
Steps/s after a warm-up; the global batch grows with the devices (per-device batch
fixed), so the scaling figure is (samples/s on N devices) / (samples/s on 1).

Targets: trio steps/s within 10% of PyTorch DDP; 2-GPU scaling >= 1.8x.
Prints a table and writes ``ddp-<date>.md`` / ``.json`` under ``--out``. Needs CUDA and PyTorch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np
import trio

import trio_cuda

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from train_mlp_ddp import build, global_loss, make_data, train, train_step


async def trio_run(ndev: int, per_device: int, f: int, h: int, o: int, steps: int, lr: float) -> tuple[float, float]:
    devices = trio_cuda.devices()[:ndev]
    batch = per_device * ndev
    group, replicas = await build(devices, batch, f, h, o)
    for _ in range(5):  # warm-up: kernels compiled, cuBLASLt plans, NCCL connected
        await train_step(group, replicas, batch, lr)
    t0 = time.perf_counter()
    await train(group, replicas, batch, lr, steps)
    rate = steps / (time.perf_counter() - t0)
    loss = await global_loss(group, replicas, batch, o)
    group.close()
    return rate, loss


def _torch_worker(rank: int, world: int, per_device: int, f: int, h: int, o: int, steps: int, lr: float, q: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    x, t = make_data(per_device * world, f, o)
    xs = torch.from_numpy(np.split(x, world)[rank]).cuda()
    ts = torch.from_numpy(np.split(t, world)[rank]).cuda()
    model = torch.nn.Sequential(torch.nn.Linear(f, h), torch.nn.ReLU(), torch.nn.Linear(h, o)).cuda()
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    loss_fn = torch.nn.MSELoss()

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(xs), ts)
        loss.backward()
        opt.step()
        return loss

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    rate = steps / (time.perf_counter() - t0)
    if rank == 0:
        q.put((rate, float(loss.detach())))
    dist.destroy_process_group()


def torch_run(ndev: int, per_device: int, f: int, h: int, o: int, steps: int, lr: float) -> tuple[float, float]:
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29500 + ndev)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_torch_worker, args=(ndev, per_device, f, h, o, steps, lr, q), nprocs=ndev, start_method="spawn")
    return q.get(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-device", type=int, default=8192, help="batch per device")
    ap.add_argument("--features", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--outputs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if trio_cuda.backend_name() != "cuda":
        raise SystemExit("bench_ddp.py needs CUDA (and PyTorch)")
    sizes = (args.per_device, args.features, args.hidden, args.outputs, args.steps, args.lr)
    counts = sorted({1, trio_cuda.device_count()})
    rows = []
    for n in counts:
        tr, tl = trio.run(trio_run, n, *sizes)
        pr, pl = torch_run(n, *sizes)
        rows.append({"devices": n, "trio_steps_s": tr, "torch_steps_s": pr, "trio_loss": tl, "torch_loss": pl})
        print(f"{n} device(s): trio-cuda {tr:.1f} steps/s, PyTorch DDP {pr:.1f} steps/s, ratio {tr / pr:.3f}", flush=True)
    # per GPU and step: forward 2BP, weight gradients 2BP, and the input gradient of the
    # second layer only (2B h o; nothing needs the first layer's)
    params = args.features * args.hidden + args.hidden * args.outputs
    flops = 4 * args.per_device * params + 2 * args.per_device * args.hidden * args.outputs
    lines = [
        "| devices | trio-cuda steps/s | PyTorch DDP steps/s | ratio (target >= 0.9) | trio TFLOP/s per GPU |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['devices']} | {r['trio_steps_s']:.1f} | {r['torch_steps_s']:.1f} | "
            f"{r['trio_steps_s'] / r['torch_steps_s']:.3f} | {flops * r['trio_steps_s'] / 1e12:.1f} |"
        )
    notes = []
    if len(rows) > 1:
        n = rows[-1]["devices"]
        for who, key in (("trio-cuda", "trio_steps_s"), ("PyTorch DDP", "torch_steps_s")):
            scale = n * rows[-1][key] / rows[0][key]
            notes.append(f"- {who}: {n}-GPU scaling (samples/s vs 1 GPU) {scale:.2f}x (target >= 1.8x for trio-cuda)")
    day = dt.date.today().isoformat()
    text = (
        f"# Data-parallel MLP training vs PyTorch DDP ({day})\n\nGPU: {trio_cuda.device(0).name}; per-device batch "
        f"{args.per_device}, {args.features} -> {args.hidden} -> {args.outputs}, float32 (no TF32), {args.steps} timed steps.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n".join(notes)
        + "\n"
    )
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"ddp-{day}.md").write_text(text)
        (args.out / f"ddp-{day}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
