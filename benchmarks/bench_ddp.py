"""Data-parallel MLP training: examples/train_mlp_ddp.py against PyTorch DDP, same
model, sizes and per-device batch (issue 10 and issue 36 targets).

Two forms of trio-cuda's side, as the example has:

* one process (the default): a collectives.Group over the devices, one DAG per step for
  all of them, on 1 and on every device;
* one process per device (``--processes``), started by a launcher:
  ``mpiexec -n N python benchmarks/bench_ddp.py --processes`` or
  ``torchrun --nproc-per-node N benchmarks/bench_ddp.py --processes``: a
  collectives.ProcessGroup from the launcher's environment; every rank trains its
  shard, and rank 0 then runs PyTorch DDP on N GPUs of its host.

Each step: forward, backward, the gradients all-reduced in two buckets (layer 2's on a
side stream while layer 1's gradients are computed), SGD; submitted up to two steps
ahead. PyTorch: one process per GPU (torch.multiprocessing), DistributedDataParallel
over NCCL, the same 2-layer MLP (nn.Linear, ReLU, nn.Linear), MSE loss, SGD, float32
without TF32 on both. Steps/s after a warm-up; the global batch grows with the devices
(per-device batch fixed), so the scaling figure is (samples/s on N devices) / (samples/s
on 1).

Targets: trio steps/s within 10% of PyTorch DDP (one process per GPU: >= 0.95x on one
GPU); 2-GPU scaling >= 1.8x. Prints a table and writes ``ddp-<date>.md`` / ``.json``
under ``--out``. Needs CUDA and PyTorch, except ``--smoke`` (tiny sizes, a few steps,
on the simulated device too; the PyTorch peer only where CUDA and torch are).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np
import trio

import trio_cuda

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _results

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from train_mlp_ddp import build, build_process, global_loss, make_data, replicas_identical, train, train_step

from trio_cuda import api, collectives

# torchrun's variables for its workers: the PyTorch peer's own workers must not see them
# (they would join torchrun's store instead of their own rendezvous)
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
_LAUNCHER_VARS += ("ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")


WARMUP = 5  # steps: kernels compiled, cuBLASLt plans, NCCL connected


async def trio_run(ndev: int, per_device: int, f: int, h: int, o: int, steps: int, lr: float) -> tuple[float, float]:
    devices = trio_cuda.devices()[:ndev]
    batch = per_device * ndev
    group, replicas = await build(devices, batch, f, h, o)
    rate, loss = await _timed(group, replicas, batch, o, steps, lr)
    group.close()
    return rate, loss


async def _timed(group: Any, replicas: Any, batch: int, o: int, steps: int, lr: float) -> tuple[float, float]:
    """``steps`` training steps after the warm-up: steps/s, and the loss after them."""
    for _ in range(WARMUP):
        await train_step(group, replicas, batch, lr)
    t0 = time.perf_counter()
    await train(group, replicas, batch, lr, steps)
    rate = steps / (time.perf_counter() - t0)
    return rate, await global_loss(group, replicas, batch, o)


async def trio_rank(
    group: collectives.ProcessGroup, per_device: int, f: int, h: int, o: int, steps: int, lr: float
) -> tuple[list[float], float, bool]:
    """This rank's training in a process group: every rank's steps/s (gathered), the
    loss, and whether the replicas ended identical."""
    batch = per_device * group.nranks
    replicas = await build_process(group, batch, f, h, o)
    rate, loss = await _timed(group, replicas, batch, o, steps, lr)
    rates = await (await group.all_gather(api.from_host(np.array([rate]))))[0].to_host()
    same = await replicas_identical(group, replicas)
    return [float(r) for r in rates], loss, same


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

    for k in _LAUNCHER_VARS:
        os.environ.pop(k, None)
    for k in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        os.environ.pop(k)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29600 + ndev)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_torch_worker, args=(ndev, per_device, f, h, o, steps, lr, q), nprocs=ndev, start_method="spawn")
    return q.get(timeout=60)


def _peer_available() -> bool:
    if trio_cuda.backend_name() != "cuda":
        return False
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], form: str, notes: list[str]) -> str:
    # per GPU and step: forward 2BP, weight gradients 2BP, and the input gradient of the
    # second layer only (2B h o; nothing needs the first layer's)
    params = args.features * args.hidden + args.hidden * args.outputs
    flops = 4 * args.per_device * params + 2 * args.per_device * args.hidden * args.outputs
    target = 0.95 if args.processes else 0.9
    lines = [
        f"| devices | trio-cuda steps/s | PyTorch DDP steps/s | ratio (target >= {target}) | trio TFLOP/s per GPU |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        torch_rate = r["torch_steps_s"]
        ratio = f"{r['trio_steps_s'] / torch_rate:.3f}" if torch_rate else "(no peer)"
        lines.append(
            f"| {r['devices']} | {r['trio_steps_s']:.1f} | {f'{torch_rate:.1f}' if torch_rate else 'not run'} | {ratio} | "
            f"{flops * r['trio_steps_s'] / 1e12:.3g} |"
        )
    if len(rows) > 1 and all(r["torch_steps_s"] for r in rows):
        n = rows[-1]["devices"]
        for who, key in (("trio-cuda", "trio_steps_s"), ("PyTorch DDP", "torch_steps_s")):
            scale = n * rows[-1][key] / rows[0][key]
            notes.append(f"- {who}: {n}-GPU scaling (samples/s vs 1 GPU) {scale:.2f}x (target >= 1.8x for trio-cuda)")
    day = dt.date.today().isoformat()
    return (
        f"# Data-parallel MLP training vs PyTorch DDP ({day})\n\nDevice: {trio_cuda.device(0).name}; {form}; per-device batch "
        f"{args.per_device}, {args.features} -> {args.hidden} -> {args.outputs}, float32 (no TF32), {args.steps} timed steps.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n".join(notes)
        + "\n"
    )


def _write(args: argparse.Namespace, text: str, rows: list[dict[str, Any]]) -> None:
    _results.write(args.out, "ddp", text, rows)


def run_processes(args: argparse.Namespace, sizes: tuple[Any, ...]) -> int:
    """One process per device: this rank trains; rank 0 reports (and runs the peer)."""

    async def ranks() -> tuple[collectives.ProcessGroup, list[float], float, bool]:
        group = await collectives.ProcessGroup.from_env()
        try:
            return (group, *await trio_rank(group, *sizes))
        finally:
            group.close()

    group, rates, loss, same = trio.run(ranks)
    n = group.nranks
    if not same:
        print(f"WRONG: rank {group.rank}'s replicas differ", flush=True)
    if group.rank != 0:
        return 0 if same else 1
    notes = [
        f"- trio-cuda: {n} process(es) started by {group.launcher}, one device each; every rank's steps/s: "
        + ", ".join(f"{r:.1f}" for r in rates)
        + f"; loss {loss:.5f}; replicas identical: {same}"
    ]
    torch_rate = torch_loss = None
    if not _peer_available():
        notes.append("- PyTorch DDP: not run (needs CUDA and torch)")
    elif n > trio_cuda.device_count():
        notes.append(f"- PyTorch DDP: not run ({n} ranks, {trio_cuda.device_count()} GPUs on rank 0's host)")
    else:
        torch_rate, torch_loss = torch_run(n, *sizes)
    # the group's pace is its slowest rank's (every step ends in its all-reduces)
    rows = [{"devices": n, "trio_steps_s": min(rates), "torch_steps_s": torch_rate, "trio_loss": loss, "torch_loss": torch_loss}]
    if torch_rate:
        print(
            f"{n} process(es): trio-cuda {min(rates):.1f} steps/s, PyTorch DDP {torch_rate:.1f} steps/s, ratio {min(rates) / torch_rate:.3f}",
            flush=True,
        )
    _write(args, _report(args, rows, f"one process per device ({group.launcher})", notes), rows)
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-device", type=int, default=8192, help="batch per device")
    ap.add_argument("--features", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--outputs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--processes", action="store_true", help="one process per device, started by mpiexec/srun or torchrun")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps (runs on the simulated device)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.per_device, args.features, args.hidden, args.outputs, args.steps = 16, 16, 32, 4, 6
    elif trio_cuda.backend_name() != "cuda":
        raise SystemExit("bench_ddp.py needs CUDA (and PyTorch); --smoke runs on the simulated device")
    sizes = (args.per_device, args.features, args.hidden, args.outputs, args.steps, args.lr)
    if args.processes:
        return run_processes(args, sizes)
    counts = sorted({1, trio_cuda.device_count()})
    rows = []
    peer = _peer_available()
    for n in counts:
        tr, tl = trio.run(trio_run, n, *sizes)
        pr, pl = torch_run(n, *sizes) if peer else (None, None)
        rows.append({"devices": n, "trio_steps_s": tr, "torch_steps_s": pr, "trio_loss": tl, "torch_loss": pl})
        if pr:
            print(f"{n} device(s): trio-cuda {tr:.1f} steps/s, PyTorch DDP {pr:.1f} steps/s, ratio {tr / pr:.3f}", flush=True)
    notes = [] if peer else ["- PyTorch DDP: not run (needs CUDA and torch)"]
    _write(args, _report(args, rows, "one process, a collectives.Group over the devices", notes), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
