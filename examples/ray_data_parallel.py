"""Data-parallel MLP training with Ray: one trio worker actor per GPU.

Ray places the workers (an actor each, one GPU each: Ray sets CUDA_VISIBLE_DEVICES, so
each worker sees its GPU as device 0) and hands every one the same key-value store, a
Ray actor too. Each worker runs trio and joins a collectives.ProcessGroup through that
store (``ProcessGroup.from_store``): rank 0's NCCL unique id passes through Ray, and on
the simulated device (each worker with a simulated device of its own) so do the
collectives' data. Then every worker trains its shard of the batch with
examples/train_mlp_ddp.py's step (bucketed gradient all-reduces overlapped with the
backward pass) and returns its weights; the driver checks that the loss fell to half or
less and that every replica's weights are bitwise the same.

Usage: python examples/ray_data_parallel.py [--workers N] [--steps S] [--address ADDR]
(without --address: a Ray instance on this machine; ``--address auto``: the running
cluster, across hosts). Needs Ray: pip install 'trio-cuda[ray]'.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import numpy as np
import ray

EXAMPLES = pathlib.Path(__file__).resolve().parent


@ray.remote
class Store:
    """Keys and values in a Ray actor: what the workers' ProcessGroup passes between
    them (its calls run one at a time, so add() is atomic)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        n = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(n).encode()
        return n

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class RayStore:
    """torch.distributed.Store's methods (what ProcessGroup.from_store takes) over a
    Store actor. The group calls them from a worker thread: each waits for its answer."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def set(self, key: str, value: bytes) -> None:
        ray.get(self.actor.set.remote(key, value))

    def get(self, key: str) -> bytes:
        return bytes(ray.get(self.actor.get.remote(key)))

    def check(self, keys: list[str]) -> bool:
        return bool(ray.get(self.actor.check.remote(list(keys))))

    def add(self, key: str, amount: int) -> int:
        return int(ray.get(self.actor.add.remote(key, amount)))

    def delete_key(self, key: str) -> bool:
        return bool(ray.get(self.actor.delete_key.remote(key)))


class Worker:
    """One rank: a process of its own with one device, trio inside."""

    def train(self, store: Any, world: int, rank: int, sizes: dict[str, Any]) -> dict[str, Any]:
        import trio

        return trio.run(self._train, RayStore(store), world, rank, sizes)

    async def _train(self, store: RayStore, world: int, rank: int, sizes: dict[str, Any]) -> dict[str, Any]:
        sys.path.insert(0, str(EXAMPLES))
        from train_mlp_ddp import build_process, global_loss, train, train_step

        from trio_cuda import collectives

        group = await collectives.ProcessGroup.from_store(store, world, rank, timeout=120)
        batch, outputs, lr = sizes["batch"], sizes["outputs"], sizes["lr"]
        replicas = await build_process(group, batch, sizes["features"], sizes["hidden"], outputs)
        await train_step(group, replicas, batch, lr)
        first = await global_loss(group, replicas, batch, outputs)
        await train(group, replicas, batch, lr, sizes["steps"] - 1)
        final = await global_loss(group, replicas, batch, outputs)
        weights = [await wb.to_host() for wb in replicas[0].wb]
        device = replicas[0].device.name
        group.close()
        return {"rank": rank, "first": first, "final": final, "weights": weights, "device": device}


def main() -> int:
    ap = argparse.ArgumentParser(description="data-parallel MLP training, one Ray worker actor per GPU")
    ap.add_argument("--workers", type=int, default=0, help="ranks (0: one per GPU Ray sees, or 2 without GPUs)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=96, help="global batch")
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--outputs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--address", default=None, help="a Ray cluster to join ('auto': the running one)")
    args = ap.parse_args()

    # each worker sees one simulated device of its own where there is no GPU
    env = {"TRIO_CUDA_SIM_DEVICES": "1"}
    if args.address is None:
        ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    else:
        ray.init(address=args.address, runtime_env={"env_vars": env})
    gpus = int(ray.cluster_resources().get("GPU", 0))
    world = args.workers or gpus or 2
    if args.batch % world:
        raise SystemExit(f"--batch must be a multiple of the number of workers ({world})")
    store = Store.remote()
    actor = ray.remote(num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1)(Worker)
    workers = [actor.remote() for _ in range(world)]
    sizes = {k: getattr(args, k) for k in ("batch", "features", "hidden", "outputs", "lr", "steps")}
    results = sorted(ray.get([w.train.remote(store, world, r, sizes) for r, w in enumerate(workers)]), key=lambda r: r["rank"])
    ray.shutdown()

    first, final = results[0]["first"], results[0]["final"]
    print(f"{world} Ray workers on {results[0]['device']}: loss {first:.5f} -> {final:.5f}")
    same = all(np.array_equal(a, b) for r in results[1:] for a, b in zip(results[0]["weights"], r["weights"], strict=True))
    sys.path.insert(0, str(EXAMPLES))
    from train_mlp_ddp import verdict

    wrong = verdict(same, first, final)
    if wrong is not None:
        print(f"WRONG: {wrong}")
        return 1
    print("correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
