"""Randomized stress: many tasks, random DAGs over shared tensors, random cancellations.

Every op updates a numpy model of the tensors at the moment it is submitted (a then()
callback runs inside the submission, under the runtime's lock, so the model sees the
true submission order). Work that was submitted runs to completion even if its await
was cancelled, so the model applies it too. Every read that completes must equal the
model's state at its submission, and so must the final contents of every tensor.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from typing import Any, Callable

import numpy as np
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda.kernels import add, saxpy, sleep

from .conftest import ON_CUDA, settle

SIZE = 16
N_TENSORS = 6
TASKS = 8
OPS_PER_TASK = int(os.environ.get("TRIO_CUDA_STRESS_OPS", "12"))
SEED = int(os.environ.get("TRIO_CUDA_STRESS_SEED", "20261129"))
SLOW_NS = 3_000_000 if ON_CUDA else 20_000_000


async def test_random_dags_match_serial_numpy(dev: trio_cuda.Device) -> None:
    await trio.to_thread.run_sync(settle)
    baseline_tracked = dev.memory_in_use()
    baseline_free = dev.mem_info()[0]

    model = [np.arange(SIZE, dtype=np.int64) * (k + 1) for k in range(N_TENSORS)]
    tensors = [await api.from_host(m.copy()) for m in model]
    reads_checked = 0
    submitted = 0
    cancelled_in_flight = 0

    def at_submission(update: Callable[[], Any], op_factory: Callable[[], trio_cuda.DeviceOp]) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        # The callback runs during submission, in submission order.
        def cb(_: object) -> Any:
            nonlocal submitted
            submitted += 1
            expected = update()
            return op_factory().map(lambda v: (v, expected))

        return trio_cuda.value(None).then(cb)

    def random_op(r: random.Random) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        kind = r.choice(["saxpy", "add", "copy", "read", "dup_read", "slow_saxpy", "fan"])
        i, j, k = r.sample(range(N_TENSORS), 3)
        a = r.choice([-1, 1, 2, 3])
        ti, tj, tk = tensors[i], tensors[j], tensors[k]
        if kind == "saxpy":
            def upd() -> None:
                model[j] = a * model[i] + model[j]
            return at_submission(upd, lambda: saxpy(a, ti, tj.partition((4,))))
        if kind == "add":
            def upd() -> None:
                model[k] = model[i] + model[j]
            return at_submission(upd, lambda: add(tk.partition((8,)), ti, tj))
        if kind == "copy":
            def upd() -> None:
                model[j] = model[i].copy()
            return at_submission(upd, lambda: api.memcpy(tj, ti))
        if kind == "read":
            return at_submission(lambda: model[i].copy(), lambda: ti.to_host())
        if kind == "dup_read":
            return at_submission(lambda: model[i].copy(), lambda: api.dup(ti).to_host())
        if kind == "slow_saxpy":
            def upd() -> None:
                model[j] = a * model[i] + model[j]
            return at_submission(
                upd, lambda: sleep(api.zeros((1,), np.int32).partition((1,)), SLOW_NS).then(lambda _: saxpy(a, ti, tj.partition((16,))))
            )
        # fan: two independent branches in one submission, then a read of one of them
        def upd() -> np.ndarray:
            model[j] = a * model[i] + model[j]
            model[k] = model[i] + model[i]
            return model[j].copy()
        return at_submission(
            upd,
            lambda: trio_cuda.zip(saxpy(a, ti, tj.partition((4,))), add(tk.partition((4,)), ti, ti)).then(lambda _: tj.to_host()),
        )

    async def task(tid: int) -> None:
        nonlocal reads_checked, cancelled_in_flight
        r = random.Random(SEED * 100 + tid)
        for _ in range(OPS_PER_TASK):
            op = random_op(r)
            timeout = r.choice([None, None, None, 0.0, 0.0005, 0.002, 0.01])
            scope = trio.move_on_after(timeout) if timeout is not None else contextlib.nullcontext()
            with scope as s:
                value, expected = await op
                if isinstance(value, np.ndarray):
                    np.testing.assert_array_equal(value, expected)
                    reads_checked += 1
            if s is not None and s.cancelled_caught and op._state is not None:
                cancelled_in_flight += 1

    async with trio.open_nursery() as n:
        for tid in range(TASKS):
            n.start_soon(task, tid)

    for t, m in zip(tensors, model):
        np.testing.assert_array_equal(await t.to_host(), m)
    assert submitted > TASKS * OPS_PER_TASK // 2
    assert reads_checked > 0
    assert cancelled_in_flight > 0, "no await was cancelled after submission: the test lost its point"

    tensors.clear()
    del t
    gc.collect()
    await trio.to_thread.run_sync(settle)
    assert dev.memory_in_use() == baseline_tracked
    if not ON_CUDA:
        assert dev.mem_info()[0] == baseline_free
