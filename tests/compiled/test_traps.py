"""``await op`` yielding trio's trap itself (trio_cuda._traps): the same checkpoints,
cancellation and errors as through trio's public functions. Every test runs both ways."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from trio_cuda import _traps, api, lowlevel
from trio_cuda.kernels import add, sleep

from ..helpers.compiled import operands
from ..helpers.devices import counter
from ..helpers.fakes import wordless_stream


@pytest.fixture(params=["traps-wordless", "traps-words", "public-wordless", "public-words"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Awaits yield trio's trap or go through trio's functions; the default policy is a
    stream without a completion word (as CUDA streams by default: the first poll comes
    after a schedule point) or the device's own streams (with words on the simulated
    device: a word read first, then the poll)."""
    monkeypatch.setattr(_traps, "on", request.param.startswith("traps"))
    dev = trio_cuda.current_device()
    if request.param.endswith("wordless"):
        monkeypatch.setattr(dev, "policy", trio_cuda.SingleStream(stream=wordless_stream(dev)))
    else:
        # a word read right after submitting says "not yet", as on the simulated device
        # (on a GPU it may say done already: test_work_done_at_submission covers that)
        monkeypatch.setattr(dev, "reached", lambda ev: False)
    yield request.param


def test_this_trio_has_what_the_trap_path_reads() -> None:
    # If a trio release changes its internals, the runtime falls back to trio's public
    # functions (slower); this test says so instead of letting it pass unnoticed.
    assert _traps.available, f"trio {trio.__version__}: the trap path is unavailable"
    assert _traps.on


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


async def test_an_await_is_a_checkpoint_and_a_schedule_point(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
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


async def test_an_await_is_resumed_by_the_scheduler(path: str) -> None:
    # It yields to trio (a schedule point) even when the work is done at the first poll.
    x, y, z = await operands()
    inst = _Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(inst)
    try:
        await add(z.partition((32,)), x, y)
    finally:
        trio.lowlevel.remove_instrument(inst)
    assert inst.steps >= 1


async def test_cancelled_before_the_await_submits_nothing(path: str) -> None:
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


async def test_cancelled_at_the_schedule_point_after_submitting(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
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


async def test_cancelled_while_waiting_for_slow_work(path: str) -> None:
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


@pytest.mark.parametrize("traps", [True, False])
async def test_work_done_at_submission_is_returned_even_if_cancelled_meanwhile(
    monkeypatch: pytest.MonkeyPatch, traps: bool
) -> None:
    # When its completion word says the work is done already after submitting, the
    # await polls at once and its schedule point is cancel-shielded: a cancel arriving
    # there does not hide a result that exists (both ways).
    monkeypatch.setattr(_traps, "on", traps)
    dev = trio_cuda.current_device()
    if dev._flags is None:
        pytest.skip("completion words are off (CUDA: TRIO_CUDA_COMPLETION_WORDS=1 turns them on)")
    _, y, _ = await operands()
    acc = await api.zeros((64,), np.float32)
    await add(acc.partition((32,)), acc, y)  # acc = 3, and direct next time
    reached = dev.reached

    def done_now(ev: Any) -> bool:  # the word says done: read it until it does
        assert ev.flag >= 0
        while not reached(ev):
            pass
        return True

    monkeypatch.setattr(dev, "reached", done_now)
    before = lowlevel.submission_statistics()
    with trio.CancelScope() as scope:
        inst = _CancelWhenResumed(trio.lowlevel.current_task(), scope, before.enqueued)
        trio.lowlevel.add_instrument(inst)
        try:
            got = await add(acc.partition((32,)), acc, y)
        finally:
            trio.lowlevel.remove_instrument(inst)
        assert got is not None  # returned, not cancelled
    assert inst.cancelled_at_enqueued == before.enqueued + 1 and not scope.cancelled_caught
    monkeypatch.undo()
    np.testing.assert_array_equal(await acc.to_host(), np.full(64, 6.0, np.float32))


def test_a_pending_keyboard_interrupt_is_delivered_at_the_await(path: str) -> None:
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


def test_outside_trio_the_await_says_so(path: str) -> None:
    coro = api.ones((4,)).__await__()
    with pytest.raises(RuntimeError, match="async context"):
        coro.send(None)


async def test_a_fault_at_the_first_poll_names_the_kernel(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    x, y, z = await operands()
    calls = []

    def query(handle: object) -> bool:
        calls.append(handle)
        raise trio_cuda.DeviceFault("injected: the work before this event failed", device=dev.ordinal)

    monkeypatch.setattr(dev._driver, "query", query)
    monkeypatch.setattr(dev, "reached", lambda ev: False)  # (completion words on: ask the driver)
    before = lowlevel.submission_statistics().direct
    with pytest.raises(trio_cuda.DeviceFault) as info:
        await add(z.partition((32,)), x, y)
    assert calls and lowlevel.submission_statistics().direct == before + 1
    assert info.value.op is not None and "add" in info.value.op
    monkeypatch.undo()
    await trio.to_thread.run_sync(dev.synchronize)
    np.testing.assert_array_equal(await z.to_host(), np.full(64, 5.0, np.float32))


@pytest.mark.parametrize(("raw", "on"), [("0", False), ("1", True)])
def test_the_switch_is_read_at_import_and_off_means_trios_functions(raw: str, on: bool) -> None:
    # With the switch off, an await still works, and goes through trio's checkpoint functions.
    code = (
        "import trio, trio_cuda\n"
        "from trio_cuda import _traps, api\n"
        "from trio_cuda.kernels import add\n"
        "seen = []\n"
        "orig = trio.lowlevel.checkpoint_if_cancelled\n"
        "async def counted():\n"
        "    seen.append(1)\n"
        "    await orig()\n"
        "trio.lowlevel.checkpoint_if_cancelled = counted\n"
        "async def main():\n"
        "    x = await api.ones((8,))\n"
        "    await add(x.partition((8,)), x, x)\n"
        "    seen.clear()\n"
        "    await add(x.partition((8,)), x, x)\n"
        "    n = len(seen)\n"
        "    assert (await x.to_host() == 4).all()\n"
        "    seen[:] = [1] * n\n"
        "trio.run(main)\n"
        "print(_traps.on, len(seen) > 0)\n"
    )
    env = {**os.environ, "TRIO_CUDA_TRIO_TRAPS": raw, "TRIO_CUDA_QUIET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(on), str(not on)]
