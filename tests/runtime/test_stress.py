"""Randomized stress: many tasks, random DAGs over shared tensors, random cancellations.

Every op updates a numpy model of the tensors at the moment it is submitted (a then()
callback runs while the submission is planned, under the runtime's lock; with kernels
compiled and staging memory pinned up front, no submission waits between planning and
enqueueing, so the model sees the true submission order; the test checks that no
submission waited). Work that was submitted runs to completion even if its await was
cancelled, so the model applies it too. Every read that completes must equal the
model's state at its submission, and so must the final contents of every tensor.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, saxpy, sleep

from ..helpers.devices import ON_CUDA, settle

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
    # Warm-up: every kernel signature loaded, staging pinned (no waits before enqueueing).
    w = await api.zeros((SIZE,), np.int64)
    for tile in (4, 8, 16):
        await saxpy(1, w, w.partition((tile,)))
        await add(w.partition((tile,)), w, w)
    await sleep(api.zeros((1,), np.int32).partition((1,)), 1000)
    await trio_cuda.zip(*[w.to_host() for _ in range(8)])
    del w
    waits_before = lowlevel.submission_statistics()

    def at_submission(
        update: Callable[[], Any], op_factory: Callable[[], trio_cuda.DeviceOp], flag: list[bool]
    ) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        # The callback runs when the submission is planned, in submission order.
        def cb(_: object) -> Any:
            nonlocal submitted
            submitted += 1
            flag.append(True)
            expected = update()
            return op_factory().map(lambda v: (v, expected))

        return trio_cuda.value(None).then(cb)

    def random_op(r: random.Random, flag: list[bool]) -> trio_cuda.DeviceOp:  # type: ignore[type-arg]
        kind = r.choice(["saxpy", "add", "copy", "read", "dup_read", "slow_saxpy", "fan"])
        i, j, k = r.sample(range(N_TENSORS), 3)
        a = r.choice([-1, 1, 2, 3])
        ti, tj, tk = tensors[i], tensors[j], tensors[k]
        if kind == "saxpy":

            def upd() -> None:
                model[j] = a * model[i] + model[j]

            return at_submission(upd, lambda: saxpy(a, ti, tj.partition((4,))), flag)
        if kind == "add":

            def upd() -> None:
                model[k] = model[i] + model[j]

            return at_submission(upd, lambda: add(tk.partition((8,)), ti, tj), flag)
        if kind == "copy":

            def upd() -> None:
                model[j] = model[i].copy()

            return at_submission(upd, lambda: api.memcpy(tj, ti), flag)
        if kind == "read":
            return at_submission(lambda: model[i].copy(), lambda: ti.to_host(), flag)
        if kind == "dup_read":
            return at_submission(lambda: model[i].copy(), lambda: api.dup(ti).to_host(), flag)
        if kind == "slow_saxpy":

            def upd() -> None:
                model[j] = a * model[i] + model[j]

            return at_submission(
                upd,
                lambda: sleep(api.zeros((1,), np.int32).partition((1,)), SLOW_NS).then(
                    lambda _: saxpy(a, ti, tj.partition((16,)))
                ),
                flag,
            )

        # fan: two independent branches in one submission, then a read of one of them
        def upd() -> np.ndarray:
            model[j] = a * model[i] + model[j]
            model[k] = model[i] + model[i]
            return model[j].copy()

        return at_submission(
            upd,
            lambda: trio_cuda.zip(saxpy(a, ti, tj.partition((4,))), add(tk.partition((4,)), ti, ti)).then(lambda _: tj.to_host()),
            flag,
        )

    async def task(tid: int) -> None:
        nonlocal reads_checked, cancelled_in_flight
        r = random.Random(SEED * 100 + tid)
        for _ in range(OPS_PER_TASK):
            flag: list[bool] = []
            op = random_op(r, flag)
            timeout = r.choice([None, None, None, 0.0, 0.0005, 0.002, 0.01])
            scope = trio.move_on_after(timeout) if timeout is not None else contextlib.nullcontext()
            with scope as s:
                value, expected = await op
                if isinstance(value, np.ndarray):
                    np.testing.assert_array_equal(value, expected)
                    reads_checked += 1
            if s is not None and s.cancelled_caught and flag:
                cancelled_in_flight += 1

    async with trio.open_nursery() as n:
        for tid in range(TASKS):
            n.start_soon(task, tid)

    waits = lowlevel.submission_statistics()
    assert (waits.waited_for_kernels, waits.waited_for_staging, waits.waited_for_submission) == (
        waits_before.waited_for_kernels,
        waits_before.waited_for_staging,
        waits_before.waited_for_submission,
    ), "a submission waited between planning and enqueueing: the model's order is not the device's"
    assert waits.abandoned == waits_before.abandoned
    for t, m in zip(tensors, model, strict=False):
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
