"""Processes and fork: a child forked after trio-cuda started refuses to use it, with an
error that says what to do, instead of hanging; the parent keeps working; a spawned
child works; a fork before any use leaves the child free to use trio-cuda.

Every child here runs under a timeout guard: a child that hangs is killed and the test
fails (it does not hang). Forked children leave with ``os._exit`` (no pytest teardown in
them) and report through a pipe.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import sleep

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")

CHILD_TIMEOUT = 30.0


def _fork(work: Callable[[], object]) -> str:
    """Run ``work()`` in a forked child; its outcome as ``"ok: <repr>"`` or ``"TypeName: message"``.

    Fails the test if the child does not report and exit within CHILD_TIMEOUT seconds."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a process with threads may deadlock the child:
        # what these tests check is that trio-cuda's part does not.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            try:
                out = f"ok: {work()!r}"
            except BaseException as err:  # reported to the parent, which asserts it
                out = f"{type(err).__name__}: {err}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + CHILD_TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([r], [], [], max(left, 0))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child hung (no answer in {CHILD_TIMEOUT} s)")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return b"".join(chunks).decode()


def _assert_refused(outcome: str) -> None:
    assert outcome.startswith("ForkedProcessError: this process was forked"), outcome
    assert "multiprocessing.get_context('spawn')" in outcome
    assert "'forkserver'" in outcome


def _start_runtime() -> None:
    out = api.full((4,), 2.0).to_host().sync()
    assert (out == 2.0).all()


def test_forked_child_refuses_an_await() -> None:
    _start_runtime()

    async def child() -> Any:
        return await api.full((4,), 3.0).to_host()

    _assert_refused(_fork(lambda: trio.run(child)))


def test_forked_child_refuses_sync_and_the_other_entry_points() -> None:
    _start_runtime()
    x = api.full((4,), 1.0).sync()
    stream = trio_cuda.current_device().create_stream()
    for work in (
        lambda: api.full((4,), 3.0).sync(),
        lambda: api.full((4,), 3.0).sync_on(stream),
        lambda: x.to_host().sync(),
        trio_cuda.devices,
        lambda: trio_cuda.device(0),
        trio_cuda.current_device,
        lambda: trio_cuda.current_device().create_stream(),
        lambda: lowlevel.record(stream),
        lambda: trio_cuda.current_device().synchronize(),
        stream.synchronize,
    ):
        _assert_refused(_fork(work))


def test_forked_child_refuses_a_graph_launch() -> None:
    x = api.full((8,), 1.0).sync()
    graph = api.memcpy(x, np.full(8, 4.0, np.float32)).graph()
    assert graph.launch().sync() is not None

    async def child() -> Any:
        return await graph.launch()

    _assert_refused(_fork(lambda: trio.run(child)))
    _assert_refused(_fork(graph.launch))


def test_forked_child_refuses_to_wait_for_the_parents_work() -> None:
    counter = api.zeros((1,), np.int32).sync()

    async def submit() -> Any:
        return await lowlevel.submit(sleep(counter.partition((1,)), 300_000_000))

    submitted = trio.run(submit)  # a 0.3 s kernel, pending while the child runs

    async def child() -> Any:
        return await submitted.wait()

    _assert_refused(_fork(lambda: trio.run(child)))

    async def parent() -> Any:
        await submitted.wait()
        return await counter.to_host()

    assert trio.run(parent)[0] == 1


def test_forked_from_inside_asyncio_the_child_refuses_and_the_parent_goes_on() -> None:
    # Forked from an asyncio task while another task's await is parked on the notifier:
    # the child's asyncio.run refuses at its first await; the parent's await completes.
    counter = api.zeros((1,), np.int32).sync()

    async def child() -> Any:
        return await api.full((4,), 3.0).to_host()

    async def parent() -> tuple[str, Any]:
        waiting = asyncio.create_task(_await(sleep(counter.partition((1,)), 300_000_000)))
        while lowlevel.notifier_statistics().parked == 0:
            await asyncio.sleep(0.001)
        outcome = _fork(lambda: asyncio.run(child()))
        await waiting
        return outcome, await counter.to_host()

    outcome, count = asyncio.run(parent())
    _assert_refused(outcome)
    assert count[0] == 1


async def _await(op: Any) -> Any:
    return await op


def test_parent_keeps_working_after_fork() -> None:
    _start_runtime()
    _assert_refused(_fork(lambda: api.full((2,), 1.0).sync()))

    async def parent() -> Any:
        y = await api.full((4,), 5.0)
        return await y.to_host()

    assert (trio.run(parent) == 5.0).all()
    assert (api.arange(4).to_host().sync() == np.arange(4)).all()


def test_fork_while_other_threads_submit() -> None:
    """A fork while another thread is inside the runtime (holding its lock, its streams
    busy) makes a child that refuses, not one that waits for a thread it does not have."""
    _start_runtime()
    stop = threading.Event()
    done: list[int] = []

    def submitter() -> None:
        while not stop.is_set():
            assert (api.full((64,), 1.0).to_host().sync() == 1.0).all()
            done.append(1)

    t = threading.Thread(target=submitter)
    t.start()
    try:
        for _ in range(3):
            _assert_refused(_fork(lambda: api.full((2,), 1.0).sync()))
    finally:
        stop.set()
        t.join(CHILD_TIMEOUT)
    assert not t.is_alive()
    assert done


def _in_multiprocessing_child(conn: Any) -> None:
    """The target of a multiprocessing child: await an op, report the outcome."""

    async def work() -> Any:
        y = await api.full((3,), 7.0)
        return await y.to_host()

    try:
        conn.send(("ok", trio.run(work).tolist()))
    except BaseException as err:  # reported to the parent, which asserts it
        conn.send((type(err).__name__, str(err)))


def _multiprocessing(method: str) -> tuple[str, Any]:
    ctx = multiprocessing.get_context(method)
    parent_end, child_end = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (see _fork)
        p = ctx.Process(target=_in_multiprocessing_child, args=(child_end,))
        p.start()
    child_end.close()
    try:
        if not parent_end.poll(CHILD_TIMEOUT + 60):  # (a spawned child imports everything first)
            pytest.fail(f"the {method} child hung (no answer)")
        outcome: tuple[str, Any] = parent_end.recv()
    finally:
        p.join(CHILD_TIMEOUT)
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == 0
    return outcome


def test_multiprocessing_fork_child_refuses_and_a_spawned_child_works() -> None:
    _start_runtime()
    kind, message = _multiprocessing("fork")
    assert kind == "ForkedProcessError"
    _assert_refused(f"{kind}: {message}")
    # What the error advises works: a spawned child starts trio-cuda afresh.
    assert _multiprocessing("spawn") == ("ok", [7.0, 7.0, 7.0])


FORK_BEFORE_USE = """
import os, signal, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
import trio
import trio_cuda
from trio_cuda import api

PARENT = os.getpid()

async def use():
    return (await api.full((2,), 2.0).to_host()).tolist()

def fork_and_use():
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang ends the child (and fails the check of its status)
        try:
            print("child", trio.run(use), flush=True)
        except trio_cuda.ForkedProcessError as err:
            print("child refused", "get_context('spawn')" in str(err), flush=True)
        return  # a normal exit: the atexit hooks and the finalizers run in the child
    _, status = os.waitpid(pid, 0)
    print("status", os.waitstatus_to_exitcode(status), flush=True)

fork_and_use()  # before any use of trio-cuda: the child is free to use it
if os.getpid() == PARENT:
    print("parent", trio.run(use), flush=True)
    fork_and_use()  # after: the child refuses
"""


def test_fork_before_use_is_free_and_the_child_exits_cleanly() -> None:
    env = dict(os.environ, TRIO_CUDA_BACKEND="sim", TRIO_CUDA_QUIET="1")
    r = subprocess.run([sys.executable, "-c", FORK_BEFORE_USE], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines() == [
        "child [2.0, 2.0]",
        "status 0",
        "parent [2.0, 2.0]",
        "child refused True",
        "status 0",
    ], r.stdout + r.stderr
    assert r.returncode == 0, r.stderr
