"""A task inside an await, as debuggers and task-tree dumps see it: trio's
``Task.iter_await_frames`` raises nothing and yields the awaiting coroutines' frames down
to the await, on every trio that pyproject allows (CI runs
this on the oldest too), with the await's module compiled (its generator then is
Cython's) and interpreted."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import trio
import trio.testing

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add, saxpy, sleep

from numba import cuda

from ..helpers.devices import counter

N = 8
_FRESH = itertools.count()


def my_name() -> str:
    """The name of the calling function."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_code.co_name


def names(task: trio.lowlevel.Task) -> list[str]:
    return [f.f_code.co_name for f, _ in task.iter_await_frames()]


def awaited_by(coro: Any, name: str) -> str | None:
    """The type of what the coroutine of function ``name`` in ``coro``'s await chain awaits."""
    while coro is not None:
        inner = getattr(coro, "cr_await", None) if hasattr(coro, "cr_frame") else getattr(coro, "gi_yieldfrom", None)
        code = getattr(coro, "cr_code", None)
        if code is not None and code.co_name == name:
            return type(inner).__name__
        coro = inner
    return None


class Walks(trio.abc.Instrument):
    """After every step that leaves ``task`` suspended, walks its await frames as a
    debugger would from outside it. Errors are kept: trio drops an instrument that
    raises and goes on."""

    def __init__(self, task: trio.lowlevel.Task, name: str) -> None:
        self.task, self.name = task, name
        self.walks: list[list[str]] = []
        self.awaited: set[str | None] = set()
        self.errors: list[BaseException] = []

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is not self.task or inspect.getcoroutinestate(task.coro) != inspect.CORO_SUSPENDED:
            return
        try:
            self.walks.append(names(task))
            self.awaited.add(awaited_by(task.coro, self.name))
        except BaseException as exc:
            self.errors.append(exc)

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]
        assert self.walks, "the task never suspended"
        for walk in self.walks:
            assert self.name in walk, walk
        # the await itself was seen, not only the steps around it
        assert any(w[w.index(self.name) + 1 :][:1] == ["await_op"] for w in self.walks), self.walks


@contextlib.contextmanager
def walking(name: str) -> Iterator[Walks]:
    """Walk the current task's await frames after each of its steps (``name``: the
    function whose frame every walk must reach)."""
    w = Walks(trio.lowlevel.current_task(), name)
    trio.lowlevel.add_instrument(w)
    try:
        yield w
    finally:
        trio.lowlevel.remove_instrument(w)


async def test_frames_inside_a_kernel_launch() -> None:
    x = await api.arange(N)
    z = await api.zeros((N,))
    with walking(my_name()) as w:
        for _ in range(3):
            await add(z.partition((4,)), x, x)
    w.check()
    np.testing.assert_array_equal(await z.to_host(), 2 * np.arange(N))


async def test_frames_inside_a_sleeping_kernel() -> None:
    c = await counter()
    with walking(my_name()) as w:
        await sleep(c, 200_000_000)
    w.check()


async def test_frames_inside_to_host_and_a_planned_op() -> None:
    with walking(my_name()) as w:
        x = await api.arange(N)
        out = await x.to_host()
    w.check()
    np.testing.assert_array_equal(out, np.arange(N))


async def test_frames_inside_a_graph_launch() -> None:
    x = await api.arange(N)
    z = await api.zeros((N,))
    g = add(z.partition((4,)), x, x).graph()
    with walking(my_name()) as w:
        await g.launch()
        await g.launch()
    w.check()


async def test_frames_inside_a_zip_then_dag() -> None:
    x = await api.arange(N)
    y1, y2, out = await api.zeros((N,)), await api.zeros((N,)), await api.zeros((N,))
    both = trio_cuda.zip(saxpy(1.0, x, y1.partition((4,))), saxpy(3.0, x, y2.partition((4,))))
    with walking(my_name()) as w:
        await both.then(lambda _: add(out.partition((4,)), y1, y2))
    w.check()
    np.testing.assert_array_equal(await out.to_host(), 4 * np.arange(N))


async def test_frames_inside_a_cancelled_await() -> None:
    x = await api.arange(N)
    with walking(my_name()) as w, trio.CancelScope() as cs:
        cs.cancel()
        await add(x.partition((4,)), x, x)
    assert cs.cancelled_caught
    w.check()


async def test_frames_inside_a_wait_for_a_worker_thread() -> None:
    # A kernel of new content is compiled at its first launch, in a worker thread (a
    # need of the submission), while the awaiting task waits in trio.
    fresh = next(_FRESH)

    @trio_cuda.kernel
    def triple(out, a):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = 3 * a[i] + 0 * fresh

    x = await api.arange(N)
    z = await api.zeros((N,))
    before = lowlevel.submission_statistics().waited_for_kernels
    with walking(my_name()) as w:
        await triple(z.partition((N,)), x)
    assert lowlevel.submission_statistics().waited_for_kernels == before + 1
    w.check()
    np.testing.assert_array_equal(await z.to_host(), 3 * np.arange(N))


def task_tree() -> dict[trio.lowlevel.Task, list[str]]:
    """Every task of the run with its await frames, walked from the root task as a
    task-tree dump walks them."""
    out: dict[trio.lowlevel.Task, list[str]] = {}

    def visit(task: trio.lowlevel.Task) -> None:
        out[task] = names(task)
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                visit(child)

    visit(trio.lowlevel.current_root_task())
    return out


async def test_a_task_tree_dump_sees_the_tasks_parked_in_awaits() -> None:
    c = await counter()
    await sleep(c, 1)  # (compiled and loaded before the dump)
    tree: dict[trio.lowlevel.Task, list[str]] = {}

    async def parked_in_a_planned_op() -> None:
        await sleep(c, 1).then(lambda _: sleep(c, 1))  # after the sleep below

    async def dump_when_all_are_blocked() -> None:
        await trio.testing.wait_all_tasks_blocked()
        tree.update(task_tree())
        n.cancel_scope.cancel()

    me = trio.lowlevel.current_task()
    async with trio.open_nursery() as n:
        n.start_soon(parked_in_a_planned_op)
        n.start_soon(dump_when_all_are_blocked)
        await sleep(c, 500_000_000)  # (long: the dump is made while it runs)
    await trio.to_thread.run_sync(trio_cuda.current_device().synchronize)
    assert my_name() in tree[me], tree[me]
    (child,) = [frames for t, frames in tree.items() if t.name.endswith(".parked_in_a_planned_op")]
    assert "parked_in_a_planned_op" in child, child
