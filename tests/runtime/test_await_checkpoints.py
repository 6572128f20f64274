"""What trio sees of ``await op``: a checkpoint and a schedule point, cancellation
before and after submitting, a pending KeyboardInterrupt, an await outside trio, a
fault at the first poll (the await drives trio's public checkpoint functions)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, sleep

from ..helpers.devices import counter


async def operands() -> tuple[Any, Any, Any]:
    x = await api.full((64,), 2.0, np.float32)
    y = await api.full((64,), 3.0, np.float32)
    z = await api.zeros((64,), np.float32)
    await add(z.partition((32,)), x, y)  # compiled, and its arguments seen: the next one is direct
    return x, y, z


def first_poll_done(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every poll of the current device first waits for the event's work (as on a GPU,
    where one pass of the scheduler covers a tiny kernel's latency), so an await's first
    poll finds it done and the await has no checkpoint but its own. Returns the polls'
    answers."""
    dev = trio_cuda.current_device()
    poll, answers = dev.poll, []

    def waited_poll(ev: Any) -> bool:
        while not poll(ev):
            pass
        answers.append(True)
        return True

    monkeypatch.setitem(vars(dev), "poll", waited_poll)  # (setattr would leave a bound method behind)
    return answers


class _CancelWhenResumed(trio.abc.Instrument):
    """Cancels ``scope`` just before ``task`` next runs after its submission went in
    (that is: while it is at the schedule point that precedes the first poll)."""

    def __init__(self, task: Any, scope: trio.CancelScope, enqueued_before: int) -> None:
        self.task, self.scope, self.before = task, scope, enqueued_before
        self.cancelled_at_enqueued: int | None = None

    def before_task_step(self, task: Any) -> None:
        if task is self.task and self.cancelled_at_enqueued is None:
            enqueued = lowlevel.submission_statistics().enqueued
            if enqueued > self.before:
                self.scope.cancel()
                self.cancelled_at_enqueued = enqueued


async def test_an_await_is_a_checkpoint_and_a_schedule_point(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, z = await operands()
    polls = first_poll_done(monkeypatch)
    with trio.testing.assert_checkpoints():
        await add(z.partition((32,)), x, y)
    assert polls
    # the general path too (a DAG of two ops)
    with trio.testing.assert_checkpoints():
        await add(z.partition((32,)), x, y).then(lambda _: z.to_host())


class _Steps(trio.abc.Instrument):
    """Counts the steps trio runs of ``task``."""

    def __init__(self, task: Any) -> None:
        self.task, self.steps = task, 0

    def before_task_step(self, task: Any) -> None:
        self.steps += task is self.task


async def test_an_await_is_resumed_by_the_scheduler() -> None:
    # It yields to trio (a schedule point) even when the work is done at the first poll.
    x, y, z = await operands()
    inst = _Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(inst)
    try:
        await add(z.partition((32,)), x, y)
    finally:
        trio.lowlevel.remove_instrument(inst)
    assert inst.steps >= 1


async def test_cancelled_before_the_await_submits_nothing() -> None:
    _, y, _ = await operands()
    acc = await api.zeros((64,), np.float32)
    await add(acc.partition((32,)), acc, y)  # acc = 3; the same call goes direct next time
    op = add(acc.partition((32,)), acc, y)
    before = lowlevel.submission_statistics()
    with trio.CancelScope() as scope:
        scope.cancel()
        await op
    assert scope.cancelled_caught
    after = lowlevel.submission_statistics()
    assert (after.planned, after.enqueued) == (before.planned, before.enqueued)
    np.testing.assert_array_equal(await acc.to_host(), np.full(64, 3.0, np.float32))
    await op  # not consumed: it still runs, once
    np.testing.assert_array_equal(await acc.to_host(), np.full(64, 6.0, np.float32))


async def test_cancelled_at_the_schedule_point_after_submitting(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, _ = await operands()
    zz = await api.zeros((64,), np.float32)
    await add(zz.partition((32,)), x, y)  # warm: direct next time
    await add(zz.partition((32,)), zz, y)  # and with zz as an input too
    polls = first_poll_done(monkeypatch)  # (the cancel is not left to a later poll's checkpoint)
    before = lowlevel.submission_statistics()
    with trio.CancelScope() as scope:
        inst = _CancelWhenResumed(trio.lowlevel.current_task(), scope, before.enqueued)
        trio.lowlevel.add_instrument(inst)
        try:
            await add(zz.partition((32,)), zz, y)  # zz = 8 + 3
        finally:
            trio.lowlevel.remove_instrument(inst)
    assert inst.cancelled_at_enqueued == before.enqueued + 1
    assert len(polls) <= 1
    assert scope.cancelled_caught, "the cancel at the schedule point was not raised"
    after = lowlevel.submission_statistics()
    assert after.direct == before.direct + 1  # it went in, directly
    # the work was not recalled: a later read sees it
    np.testing.assert_array_equal(await zz.to_host(), np.full(64, 11.0, np.float32))


async def test_cancelled_while_waiting_for_slow_work() -> None:
    c = await counter()
    await sleep(c, 1000)  # compiled and loaded: no submission below waits for that
    for _ in range(2):  # the first is planned, the second direct
        before = lowlevel.submission_statistics()
        with trio.move_on_after(0.02) as scope:
            await sleep(c, 200_000_000)
        assert scope.cancelled_caught
        assert lowlevel.submission_statistics().enqueued == before.enqueued + 1
    assert lowlevel.submission_statistics().direct == before.direct + 1
    np.testing.assert_array_equal(await c.to_host(), [3])  # neither was recalled


def test_a_pending_keyboard_interrupt_is_delivered_at_the_await() -> None:
    # As at trio's own checkpoints, a KeyboardInterrupt pending for the main task is
    # raised by the await, before anything is submitted.
    submitted = []

    async def main() -> None:
        x, y, z = await operands()
        op = add(z.partition((32,)), x, y)
        before = lowlevel.submission_statistics().enqueued
        runner = trio.lowlevel.current_task()._runner  # type: ignore[attr-defined]
        assert trio.lowlevel.current_task() is runner.main_task
        runner.ki_pending = True
        try:
            await op
        finally:
            submitted.append(lowlevel.submission_statistics().enqueued - before)

    with pytest.raises(KeyboardInterrupt):
        trio.run(main)
    assert submitted == [0]


async def test_a_fault_at_the_first_poll_names_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    x, y, z = await operands()
    calls = []

    def query(handle: object) -> bool:
        calls.append(handle)
        raise trio_cuda.DeviceFault("injected: the work before this event failed", device=dev.ordinal)

    monkeypatch.setattr(dev._driver, "query", query)
    before = lowlevel.submission_statistics().direct
    with pytest.raises(trio_cuda.DeviceFault) as info:
        await add(z.partition((32,)), x, y)
    assert calls and lowlevel.submission_statistics().direct == before + 1
    assert info.value.op is not None and "add" in info.value.op
    monkeypatch.undo()
    await trio.to_thread.run_sync(dev.synchronize)
    np.testing.assert_array_equal(await z.to_host(), np.full(64, 5.0, np.float32))
