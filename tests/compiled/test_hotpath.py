"""The runtime's compiled hot path (trio_cuda/_hotpath.c, issue 12).

The C module replaces ``_Launch._submit_now`` (the direct submission of a prepared
kernel launch) and ``Device.poll``. Its contract: it does exactly what the Python
methods do, or hands the call to them before any effect. So every scenario here runs
with the compiled methods and with the Python ones, and compares what can be observed:
results, the runtime's counters, the buffers' pending accesses, the streams' points,
errors. Counters of the module say that the compiled code did the work (it did not
just hand everything to the Python). Its direct driver calls (the CUDA backend's entry
points) are driven with ctypes stand-ins, as tests/backends/test_fastpath.py does for
_cudafast; on a GPU the whole suite runs through them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import outcome
import pytest
import trio

import trio_cuda
from trio_cuda import _kernel, api, lowlevel, ops
from trio_cuda._guard import LOCK, _tls
from trio_cuda._op import DeviceOp, ScheduledOp
from trio_cuda._stream import Event
from trio_cuda.kernels import add, saxpy, sleep

from ..helpers.fakes import FakeDriver, fake_cuda_driver

try:
    from trio_cuda import _hotpath
except ImportError:
    _hotpath = None

if _hotpath is None and os.environ.get("TRIO_CUDA_REQUIRE_HOTPATH") != "1":
    pytestmark = pytest.mark.skip(reason="the compiled hot path was not built (no C compiler at install)")
elif os.environ.get("TRIO_CUDA_HOTPATH", "").strip() == "0":
    pytestmark = pytest.mark.skip(reason="TRIO_CUDA_HOTPATH=0: this run tests the Python methods alone")

ON_CUDA = trio_cuda.backend_name() == "cuda"


@pytest.fixture(autouse=True)
def _built() -> Iterator[None]:
    """With TRIO_CUDA_REQUIRE_HOTPATH=1 (CI where a compiler and Python's headers exist)
    every test here fails, instead of skipping, when the module is missing; each test
    leaves the hot path as it found it."""
    if _hotpath is None:
        pytest.fail("TRIO_CUDA_REQUIRE_HOTPATH=1 but trio_cuda._hotpath was not built (see the build_ext output)")
    was = _kernel.hotpath_active()
    yield
    _kernel.use_hotpath(was)


@contextlib.contextmanager
def mode(compiled: bool) -> Iterator[None]:
    was = _kernel.hotpath_active()
    assert _kernel.use_hotpath(compiled) is compiled
    try:
        yield
    finally:
        _kernel.use_hotpath(was)


def on(op: Any, stream: trio_cuda.Stream) -> ScheduledOp[Any]:
    """``op`` bound to ``stream`` (awaited there)."""
    return ScheduledOp(op, stream)


async def _await(x: Any) -> None:
    await x


def counters() -> dict[str, int]:
    return dict(_hotpath.counters())


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def lock_taken_by_another_thread() -> list[bool]:
    """[True] if another thread can take the runtime lock (within 5 s)."""
    got: list[bool] = []

    def take() -> None:
        got.append(LOCK.acquire(timeout=5))
        LOCK.release()

    t = threading.Thread(target=take)
    t.start()
    t.join()
    return got


def wordless_stream(dev: trio_cuda.Device) -> trio_cuda.Stream:
    """A stream without a completion word (as every CUDA stream by default): its polls
    are the compiled poll's, not the word's."""
    s = dev.create_stream()
    with LOCK:
        dev._give_flag(s)
    assert s._flag < 0
    return s


async def two_streams_and_operands(dev: trio_cuda.Device) -> tuple[Any, ...]:
    """Two streams without completion words, x = arange(64), y = z = zeros(64) and a
    one-int32 counter for sleep kernels: (a, b, x, y, z, counter)."""
    a, b = wordless_stream(dev), wordless_stream(dev)
    x, y, z = await api.arange(64), await api.zeros((64,)), await api.zeros((64,))
    return a, b, x, y, z, await api.zeros((1,), np.int32)


def stats_of(dev: trio_cuda.Device) -> dict[str, Any]:
    st = dev.statistics()
    sub = lowlevel.submission_statistics()
    return {
        "launches": st.launches,
        "submissions": st.submissions,
        "stream_waits": st.stream_waits,
        "planned": sub.planned,
        "enqueued": sub.enqueued,
        "failed": sub.failed,
        "abandoned": sub.abandoned,
        "direct": sub.direct,
    }


def test_the_compiled_methods_are_installed() -> None:
    assert _kernel.hotpath_active()
    assert type(_kernel._Launch._submit_now).__name__ == "method_descriptor"
    assert type(trio_cuda.Device.poll).__name__ == "method_descriptor"
    assert _kernel._hot_calls is not None
    assert (DeviceOp.__await__, Event.__del__, trio_cuda.Kernel.__call__) == _kernel._hot_calls
    with mode(False):
        assert _kernel._Launch._submit_now is _kernel._submit_now_py
        assert trio_cuda.Device.poll is _kernel._poll_py
        assert DeviceOp.__await__ is _kernel._await_py
        assert Event.__del__ is _kernel._event_del_py
        assert trio_cuda.Kernel.__call__ is _kernel._kernel_call_py
    assert _kernel.hotpath_active()
    assert (DeviceOp.__await__, Event.__del__, trio_cuda.Kernel.__call__) == _kernel._hot_calls


async def _mixed_program(
    stream: trio_cuda.Stream, x: Any, y: Any, z: Any
) -> tuple[dict[str, Any], list[np.ndarray], dict[str, int]]:
    """Awaits on one stream: scalars of each key kind, reads and writes, repeats."""
    dev = stream.device
    before, c0 = stats_of(dev), counters()
    for a in (2.0, 0.0, -0.0, 3, True, 2.0, 0.0, -0.0, 1.5):
        await on(saxpy(a, x, y.partition((128,))), stream)  # y += a * x
    for _ in range(5):
        await on(add(z.partition((64,)), x, y), stream)  # z = x + y
    after = stats_of(dev)
    got = [await y.to_host(), await z.to_host()]
    return delta(before, after), got, delta(c0, counters())


async def test_same_results_counters_and_points_both_ways() -> None:
    dev = trio_cuda.current_device()
    results = {}
    for compiled in (False, True):
        with mode(compiled):
            s = wordless_stream(dev)
            x, y, z = await api.arange(300), await api.zeros((300,)), await api.zeros((300,))
            # the first run of each key goes the general way (it prepares); then direct
            await _mixed_program(s, x, y, z)
            results[compiled] = await _mixed_program(s, x, y, z)
    (py_stats, py_out, py_c), (c_stats, c_out, c_c) = results[False], results[True]
    assert py_stats == c_stats
    assert py_stats["direct"] == 14 and py_stats["launches"] == 14 and py_stats["failed"] == 0
    for a, b in zip(py_out, c_out, strict=True):
        np.testing.assert_array_equal(a, b)
    x = np.arange(300, dtype=np.float32)
    np.testing.assert_array_equal(c_out[0], x * 19)  # 2 runs of (2+0+0+3+1+2+0+0+1.5) x
    # the compiled run did the submissions and polls itself; the Python run none of them
    assert py_c["submits"] == 0 and py_c["polls"] == 0
    assert c_c["submits"] == 14 and c_c["submits_python"] == 0
    # (the compiled poll queries through the driver's entry point, on CUDA; elsewhere it
    # answers what it knows without a query and hands the query to the Python)
    assert c_c["polls"] + c_c["polls_python"] >= 14
    if ON_CUDA:
        assert c_c["polls"] >= 14


async def test_keys_of_scalars_tell_bits_apart() -> None:
    """0.0 and -0.0, 1 and 1.0 and True pass different bits: each has its own prepared
    launch (as _scalar_key says), in both modes."""
    x = await api.arange(8)
    y = await api.zeros((8,))
    for compiled in (False, True):
        with mode(compiled):
            saxpy._fast.clear()
            for a in (0.0, -0.0, 1, 1.0, True):
                await saxpy(a, x, y.partition((8,)))
            keys = {k[0] for k in saxpy._fast}
            assert keys == {(float, 0.0, 1.0), (float, -0.0, -1.0), (int, 1), (float, 1.0, 1.0), (bool, True)}
            c0 = counters()
            for a in (0.0, -0.0, 1, 1.0, True):
                await saxpy(a, x, y.partition((8,)))
            if compiled:
                assert delta(c0, counters())["submits"] == 5
    np.testing.assert_array_equal(await y.to_host(), np.arange(8, dtype=np.float32) * 12)


async def test_cross_stream_order_and_pending_accesses_match() -> None:
    """A direct launch on stream B after writes on stream A (still running behind a
    sleep) waits for them (a driver wait), registers itself as the writer and as a
    reader: the same state and the same results both ways."""
    dev = trio_cuda.current_device()
    states = {}
    for compiled in (False, True):
        with mode(compiled):
            a, b, x, y, z, c = await two_streams_and_operands(dev)
            await on(add(z.partition((64,)), x, y), b)  # prepared on b
            await on(saxpy(1.0, x, y.partition((64,))), a)  # prepared on a
            await on(add(z.partition((64,)), x, y), b)
            c0 = counters()
            w0 = dev.statistics().stream_waits
            # a: a 50 ms sleep, then y += x (1 -> 2x); b must read y after that write
            await lowlevel.submit(sleep(c.partition((1,)), 50_000_000), a)
            pending = await lowlevel.submit(saxpy(1.0, x, y.partition((64,))), a)
            await on(add(z.partition((64,)), x, y), b)  # z = x + y, after the write on a
            waits = dev.statistics().stream_waits - w0
            await pending.wait()
            zb, yb = z._buffer, y._buffer
            states[compiled] = (
                waits,
                b._waited.get(a._token, 0) >= a.seq,
                zb.writer == (b, b.seq),
                dict(yb.readers) == {b: b.seq},
                (await z.to_host()).tolist(),
            )
            if compiled:
                assert delta(c0, counters())["submits"] == 1  # the add on b (lowlevel.submit plans)
    assert states[False] == states[True]
    assert states[True][:4] == (1, True, True, True)
    assert states[True][4] == (3 * np.arange(64, dtype=np.float32)).tolist()


async def test_writes_wait_for_other_streams_writers_and_readers() -> None:
    """A direct write on stream B of memory that stream A is still writing, and then of
    memory that stream A is still reading: both wait (both ways, the same results)."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            a, b, x, y, z, c = await two_streams_and_operands(dev)
            for s in (a, b):
                await on(saxpy(1.0, x, y.partition((64,))), s)  # y = 2x; prepared on both
                await on(add(z.partition((64,)), y, x), s)  # z = 3x; prepared on both
            # write after write: a sleeps, then y += x (3x); b then y += x (4x)
            await lowlevel.submit(sleep(c.partition((1,)), 50_000_000), a)
            first = await lowlevel.submit(saxpy(1.0, x, y.partition((64,))), a)
            w0 = dev.statistics().stream_waits
            await on(saxpy(1.0, x, y.partition((64,))), b)
            waw = dev.statistics().stream_waits - w0
            await first.wait()
            # write after read: a sleeps, then z = y + x (5x) reads y; b then y += x (5x)
            await lowlevel.submit(sleep(c.partition((1,)), 50_000_000), a)
            reading = await lowlevel.submit(add(z.partition((64,)), y, x), a)
            w0 = dev.statistics().stream_waits
            await on(saxpy(1.0, x, y.partition((64,))), b)
            war = dev.statistics().stream_waits - w0
            await reading.wait()
            seen[compiled] = (waw, war, (await y.to_host()).tolist(), (await z.to_host()).tolist())
    assert seen[False] == seen[True]
    xs = np.arange(64, dtype=np.float32)
    assert seen[True] == (1, 1, (5 * xs).tolist(), (5 * xs).tolist())


async def test_untracked_views_register_lifetimes_not_order() -> None:
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            s = wordless_stream(dev)
            x = await api.arange(32)
            y = await api.zeros((32,))
            xu, yu = x.untracked(), y.untracked()
            for _ in range(3):
                await on(saxpy(2.0, xu, yu.partition((32,))), s)
            yb, xb = y._buffer, x._buffer
            seen[compiled] = (
                yb.writer is None or yb.writer[0] is not s,
                yb.lifetime.get(s) == s.seq,
                xb.lifetime.get(s) == s.seq,
                s in xb.readers,
            )
            np.testing.assert_array_equal(await y.to_host(), np.arange(32, dtype=np.float32) * 6)
    assert seen[False] == seen[True] == (True, True, True, False)


async def test_each_unhandled_case_goes_to_the_python_before_any_effect() -> None:
    """Cases the C code leaves to the Python method: a first launch (nothing prepared),
    an op with op inputs, a nested submission, a reset since preparing, keep-alives to
    retire, deferred frees. Each still submits correctly."""
    dev = trio_cuda.current_device()
    s = wordless_stream(dev)
    x = await api.arange(16)
    y = await api.zeros((16,))
    c0 = counters()
    await on(add(y.partition((16,)), x, x), s)  # maybe the first time: not prepared
    await on(add(y.partition((16,)), x, x), s)
    d = delta(c0, counters())
    assert d["submits"] + d["submits_python"] >= 2 and d["submits"] >= 1
    # op inputs: the general path (no direct submission at all)
    c0 = counters()
    await on(add(y.partition((16,)), x, api.arange(16)), s)
    assert delta(c0, counters())["submits"] == 0
    # a deferred free pending: the Python method frees first
    tmp = await api.zeros((1024,))
    del tmp
    gc.collect()
    assert dev._dead_buffers
    c0 = counters()
    await on(add(y.partition((16,)), x, x), s)
    d = delta(c0, counters())
    assert d["submits"] == 0 and d["submits_python"] == 1
    assert not dev._dead_buffers
    np.testing.assert_array_equal(await y.to_host(), 2 * np.arange(16, dtype=np.float32))


async def test_a_reset_since_preparing_is_seen() -> None:
    dev = trio_cuda.current_device()
    errors: list[str] = []
    for compiled in (False, True):
        with mode(compiled):
            x = await api.arange(16)
            y = await api.zeros((16,))
            await add(y.partition((16,)), x, x)
            await add(y.partition((16,)), x, x)
            await trio.to_thread.run_sync(dev.reset)
            c0 = counters()
            with pytest.raises(ValueError, match="allocated before device 0 was reset") as info:
                await add(y.partition((16,)), x, x)
            errors.append(str(info.value))
            # the compiled method saw the old generation and left it to the Python
            assert delta(c0, counters())["submits"] == 0
            x = await api.arange(16)
            y = await api.zeros((16,))
            for _ in range(2):
                await add(y.partition((16,)), x, x)
            np.testing.assert_array_equal(await y.to_host(), 2 * np.arange(16, dtype=np.float32))
    assert errors[0] == errors[1]


async def test_nested_submission_and_reuse_raise_the_same_errors() -> None:
    x = await api.arange(16)
    y = await api.zeros((16,))
    await add(y.partition((16,)), x, x)
    await add(y.partition((16,)), x, x)
    errors = {}
    for compiled in (False, True):
        with mode(compiled):
            op = add(y.partition((16,)), x, x)
            await op
            with pytest.raises(trio_cuda.OpAlreadyExecuted) as info:
                await op
            nested: list[type[BaseException]] = []

            def inside(_: Any, nested: list[type[BaseException]] = nested) -> Any:
                try:
                    add(y.partition((16,)), x, x).sync()
                except BaseException as err:  # recorded and compared
                    nested.append(type(err))
                return add(y.partition((16,)), x, x)

            await add(y.partition((16,)), x, x).then(inside)
            assert not _tls.submitting
            errors[compiled] = (type(info.value), list(nested))
    assert errors[False] == errors[True] == (trio_cuda.OpAlreadyExecuted, [trio_cuda.NestedExecutionError])


async def test_a_failed_launch_counts_and_releases_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver refusing the launch: the error reaches the awaiting task; the
    submission counts as failed; the lock, the in-submission flag and the op's state
    are as the Python leaves them."""
    dev = trio_cuda.current_device()
    x = await api.arange(16)
    y = await api.zeros((16,))
    await add(y.partition((16,)), x, x)
    await add(y.partition((16,)), x, x)
    seen = {}
    for compiled in (False, True):
        with mode(compiled):

            def refuse(*a: Any) -> None:
                raise trio_cuda.LaunchError("refused by the test")

            monkeypatch.setattr(dev._driver, "launch", refuse)
            st0 = stats_of(dev)
            op = add(y.partition((16,)), x, x)
            with pytest.raises(trio_cuda.LaunchError, match="refused by the test"):
                await op
            monkeypatch.undo()
            # the lock is free for another thread, the flag is down
            got = lock_taken_by_another_thread()
            seen[compiled] = (delta(st0, stats_of(dev)), got, _tls.submitting, op._state is not None)
    assert seen[False] == seen[True]
    assert seen[True][0]["failed"] == 1 and seen[True][1] == [True]
    await add(y.partition((16,)), x, x)
    np.testing.assert_array_equal(await y.to_host(), 2 * np.arange(16, dtype=np.float32))


async def test_polls_answer_and_advance_streams_the_same() -> None:
    dev = trio_cuda.current_device()
    for compiled in (False, True):
        with mode(compiled):
            s = wordless_stream(dev)
            c = await api.zeros((1,), np.int32)
            ok0 = s._ok_seq
            await on(sleep(c.partition((1,)), 1000), s)
            c0 = counters()
            with LOCK:
                s.seq += 1
                ev = s.event_at(s.seq)
            while not dev.poll(ev):
                await trio.lowlevel.checkpoint()
            assert ev.done and s.done_seq >= ev.seq and s._ok_seq == ev.seq > ok0
            assert dev.poll(ev) is True
            if compiled:  # (the first poll queries: compiled on CUDA only, see above)
                assert delta(c0, counters())["polls"] >= (2 if ON_CUDA else 1)
            # a reset: the stale event raises DeviceReset, through the Python
            with LOCK:
                s.seq += 1
                ev2 = s.event_at(s.seq)
            await trio.to_thread.run_sync(dev.reset)
            with pytest.raises(trio_cuda.DeviceReset):
                dev.poll(ev2)


def _new_point(s: trio_cuda.Stream) -> Event:
    """The event of a new point of ``s`` (nothing enqueued for it): its first poll takes
    the runtime lock."""
    with LOCK:
        s.seq += 1
        return s.event_at(s.seq)


async def test_the_runtime_lock_taken_here_is_the_same_lock() -> None:
    """The compiled submission and poll take and give back the runtime RLock themselves
    (CPython 3.11/3.12, whose RLock layout setup checked) instead of calling its methods:
    held by this thread already, they nest in its count; held by another thread, they
    wait for it through its own acquire(); afterwards it is free for everyone and a
    release too many still raises."""
    dev = trio_cuda.current_device()
    if sys.version_info < (3, 13):
        assert counters()["lock_inline_on"] == 1
    s = wordless_stream(dev)
    x, y = await api.arange(64), await api.zeros((64,))
    await on(saxpy(2.0, x, y.partition((64,))), s)  # (planned: prepared for the next)
    c0 = counters()
    await on(saxpy(2.0, x, y.partition((64,))), s)  # a direct submission and its polls
    d = delta(c0, counters())
    assert d["submits"] == 1 and d["polls"] + d["polls_python"] >= 1, d  # (python: the simulated device's)
    if sys.version_info < (3, 13):
        assert d["lock_inline"] >= 4 and d["lock_waits"] == 0, d
    np.testing.assert_array_equal(await y.to_host(), 4 * np.arange(64, dtype=np.float32))

    # nested in this thread's own holding (a count of 2 before, 2 after)
    with LOCK, LOCK:
        ev = _new_point(s)
        while not dev.poll(ev):
            pass
        assert LOCK._is_owned()
    assert not LOCK._is_owned() and lock_taken_by_another_thread() == [True]
    with pytest.raises(RuntimeError):
        LOCK.release()

    # held by another thread: the poll waits for it, then takes it
    held, go = threading.Event(), threading.Event()
    got: list[Any] = []

    def holder() -> None:
        with LOCK:
            held.set()
            go.wait(30)

    def poller(ev: Event) -> None:
        while not dev.poll(ev):
            pass
        got.append(LOCK._is_owned())

    ev = _new_point(s)
    b = threading.Thread(target=holder)
    b.start()
    assert held.wait(30)
    waits = counters()["lock_waits"]
    c = threading.Thread(target=poller, args=(ev,))
    c.start()
    if sys.version_info < (3, 13):  # (its try failed: it is in the lock's own acquire now)
        deadline = trio.current_time() + 30
        while counters()["lock_waits"] == waits and trio.current_time() < deadline:
            await trio.lowlevel.checkpoint()
        assert counters()["lock_waits"] == waits + 1
    assert got == [] and ev.done is False
    go.set()
    b.join()
    c.join()
    assert got == [False] and ev.done is True
    assert not LOCK._is_owned() and lock_taken_by_another_thread() == [True]


_SPOOFED_LOCKS = r"""
import _thread, sys, trio, trio_cuda
from trio_cuda import _hotpath, _kernel
from trio_cuda._guard import LOCK

calls = []
def acq(self, *a, **k):
    calls.append("acquire")
    return _thread.RLock.acquire(self, *a, **k)
def rel(self):
    calls.append("release")
    return _thread.RLock.release(self)
locks = {
    # a subclass of RLock that takes its name, with its own methods
    "subclass": type("_thread.RLock", (_thread.RLock,), {"__slots__": (), "acquire": acq, "release": rel})(),
    # a class of three slots that takes the name and makes a real RLock when called
    "impostor": object.__new__(type("_thread.RLock", (), {
        "__slots__": ("a", "b", "c"), "__new__": lambda cls: _thread.RLock(),
        "acquire": lambda self, *a: (calls.append("acquire"), True)[1],
        "release": lambda self: calls.append("release")})),
    "real": _thread.RLock(),
}
async def current():
    return trio_cuda.current_device()
dev = trio.run(current)
s = dev.create_stream()
with LOCK:
    dev._give_flag(s)  # (no completion word: the poll takes the lock)
for name, lock in locks.items():
    objs = _kernel._hot_setup_objects()
    objs["lock"] = lock
    _hotpath.setup(objs)
    calls.clear()
    with LOCK:
        s.seq += 1
        ev = s.event_at(s.seq)
    dev.poll(ev)  # the compiled poll takes the lock setup was given
    print(name, _hotpath.counters()["lock_inline_on"], calls)
"""


def test_a_lock_that_only_looks_like_an_rlock_has_its_methods_called() -> None:
    """The runtime lock is taken in C only where it is exactly ``_thread.RLock``: a
    subclass named like it (whose own methods must be called) and a class that takes its
    name but makes a real RLock when called (whose slots are not an RLock's) get their
    methods called (in a child process, whose hot path is set up again with each)."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", _SPOOFED_LOCKS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = {line.split()[0]: line.split(maxsplit=2)[1:] for line in r.stdout.splitlines()}
    assert got["subclass"] == ["0", "['acquire', 'release']"], got
    assert got["impostor"] == ["0", "['acquire', 'release']"], got
    assert got["real"] == ["1" if sys.version_info < (3, 13) else "0", "[]"], got


async def test_threads_racing_for_one_op_and_many_ops() -> None:
    """Threads submitting through the compiled path while trio awaits on it: one winner
    per op, every increment counted, no refcount left over."""
    x = await api.arange(256)
    y = await api.zeros((256,))
    await saxpy(1.0, x, y.partition((256,)))
    await saxpy(1.0, x, y.partition((256,)))
    op = saxpy(1.0, x, y.partition((256,)))
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def race() -> None:
        barrier.wait()
        try:
            op.sync()
            outcomes.append("ran")
        except trio_cuda.OpAlreadyExecuted:
            outcomes.append("refused")

    threads = [threading.Thread(target=race) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["ran", "refused", "refused", "refused"]

    def many() -> None:
        for _ in range(50):
            saxpy(1.0, x, y.partition((256,))).sync()

    before = sys.getrefcount(x), sys.getrefcount(y)
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(trio.to_thread.run_sync, many)
        for _ in range(50):
            await saxpy(1.0, x, y.partition((256,)))
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(y)) == before
    np.testing.assert_array_equal(await y.to_host(), np.arange(256, dtype=np.float32) * (3 + 150 + 50))


async def test_no_reference_is_leaked_or_lost() -> None:
    """Thousands of compiled submissions and polls: the objects they touch keep their
    reference counts, events die and their handles go back to the pool."""
    dev = trio_cuda.current_device()
    s = wordless_stream(dev)
    x = await api.arange(64)
    y = await api.zeros((64,))
    part = y.partition((64,))
    for _ in range(3):
        await on(saxpy(0.5, x, part), s)
    gc.collect()
    refs = [sys.getrefcount(o) for o in (x, y, part, s, dev, saxpy, x._buffer, y._buffer, saxpy._fast)]
    c0 = counters()
    evs = []
    for i in range(2000):
        await on(saxpy(0.5, x, part), s)
        if i % 500 == 0:
            evs.append(weakref.ref(s._last_event))
    assert delta(c0, counters())["submits"] == 2000
    gc.collect()
    assert [sys.getrefcount(o) for o in (x, y, part, s, dev, saxpy, x._buffer, y._buffer, saxpy._fast)] == refs
    assert all(e() is None for e in evs[:-1])  # old events are gone
    assert len(dev._event_pool) < 50
    np.testing.assert_array_equal(await y.to_host(), np.arange(64, dtype=np.float32) * 0.5 * 2003)


# -- the direct driver calls, with stand-ins for the entry points --------------------------
class _Prepared:
    __slots__ = ("bx", "by", "bz", "fn", "function", "gx", "gy", "gz", "name", "params")

    def __init__(self) -> None:
        self.fn, self.function, self.params, self.name = 0x300, None, 0x400, "k"
        self.gx, self.gy, self.gz, self.bx, self.by, self.bz = 7, 6, 5, 4, 3, 2


def _cuda_driver(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> Any:
    from trio_cuda._backends import _cuda

    d = fake_cuda_driver(fake, monkeypatch)
    d.hot_calls = (_cuda._tls, _Prepared, _cuda._NOT_READY, _cuda._OWN_CALLS)
    return d


def test_direct_calls_pass_handles_and_map_results(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import driver as cu

    fake = FakeDriver()
    d = _cuda_driver(fake, monkeypatch)
    ev, st = cu.CUevent(0x100), cu.CUstream(0x200)
    assert _hotpath.direct_call("launch", d, _Prepared(), st) == 1
    assert fake.calls[-1] == ("launch", 0x300, 7, 6, 5, 4, 3, 2, 0, 0x200, 0x400, None)
    assert _hotpath.direct_call("record", d, ev, st) == 1
    assert fake.calls[-1] == ("record", 0x100, 0x200)
    assert _hotpath.direct_call("query", d, ev) == 1
    fake.answer["query"] = int(cu.CUresult.CUDA_ERROR_NOT_READY)
    assert _hotpath.direct_call("query", d, ev) == 0
    fake.answer["query"] = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    assert _hotpath.direct_call("query", d, ev) == 2  # the Python query says what it means
    # errors of a launch and a record become the backend's errors, as on its own path
    fake.answer["launch"] = int(cu.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
    with pytest.raises(trio_cuda.LaunchError, match="kernel k") as c_err:
        _hotpath.direct_call("launch", d, _Prepared(), st)
    with pytest.raises(trio_cuda.LaunchError, match="kernel k") as py_err:
        d.launch(_Prepared(), st)
    assert str(c_err.value) == str(py_err.value)
    fake.answer["record"] = int(cu.CUresult.CUDA_ERROR_INVALID_HANDLE)
    with pytest.raises(trio_cuda.DeviceError, match="cuEventRecord") as c_rec:
        _hotpath.direct_call("record", d, ev, st)
    with pytest.raises(trio_cuda.DeviceError, match="cuEventRecord") as py_rec:
        d.record(ev, st)
    assert type(c_rec.value) is type(py_rec.value) and str(c_rec.value) == str(py_rec.value)


def test_direct_calls_follow_every_change_after_a_cached_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled answer to "may direct calls be made for this driver" is kept between
    calls (counter direct_cached) only while nothing it read changed: after each change
    below, made once with the answer cached, the next call follows the change: another
    token on the thread, a method set on the instance or patched on the class (and
    undone), the backend's own-method table changed, other entry points, hot_calls
    gone, another driver in between, a class whose _fast is a property."""
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cuda

    fake, fake2 = FakeDriver(), FakeDriver()
    d = _cuda_driver(fake, monkeypatch)
    ev = cu.CUevent(0x100)

    def query(drv: Any = d) -> Any:
        _hotpath.direct_call("query", drv, ev)  # (the answer kept, if it can be)
        return _hotpath.direct_call("query", drv, ev)

    def like_d(cls: type, first: Any = None, fast: bool = True) -> Any:
        """A driver of class ``cls`` with d's attributes (not the methods an older
        monkeypatch may leave in d's dict), ``first`` the first key of its dict."""
        drv = cls.__new__(cls)
        if first is not None:
            vars(drv)[first] = 1
        for name in ("ordinal", "_fault", "_lock", "_token", "_flag_dev", "hot_calls") + (("_fast",) if fast else ()):
            setattr(drv, name, getattr(d, name))
        return drv

    before = counters()["direct_cached"]
    assert query() == 1 and fake.calls[-1] == ("query", 0x100)
    if sys.version_info < (3, 13):  # (kept on the versions it is tested with)
        assert counters()["direct_cached"] > before
    with monkeypatch.context() as m:
        m.setattr(_cuda._tls, "token", object())
        assert query() is None
    assert query() == 1
    elsewhere: list[Any] = []  # another thread, where the device's context was never made current
    t = threading.Thread(target=lambda: elsewhere.append(query()))
    t.start()
    t.join()
    assert elsewhere == [None] and query() == 1
    for target in (d, _cuda.CudaDevice):
        n = len(fake.calls)
        with monkeypatch.context() as m:
            m.setattr(target, "query", (lambda *a: True) if target is d else (lambda self, *a: True))
            assert callable(d.launch)  # (a lookup on the class since: its version tag is valid again)
            assert query() == 2 and len(fake.calls) == n  # (the Python query's to make)
        assert query() == 1 and len(fake.calls) == n + 2
    with monkeypatch.context() as m:
        m.setitem(_cuda._OWN_CALLS, "query", lambda self, *a: True)
        assert query() == 2
    assert query() == 1
    n = len(fake.calls)
    d._fast = fake2.entry_points
    assert query() == 1 and len(fake.calls) == n and fake2.calls[-1] == ("query", 0x100)
    d._fast = fake.entry_points
    d.hot_calls = None
    assert query() is None
    d.hot_calls = (_cuda._tls, _Prepared, _cuda._NOT_READY, _cuda._OWN_CALLS)
    d2 = fake_cuda_driver(fake2, monkeypatch)  # (its own token, now the thread's)
    d2.hot_calls = d.hot_calls
    assert query(d2) == 1 and query() is None
    monkeypatch.setattr(_cuda._tls, "token", d._token)
    assert query() == 1 and query(d2) is None

    box = [fake.entry_points]

    class Moving(_cuda.CudaDevice):
        @property
        def _fast(self) -> Any:
            return box[0]

    m3 = like_d(Moving, fast=False)
    assert query(m3) == 1 and fake.calls[-1] == ("query", 0x100)
    box[0] = fake2.entry_points  # (nothing the driver's class or dict holds changed)
    n2 = len(fake2.calls)
    assert query(m3) == 1 and len(fake2.calls) == n2 + 2

    # a class that reads its attributes its own way: nothing kept for it
    gone = [False]

    class Own(_cuda.CudaDevice):
        def __getattribute__(self, name: str) -> Any:
            return None if gone[0] and name == "hot_calls" else object.__getattribute__(self, name)

    g = like_d(Own)
    assert query(g) == 1
    gone[0] = True
    assert query(g) is None

    # something changed while the full check reads (here by a key of the driver's dict
    # whose second comparison, after the methods were looked at, sets a method on the
    # instance): not kept with the answer read before it
    class Collides:
        armed, seen = False, 0

        def __hash__(self) -> int:
            return hash("_token")

        def __eq__(self, other: object) -> bool:
            if Collides.armed:
                Collides.seen += 1
                if Collides.seen == 2:
                    Collides.armed = False
                    c.query = lambda *a: True
            return False

    c = like_d(_cuda.CudaDevice, Collides())  # (before "_token": every lookup of it compares with this key)
    Collides.armed = True
    got = [_hotpath.direct_call("query", c, ev)]
    assert not Collides.armed and "query" in vars(c)  # (changed during the first call)
    got += [_hotpath.direct_call("query", c, ev) for _ in range(2)]
    # The calls after it follow the change. The first answers 1 where the change came
    # after the methods were looked at (here, Python 3.11 and 3.12.1), 2 where it came
    # before (the H200 image's 3.12.3 and pytest 9.1.1, run 104): either is what the
    # full check reads at that moment; a kept answer would give 1 again.
    assert got[1:] == [2, 2] and got[0] in (1, 2), got

    # a look for a replaced method that raises (a key of the dict whose comparison
    # fails): not taken as "not replaced", the Python method is called
    class Fails:
        def __hash__(self) -> int:
            return hash("query")

        def __eq__(self, other: object) -> bool:
            raise RuntimeError("no comparing")

    r = like_d(_cuda.CudaDevice, Fails())
    n = len(fake.calls)
    assert _hotpath.direct_call("query", r, ev) == 2 and len(fake.calls) == n
    assert _hotpath.direct_call("record", r, ev, cu.CUstream(0x200)) == 1  # (its own, not looked up as raising)


def test_direct_calls_only_where_the_python_would_make_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not made (the Python methods then): another context current on this thread, no
    fast path, a prepared launch of another type, dimensions that do not fit, no
    hot_calls (the simulated device)."""
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cuda

    fake = FakeDriver()
    d = _cuda_driver(fake, monkeypatch)
    st = cu.CUstream(0x200)
    monkeypatch.setattr(_cuda._tls, "token", object())
    assert _hotpath.direct_call("launch", d, _Prepared(), st) is None
    monkeypatch.setattr(_cuda._tls, "token", d._token)
    d._fast = None
    assert _hotpath.direct_call("launch", d, _Prepared(), st) is None
    d._fast = fake.entry_points

    class Other(_Prepared):
        __slots__ = ()

    assert _hotpath.direct_call("launch", d, Other(), st) == 0
    big = _Prepared()
    big.gx = 1 << 32
    assert _hotpath.direct_call("launch", d, big, st) == 0
    assert _hotpath.direct_call("launch", d, _Prepared(), "not a handle") == 0
    # a method replaced on the driver object (fault injection, a tool's wrapper) is called
    monkeypatch.setattr(d, "launch", lambda *a: None)
    monkeypatch.setattr(d, "query", lambda *a: True)
    assert _hotpath.direct_call("launch", d, _Prepared(), st) == 0
    assert _hotpath.direct_call("query", d, cu.CUevent(0x100)) == 2
    assert _hotpath.direct_call("record", d, cu.CUevent(0x100), st) == 1  # not replaced
    assert fake.calls == [("record", 0x100, 0x200)]
    fake.calls.clear()
    monkeypatch.delattr(d, "launch")
    monkeypatch.delattr(d, "query")
    assert _hotpath.direct_call("launch", d, _Prepared(), st) == 1
    assert fake.calls[-1][0] == "launch"
    # the class's own method bound to the driver in its dict (what monkeypatch.setattr
    # leaves behind when it undoes a replacement) is no replacement
    monkeypatch.setitem(vars(d), "launch", d.launch)
    assert _hotpath.direct_call("launch", d, _Prepared(), st) == 1
    other = _cuda.CudaDevice.__new__(_cuda.CudaDevice)
    monkeypatch.setitem(vars(d), "launch", other.launch)  # bound to another driver: a replacement
    assert _hotpath.direct_call("launch", d, _Prepared(), st) == 0
    monkeypatch.delitem(vars(d), "launch")
    # a subclass's override, and a method patched on the class, are called too
    sub = _cuda_driver(fake, monkeypatch)
    sub.__class__ = type("Sub", (_cuda.CudaDevice,), {"launch": lambda self, p, s: None})
    assert _hotpath.direct_call("launch", sub, _Prepared(), st) == 0
    assert _hotpath.direct_call("record", sub, cu.CUevent(0x100), st) == 1
    monkeypatch.setattr(_cuda.CudaDevice, "query", lambda self, e: True)
    assert _hotpath.direct_call("query", sub, cu.CUevent(0x100)) == 2
    monkeypatch.undo()
    fake.calls.clear()
    sim = trio_cuda.current_device()._driver
    if not ON_CUDA:
        assert _hotpath.direct_call("query", sim, object()) is None


def _gemm_driver(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[tuple[int, int]], list[int]]:
    """A fake CUDA driver (see _cuda_driver) with a Gemms state and a stand-in for
    cuGraphLaunch that records (exec, stream) and returns answer[0]."""
    from trio_cuda._backends._cublaslt import Gemms

    from ..helpers.fakes import GRAPH_LAUNCH, address

    d = _cuda_driver(FakeDriver(), monkeypatch)
    seen: list[tuple[int, int]] = []
    answer = [0]
    cb = GRAPH_LAUNCH(lambda g, st: seen.append((g, st)) or answer[0])
    d._keep_cb = cb  # (alive as long as the driver)
    d._graph_pfn = address(cb)
    d._gemms = Gemms()
    d._gemms.replay = True
    return d, seen, answer


def test_a_kept_gemm_graph_is_replayed_as_the_python_replays_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled replay of a kept GEMM graph (gemm_replay, what an ops GEMM's direct
    submission makes) against CudaDevice.matmul's replay branch, with a stand-in for
    cuGraphLaunch (no GPU needed): the same graph launched on the same stream, the same
    least-recently-used order afterwards, Gemms.replays counted alike; and every case it
    leaves to the Python (no such graph, replays off, matmul replaced, no entry point,
    another context current, a launch the driver refuses) changes nothing."""
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cuda
    from trio_cuda._backends._boundary import GemmDesc, GemmOperand

    d, seen, answer = _gemm_driver(monkeypatch)
    desc = GemmDesc(8, 4, 16, 1, GemmOperand(8, 16, 16, False, 0), GemmOperand(16, 4, 4, False, 0), "float32")
    other = GemmDesc(8, 4, 16, 1, GemmOperand(8, 16, 16, False, 0), GemmOperand(16, 4, 4, False, 0), "float32")
    st = cu.CUstream(0x200)
    k1, k2, k3 = (desc, 1, 2, 3, 0, 0x200), (other, 4, 5, 6, 0, 0x200), (desc, 1, 2, 3, 0, 0x300)
    graphs = d._gemms.graphs
    graphs.update({k1: (0x901, "exec 1"), k2: (0x902, "exec 2"), k3: (0x903, "exec 3")})
    c0 = counters()
    assert _hotpath.direct_call("gemm_replay", d, (desc, 1, 2, 3, 0), st) == 1
    assert seen == [(0x901, 0x200)]
    assert list(graphs) == [k2, k3, k1] and d._gemms.replays == 1
    assert delta(c0, counters())["gemm_replays"] == 1
    # the Python branch, on the same state: an equal desc (another object) finds k2
    d.matmul(desc, 4, 5, 6, 0, st, False, False, True)
    assert seen[-1] == (0x902, 0x200)
    assert list(graphs) == [k3, k1, k2] and d._gemms.replays == 2
    assert _hotpath.direct_call("gemm_replay", d, (other, 1, 2, 3, 0), cu.CUstream(0x300)) == 1
    assert seen[-1] == (0x903, 0x300) and list(graphs) == [k1, k2, k3] and d._gemms.replays == 3

    def unchanged(*args: Any) -> None:
        before = (list(graphs), d._gemms.replays, len(seen), counters()["gemm_replays"])
        assert _hotpath.direct_call("gemm_replay", d, *args) in (0, None)
        assert (list(graphs), d._gemms.replays, len(seen), counters()["gemm_replays"]) == before

    unchanged((desc, 1, 2, 4, 0), st)  # no graph kept for these pointers
    unchanged((desc, 1, 2, 3, 0), cu.CUstream(0x400))  # nor for this stream
    unchanged((desc, 1, 2, 3), st)  # not the step's 5-tuple
    d._gemms.replay = False
    unchanged((desc, 1, 2, 3, 0), st)
    d._gemms.replay = True
    monkeypatch.setattr(d, "_graph_pfn", 0)  # no entry point: the Python goes through cuda.bindings
    unchanged((desc, 1, 2, 3, 0), st)
    monkeypatch.undo()
    d, seen, answer = _gemm_driver(monkeypatch)
    d._gemms.graphs.update({k1: (0x901, "exec 1"), k2: (0x902, "exec 2")})
    graphs = d._gemms.graphs
    monkeypatch.setattr(d, "matmul", lambda *a: None)  # a tool's wrapper, fault injection: called
    unchanged((desc, 1, 2, 3, 0), st)
    monkeypatch.delattr(d, "matmul")
    monkeypatch.setattr(_cuda._tls, "token", object())  # another context current on this thread
    unchanged((desc, 1, 2, 3, 0), st)
    monkeypatch.setattr(_cuda._tls, "token", d._token)
    # refused by the driver: not counted, nothing else changed but the order (the Python
    # then launches again, and drops the graph or raises)
    answer[0] = int(cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    assert _hotpath.direct_call("gemm_replay", d, (desc, 1, 2, 3, 0), st) == 0
    assert seen == [(0x901, 0x200)] and d._gemms.replays == 0 and list(graphs) == [k2, k1]
    answer[0] = 0
    assert _hotpath.direct_call("gemm_replay", d, (desc, 1, 2, 3, 0), st) == 1 and d._gemms.replays == 1


def test_setup_refuses_classes_it_does_not_know() -> None:
    """A class whose attribute is not a plain slot makes setup fail (the runtime then
    keeps the Python methods)."""

    class NotSlotted:
        pass

    objs = dict(_kernel._hot_setup_objects())
    objs["Partition"] = NotSlotted
    with pytest.raises((TypeError, AttributeError)):
        _hotpath.setup(objs)
    assert _kernel.hotpath_active()


def test_switched_off_by_the_environment() -> None:
    import subprocess

    code = "import trio_cuda._kernel as k; print(k.hotpath_active(), k.DeviceOp.__await__ is k._await_py)"
    env = dict(os.environ, TRIO_CUDA_HOTPATH="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False True"


def test_a_prepared_type_without_a_slot_leaves_the_known_offsets_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's prepared launches of a type that lacks a field are not launched here,
    and launches of the known type still read the right fields (found by review: the
    offsets were overwritten part-way, and the next launch read wrong memory)."""
    from cuda.bindings import driver as cu

    from trio_cuda._backends import _cuda

    fake = FakeDriver()
    d = _cuda_driver(fake, monkeypatch)
    st = cu.CUstream(0x200)
    assert _hotpath.direct_call("launch", d, _Prepared(), st) == 1

    class Partial:
        __slots__ = ("bx", "fn", "gx", "gy", "gz")  # no by, bz, params

    part = Partial()
    part.fn, part.gx, part.gy, part.gz, part.bx = 1, 1, 1, 1, 1
    d.hot_calls = (_cuda._tls, Partial, _cuda._NOT_READY, _cuda._OWN_CALLS)
    assert _hotpath.direct_call("launch", d, part, st) == 0
    d.hot_calls = (_cuda._tls, _Prepared, _cuda._NOT_READY, _cuda._OWN_CALLS)
    fake.calls.clear()
    assert _hotpath.direct_call("launch", d, _Prepared(), st) == 1
    assert fake.calls == [("launch", 0x300, 7, 6, 5, 4, 3, 2, 0, 0x200, 0x400, None)]


async def test_replayed_ops_enqueue_the_same_both_ways() -> None:
    """A replayed ``ops`` call whose recipe is one prepared launch (ops.add, ops.rms_norm)
    goes through the compiled enqueue_direct: the same results, counters, points and
    pending accesses as the Python, including ordering after another stream's write."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            a, b, x, y, z, c = await two_streams_and_operands(dev)
            w = await api.full((64,), 2.0)
            for s in (a, b):  # recorded and prepared on both streams
                for _ in range(3):
                    await on(ops.add(x, y, out=y), s)
                    await on(ops.rms_norm(x, w, 1e-5, out=y), s)
                    await on(ops.add(x, x, out=y), s)
                    await on(ops.add(y, x, out=z), s)
            st0, c0 = stats_of(dev), counters()
            # a read after another stream's write: z = y + x on b waits for y = 2x on a
            await lowlevel.submit(sleep(c.partition((1,)), 50_000_000), a)
            first = await lowlevel.submit(ops.add(x, x, out=y), a)
            w0 = dev.statistics().stream_waits
            await on(ops.add(y, x, out=z), b)
            raw = dev.statistics().stream_waits - w0
            await first.wait()
            zs = (await z.to_host()).tolist()
            await lowlevel.submit(sleep(c.partition((1,)), 50_000_000), a)
            first = await lowlevel.submit(ops.add(x, x, out=y), a)  # y = 2x on a, behind the sleep
            w0 = dev.statistics().stream_waits
            await on(ops.add(y, x, out=y), b)  # y = 3x on b: waits for a's write
            waits = dev.statistics().stream_waits - w0
            await first.wait()
            for _ in range(5):
                await on(ops.add(y, x, out=y), b)  # y = 8x
            st = delta(st0, stats_of(dev))
            yb = y._buffer
            seen[compiled] = (raw, zs, waits, st, yb.writer == (b, b.seq), (await y.to_host()).tolist())
            if compiled:  # every direct submission of these ops went through the C
                d = delta(c0, counters())
                assert d["enqueues"] == st["direct"] == d["op_submits"] >= 3
                assert d["op_submits_python"] == 0
    assert seen[False] == seen[True]
    xs = np.arange(64, dtype=np.float32)
    assert seen[True][0] == 1 and seen[True][1] == (3 * xs).tolist()
    assert seen[True][2] == 1 and seen[True][4]
    assert seen[True][5] == (8 * xs).tolist()


def test_the_compiled_op_submission_is_installed_with_the_rest() -> None:
    from trio_cuda._ops import _core

    assert _core._hot_submit is not None
    assert _core.TensorOp._submit_now is _core._hot_submit
    with mode(False):
        assert _core.TensorOp._submit_now is _core._submit_now_py
    assert _core.TensorOp._submit_now is _core._hot_submit


def _copy_into(cls: type, op: Any) -> Any:
    """An instance of ``cls`` (a subclass of ``type(op)`` with an instance dict) with
    every slot of ``op``."""
    mine = cls.__new__(cls)
    for c in type(op).__mro__:
        for name in getattr(c, "__slots__", ()):
            if hasattr(op, name):
                setattr(mine, name, getattr(op, name))
    return mine


async def test_an_own_submit_now_on_the_instance_is_the_one_called() -> None:
    """The compiled await calls the class's compiled ``_submit_now`` as a plain function
    only where no instance dict can hold another: an op (a kernel launch, a tensor op) of
    a subclass with a dict whose instance has its own ``_submit_now`` gets that one
    called, with the same result, as the Python await does."""
    x, y = await api.arange(64), await api.zeros((64,))
    hx, ref = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    makers = (  # (the op, what it does to y)
        (lambda: saxpy(2.0, x, y.partition((64,))), lambda r: r + 2 * hx),  # y += 2 x
        (lambda: ops.add(y, x, out=y), lambda r: r + hx),  # y = y + x
    )
    for compiled in (True, False, True):
        with mode(compiled):
            for make, effect in makers:
                op = make()
                cls = type(op)
                own = _copy_into(type("Own", (cls,), {}), op)
                calls: list[Any] = []

                def submit_now(stream: Any, own: Any = own, cls: Any = cls, calls: list[Any] = calls) -> Any:
                    calls.append(stream)
                    return cls._submit_now(own, stream)

                own._submit_now = submit_now
                await own
                ref = effect(ref)
                assert len(calls) == 1, (compiled, type(op).__name__, calls)
                np.testing.assert_array_equal(await y.to_host(), ref)
    # the other kind's compiled method on a class of slots: refused as getattr refuses it
    from trio_cuda._ops._core import TensorOp

    descriptors = {_kernel._Launch: _kernel._Launch.__dict__["_submit_now"], TensorOp: TensorOp.__dict__["_submit_now"]}
    for make, _ in makers:
        op = make()
        other = next(d for c, d in descriptors.items() if not isinstance(op, c))
        foreign = _copy_into(type("Foreign", (type(op),), {"__slots__": (), "_submit_now": other}), op)
        with pytest.raises(TypeError, match="descriptor '_submit_now'"):
            foreign._submit_now  # noqa: B018 (the attribute read is what raises)
        with pytest.raises(TypeError, match="descriptor '_submit_now'"):
            await foreign
        np.testing.assert_array_equal(await y.to_host(), ref)


async def test_the_compiled_op_key_is_the_pythons() -> None:
    """The constructors' key, compiled: equal to _op_key's for every kind of argument
    (or the Python's own answer for the kinds it hands over), so recipes are shared by
    both ways and never between different calls."""
    from trio_cuda._ops import _core

    x, y, g = await api.ones((4, 8)), await api.zeros((4, 8)), await api.ones((8,))
    v = x[1:3]  # a view: no descriptor until first used (the Python makes it)
    op = ops.add(x, y)
    arg_sets = [
        (x, y, None),
        (x, 2.0, y),
        (x, -0.0, y),
        (x, 0.0, y),
        (x, 2, y),
        (x, True, y),
        (x, "gelu", (1, 2, 3)),
        (x, (1, 2.0)),  # a tuple with a float: the Python says None
        (x, np.float32(3.0), y),  # numpy scalar: the Python's key
        (x, np.dtype(np.float16), None),
        (v, g, None),
        (x, op, y),  # an op input: no key
        (x, [1, 2], y),  # a list: no key
    ]
    compiled = []
    for args in arg_sets:
        want = _core._op_key(op, args)
        got = _hotpath.op_key(op, args)
        assert got == want, args
        compiled.append(got)
    assert compiled[7] is None and compiled[11] is None and compiled[12] is None
    keyed = [k for k in compiled if k is not None]
    assert len(set(keyed)) == len(keyed)  # -0.0, 0.0, 2, True, 2.0: all different
    with mode(True):
        assert _core._key_of is _hotpath.op_key
    with mode(False):
        assert _core._key_of is _core._op_key


async def test_replayed_gemms_submit_the_same_both_ways() -> None:
    """A replayed ops.matmul (a prepared GEMM step, not a kernel launch) goes through the
    compiled TensorOp._submit_now once prepared (its first direct submission, which
    prepares it, is the Python's): the same results, counters and pending accesses."""
    dev = trio_cuda.current_device()
    hw = np.arange(48, dtype=np.float32).reshape(6, 8) / 7
    hx = np.arange(8, dtype=np.float32) - 3
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            a, b = wordless_stream(dev), wordless_stream(dev)
            w, x = await api.from_host(hw), await api.from_host(hx)
            y, z = await api.zeros((6,)), await api.zeros((6,))
            c0 = counters()
            await on(ops.matmul(w, x, out=y), a)  # recorded
            await on(ops.matmul(w, x, out=y), a)  # the first direct submission: prepares the step
            d = delta(c0, counters())
            first = (d["op_submits"], d["op_submits_python"])
            st0, c0 = stats_of(dev), counters()
            for _ in range(4):
                await on(ops.matmul(w, x, out=y), a)
            await on(ops.add(y, y, out=z), b)  # reads y on another stream: waits for a's GEMM
            await on(ops.matmul(w, x, out=y), b)  # now on b: writes after b's read, as the Python
            st = delta(st0, stats_of(dev))
            d = delta(c0, counters())
            seen[compiled] = (
                st,
                (await y.to_host()).tolist(),
                (await z.to_host()).tolist(),
                y._buffer.writer == (b, b.seq),
            )
            if compiled:
                assert first == (0, 1)  # the preparing submission went to the Python
                assert d["op_submits"] == st["direct"] == 5 and d["op_submits_python"] == 0
                assert d["gemms"] == 5  # each GEMM's enqueue too (gemm_enqueue)
    assert seen[False] == seen[True]
    want = hw @ hx
    np.testing.assert_allclose(seen[True][1], want, rtol=1e-5)
    np.testing.assert_allclose(seen[True][2], 2 * want, rtol=1e-5)
    assert seen[True][3] and seen[True][0]["direct"] == 5  # (the add's first call is recorded)


async def test_ops_the_compiled_submission_refuses_take_the_general_path_both_ways() -> None:
    """What the compiled TensorOp._submit_now declines (an op awaited twice, memory freed
    first, an op with op inputs, a stream being captured) ends as in the Python: the same
    errors, results and counters."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            x = await api.ones((8,))
            for _ in range(3):
                await ops.add(x, 1.0, out=x)
            st0, c0 = stats_of(dev), counters()
            op = ops.add(x, 1.0, out=x)
            await op  # direct
            with pytest.raises(trio_cuda.OpAlreadyExecuted):
                await op
            tmp = await api.zeros((1 << 12,))
            await ops.add(tmp, 1.0, out=tmp)
            del tmp
            gc.collect()
            dead = bool(dev._dead_buffers)
            await ops.add(x, 1.0, out=x)  # direct: frees the dropped memory first
            freed = not dev._dead_buffers
            await ops.add(ops.add(x, 1.0, out=x), 1.0, out=x)  # an op input: planned
            st = delta(st0, stats_of(dev))
            d = delta(c0, counters())
            seen[compiled] = (st, dead, freed, (await x.to_host()).tolist(), _tls.submitting)
            if compiled:
                assert d["op_submits"] == 2
    assert seen[False] == seen[True]
    assert seen[True][1] and seen[True][2]
    assert seen[True][3] == [8.0] * 8  # 1 + 3 + 1 + 1 + 2
    assert seen[True][4] is False


class _Adopted:
    """Another library's array, as DLPack sees it: adopting it makes a foreign buffer
    (not the runtime's Buffer class) on either backend."""

    def __init__(self, t: Any) -> None:
        self._t = t

    def __dlpack__(self, **kw: Any) -> Any:
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._t.__dlpack_device__()  # type: ignore[no-any-return]


async def test_an_op_on_adopted_memory_frees_dropped_memory_once_and_submits_in_c() -> None:
    """An operand whose buffer is not the runtime's class: the compiled submission reads
    it as the Python does (by attribute), so after it freed dropped memory (an effect)
    it goes on itself; the memory is freed once, the result is the Python's."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            own = await api.arange(16)
            x = api.from_dlpack(_Adopted(own))
            assert type(x._buffer).__name__ != "Buffer"
            y = await api.zeros((16,))
            for _ in range(3):
                await ops.add(x, y, out=y)
            tmp = await api.zeros((1 << 12,))
            await ops.add(tmp, 1.0, out=tmp)
            del tmp
            gc.collect()
            assert dev._dead_buffers
            frees = []
            flush = dev.flush_frees

            def counted(frees: list[int] = frees, flush: Any = flush) -> None:
                frees.append(1)
                flush()

            dev.flush_frees = counted  # type: ignore[method-assign]
            try:
                c0 = counters()
                await ops.add(x, y, out=y)
                d = delta(c0, counters())
            finally:
                del dev.flush_frees
            seen[compiled] = (len(frees), bool(dev._dead_buffers), (await y.to_host()).tolist())
            if compiled:
                assert (d["op_submits"], d["op_submits_python"]) == (1, 0)
    assert seen[False] == seen[True]
    assert seen[True][:2] == (1, False)
    assert seen[True][2] == (4 * np.arange(16, dtype=np.float32)).tolist()


@pytest.mark.parametrize(
    "where",
    [
        "_core.direct_enqueue",
        "_core._make",
        "_core.direct_ready",
        "_core._buffers",
        "_submit.direct_tidy",
        "_kernel.enqueue_direct",
    ],
)
async def test_a_replaced_runtime_function_sends_replayed_ops_to_the_python(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A tool or a test that wraps a function the Python submission calls sees its
    wrapper run: the compiled submission hands such calls to the Python."""
    from trio_cuda import _submit
    from trio_cuda._ops import _core

    module = {"_core": _core, "_submit": _submit, "_kernel": _kernel}[where.split(".")[0]]
    name = where.split(".")[1]
    w, x, y, z = await api.ones((8, 8)), await api.ones((8,)), await api.zeros((8,)), await api.zeros((8,))
    for _ in range(3):
        await ops.matmul(w, x, out=y)
        await ops.add(x, x, out=z)
    calls = []
    original = getattr(module, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(module, name, wrapper)
    c0 = counters()
    await ops.matmul(w, x, out=y)
    await ops.add(x, x, out=z)
    d = delta(c0, counters())
    assert (d["op_submits"], d["op_submits_python"]) == (0, 2)
    if name not in ("direct_tidy", "direct_enqueue", "enqueue_direct"):  # (called only when there is work for them)
        assert calls
    np.testing.assert_array_equal(await y.to_host(), np.full(8, 8.0, np.float32))
    np.testing.assert_array_equal(await z.to_host(), np.full(8, 2.0, np.float32))


@pytest.mark.parametrize("name", ["order_accesses", "note_accesses"])
async def test_a_replaced_access_function_of_the_gemm_step_sends_its_enqueue_to_the_python(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The compiled GEMM enqueue does _matmul._gemm_direct's work itself: a wrapper of a
    function that step calls (as a tool or a test may install) must run, so the step
    goes to the Python, and computes the same."""
    from trio_cuda._ops import _matmul

    dev = trio_cuda.current_device()
    a, b = wordless_stream(dev), wordless_stream(dev)
    w, x = await api.ones((8, 8)), await api.arange(8)
    y = await api.zeros((8,))
    for _ in range(3):
        await on(ops.matmul(w, x, out=y), a)
    calls = []
    original = getattr(_matmul, name)

    def wrapper(*args: Any) -> Any:
        calls.append(args[0])
        return original(*args)

    monkeypatch.setattr(_matmul, name, wrapper)
    c0 = counters()
    await on(ops.matmul(w, x, out=y), b)  # on another stream: ordered after a's write
    d = delta(c0, counters())
    assert (d["op_submits"], d["gemms"]) == (1, 0)
    assert calls == [b]
    assert y._buffer.writer == (b, b.seq)
    np.testing.assert_array_equal(await y.to_host(), np.full(8, 28.0, np.float32))


@pytest.mark.parametrize("change", ["step not prepared", "recipe dropped"])
def test_python_run_by_the_thread_flag_read_cannot_break_the_compiled_submission(change: str) -> None:
    """Reading ``_tls.submitting`` may run Python (a property, a finalizer), which may
    change the recipe or drop it: the compiled submission reads nothing before it, and
    holds what it reads after (the reviewer's crash: it read the step first)."""
    from trio_cuda._guard import _ThreadState
    from trio_cuda._ops import _core

    dev = trio_cuda.current_device()
    w, x, y = api.ones((8, 8)).sync(), api.ones((8,)).sync(), api.zeros((8,)).sync()
    for _ in range(3):
        ops.matmul(w, x, out=y).sync()
    op = ops.matmul(w, x, out=y)
    assert op._hit is not None and op._hit.direct is not None
    step = op._hit.direct
    fired = []

    def flag(self: Any) -> bool:
        if not fired:
            fired.append(1)
            if change == "step not prepared":
                step.ready = False
            else:
                op._hit = None
                _core._cache.clear()
                del step.ready
                gc.collect()
        return bool(self.__dict__.get("_flag", False))

    def set_flag(self: Any, v: bool) -> None:
        self.__dict__["_flag"] = v

    _ThreadState.submitting = property(flag, set_flag)  # type: ignore[assignment]
    try:
        got = op._submit_now(dev._submission_stream())
    finally:
        _ThreadState.submitting = False  # type: ignore[assignment]
    assert fired
    if got is not None:
        value, ev, names = got
        assert value._buffer is y._buffer and names == ["ops.matmul"]
        if ev is not None:
            dev.wait_blocking(ev)
    ops.matmul(w, x, out=y).sync()
    np.testing.assert_array_equal(y.to_host().sync(), np.full(8, 8.0, np.float32))


async def test_a_failed_gemm_of_a_replayed_op_counts_and_releases_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    w, x, y = await api.ones((8, 8)), await api.ones((8,)), await api.zeros((8,))
    for _ in range(3):
        await ops.matmul(w, x, out=y)
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            await ops.matmul(w, x, out=y)  # prepared on this path too
            c0 = counters()

            def refuse(*a: Any, **k: Any) -> None:
                raise trio_cuda.LaunchError("GEMM refused by the test")

            monkeypatch.setattr(dev._driver, "matmul", refuse)
            st0 = stats_of(dev)
            op = ops.matmul(w, x, out=y)
            with pytest.raises(trio_cuda.LaunchError, match="GEMM refused by the test"):
                await op
            monkeypatch.undo()
            with pytest.raises(trio_cuda.OpAlreadyExecuted):
                await op
            free = lock_taken_by_another_thread()
            seen[compiled] = (delta(st0, stats_of(dev)), _tls.submitting, free)
            if compiled:
                assert delta(c0, counters())["op_submits"] == 0  # (it raised: not counted as made)
    assert seen[False] == seen[True]
    assert seen[True][0]["failed"] == 1 and seen[True][1] is False and seen[True][2] == [True]
    await ops.matmul(w, x, out=y)
    np.testing.assert_array_equal(await y.to_host(), np.full(8, 8.0, np.float32))


def test_the_compiled_op_submission_from_threads_lands_every_add() -> None:
    """Threads submitting the same replayed op on one buffer (``op.sync()``) through the
    compiled path: every add lands once (the runtime lock orders them)."""
    x = api.zeros((32,)).sync()
    for _ in range(3):
        ops.add(x, 1.0, out=x).sync()
    c0 = counters()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                ops.add(x, 1.0, out=x).sync()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert delta(c0, counters())["op_submits"] >= 50
    np.testing.assert_array_equal(x.to_host().sync(), np.full(32, 203.0, np.float32))


async def test_a_failed_launch_of_a_replayed_op_counts_and_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    x = await api.arange(16)
    y = await api.zeros((16,))
    for _ in range(3):
        await ops.add(x, x, out=y)
    seen = {}
    for compiled in (False, True):
        with mode(compiled):

            def refuse(*a: Any) -> None:
                raise trio_cuda.LaunchError("refused by the test")

            monkeypatch.setattr(dev._driver, "launch", refuse)
            st0 = stats_of(dev)
            with pytest.raises(trio_cuda.LaunchError, match="refused by the test"):
                await ops.add(x, x, out=y)
            monkeypatch.undo()
            seen[compiled] = (delta(st0, stats_of(dev)), _tls.submitting, LOCK.acquire(blocking=False))
            LOCK.release()
    assert seen[False] == seen[True]
    assert seen[True][0]["failed"] == 1 and seen[True][1] is False
    await ops.add(x, x, out=y)
    np.testing.assert_array_equal(await y.to_host(), 2 * np.arange(16, dtype=np.float32))


# -- the general path: the compiled walk, _Launch._plan and the step runner ------------------
def saxpy_chain(x: Any, part: Any, n: int) -> Any:
    """``y += x`` n times as one DAG: each launch takes the previous one's output
    partition (``.last()``), the chain bench_host awaits once."""
    op = saxpy(1.0, x, part)
    for _ in range(n - 1):
        op = saxpy(1.0, x, op.last())
    return op


async def prepared_saxpy(dev: trio_cuda.Device, n: int) -> tuple[trio_cuda.Stream, Any, Any, Any]:
    """A stream without a completion word, x = arange(n), y = 0 and y's partition, the
    launch ``saxpy(1.0, x, y)`` made once on the stream (prepared): y = x."""
    s = wordless_stream(dev)
    x, y = await api.arange(n), await api.zeros((n,))
    part = y.partition((n,))
    await on(saxpy(1.0, x, part), s)
    return s, x, y, part


def pending_of(*bufs: Any) -> list[Any]:
    return [(b.writer, dict(b.readers), dict(b.lifetime)) for b in bufs]


async def test_a_chain_plans_and_runs_the_same_both_ways() -> None:
    """A chain of 40 prepared launches awaited once: the compiled walk plans every one
    (none handed to the Python) and the step runner enqueues them; the results, the
    counters, the pending accesses and the stream's points are the Python's."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            s = wordless_stream(dev)
            x, y = await api.arange(64), await api.zeros((64,))
            part = y.partition((64,))
            await on(saxpy(1.0, x, part), s)  # prepares the launch (the general path)
            before, c0, seq0 = stats_of(dev), counters(), s.seq
            out = await on(saxpy_chain(x, part, 40), s)
            seen[compiled] = (
                delta(before, stats_of(dev)),
                s.seq - seq0,
                dict(x._buffer.readers) == {s: s.seq} and pending_of(y._buffer) == [((s, s.seq), {}, {})],
                out[2] is part,
                (await y.to_host()).tolist(),
                delta(c0, counters()),
            )
    py, c = seen[False], seen[True]
    assert py[:5] == c[:5]
    assert c[0]["launches"] == 40 and c[0]["submissions"] == 1 and c[1] == 40 and c[2] and c[3]
    assert c[4] == (41 * np.arange(64, dtype=np.float32)).tolist()
    assert c[5]["plans"] == 40 and c[5]["plans_python"] == 0 and c[5]["steps"] == 40
    assert py[5]["plans"] == py[5]["steps"] == 0  # the Python ran it all


async def test_a_dag_of_other_ops_is_walked_in_turns_with_the_python() -> None:
    """zip, then(), shared ops, a map and launches whose memory the plan allocates mix
    frames the compiled walk hands back with frames it walks: the same results and
    counters both ways, and both loops did part of it."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            x, y, z = await api.arange(32), await api.zeros((32,)), await api.zeros((32,))
            yp, zp = y.partition((32,)), z.partition((32,))
            await saxpy(1.0, x, yp)
            await saxpy(1.0, x, zp)
            before, c0 = stats_of(dev), counters()
            shared = saxpy_chain(x, yp, 3).shared()
            left = shared.then(lambda out, zp=zp: saxpy(2.0, out[1], zp))  # z += 2 * x, after the chain
            fresh = api.zeros((32,)).then(lambda t, x=x: add(t.partition((32,)), x, x))  # memory this plan allocates
            right = saxpy(1.0, x, shared.last()).last()  # y += x after the chain, on its output
            _, b, t = await trio_cuda.zip(left, right, fresh)
            counted = delta(before, stats_of(dev))
            del counted["stream_waits"]  # (which streams the pool hands out differs between the runs)
            seen[compiled] = (
                counted,
                (await y.to_host()).tolist(),
                (await z.to_host()).tolist(),
                (await t[0].tensor.to_host()).tolist(),
                b is yp,
                delta(c0, counters()),
            )
    py, c = seen[False], seen[True]
    assert py[:5] == c[:5]
    xs = np.arange(32, dtype=np.float32)
    # y: x, the chain's 3, the right branch's 1; z: x, then 2 * (the chain's output's x)
    assert c[1] == (5 * xs).tolist() and c[2] == (3 * xs).tolist() and c[3] == (2 * xs).tolist() and c[4]
    assert c[0]["launches"] == 6 and c[0]["failed"] == 0
    cc = c[5]
    assert cc["walk_handbacks"] > 0 and cc["plans"] >= 3  # both loops walked
    assert cc["plans"] + cc["plans_python"] >= 6


async def test_a_chain_on_another_stream_waits_for_its_pending_writes() -> None:
    """A chain on stream B reading memory stream A is still writing (behind a sleep): the
    compiled step runner waits for it, as the Python does."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            a, b, x, y, z, c = await two_streams_and_operands(dev)
            yp, zp = y.partition((64,)), z.partition((64,))
            await on(saxpy(1.0, x, yp), a)
            await on(saxpy(1.0, y, zp), b)
            w0 = dev.statistics().stream_waits
            await lowlevel.submit(sleep(c.partition((1,)), 50_000_000), a)
            pending = await lowlevel.submit(saxpy(1.0, x, yp), a)  # y = 2x, late
            c0 = counters()
            await on(saxpy_chain(y, zp, 3), b)  # z += y three times: z = x + 3 * 2x
            seen[compiled] = (
                dev.statistics().stream_waits - w0,
                dict(y._buffer.readers) == {b: b.seq},
                z._buffer.writer == (b, b.seq),
                (await z.to_host()).tolist(),
            )
            await pending.wait()
            if compiled:
                assert delta(c0, counters())["steps"] == 3
    assert seen[False] == seen[True]
    assert seen[True][0] == 1 and seen[True][1] and seen[True][2]
    assert seen[True][3] == (7 * np.arange(64, dtype=np.float32)).tolist()


async def test_methods_replaced_on_the_ops_are_called_by_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A _plan replaced on the launch or select class (a test's or a tool's wrapper) is
    called for every op: the compiled walk leaves those frames to the Python."""
    from trio_cuda._op import _Select

    x, y = await api.arange(16), await api.zeros((16,))
    part = y.partition((16,))
    await saxpy(1.0, x, part)
    calls = {"launch": 0, "select": 0}
    launch_plan, select_plan = _kernel._Launch._plan, _Select._plan

    def wrap_launch(self: Any, *a: Any) -> Any:
        calls["launch"] += 1
        return launch_plan(self, *a)

    def wrap_select(self: Any, *a: Any) -> Any:
        calls["select"] += 1
        return select_plan(self, *a)

    monkeypatch.setattr(_kernel._Launch, "_plan", wrap_launch)
    await saxpy_chain(x, part, 5)
    assert calls == {"launch": 5, "select": 0}  # (the selects were walked here)
    monkeypatch.setattr(_Select, "_plan", wrap_select)
    await saxpy_chain(x, part, 5)
    assert calls == {"launch": 10, "select": 4}
    monkeypatch.undo()
    np.testing.assert_array_equal(await y.to_host(), 11 * np.arange(16, dtype=np.float32))


async def test_a_walk_that_meets_an_executed_op_fails_the_same_both_ways() -> None:
    """An op executed before, deep in a chain: OpAlreadyExecuted, nothing launched, and
    the ops the walk claimed left as the Python leaves them."""
    dev = trio_cuda.current_device()
    x, y = await api.arange(16), await api.zeros((16,))
    part = y.partition((16,))
    await saxpy(1.0, x, part)
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            done = saxpy(1.0, x, part)
            await done
            ops_ = [saxpy(1.0, x, done.last())]
            for _ in range(4):
                ops_.append(saxpy(1.0, x, ops_[-1].last()))
            before = stats_of(dev)
            with pytest.raises(trio_cuda.OpAlreadyExecuted):
                await ops_[-1]
            seen[compiled] = (delta(before, stats_of(dev)), [type(o._state).__name__ for o in ops_])
    assert seen[False] == seen[True]
    assert seen[True][0]["launches"] == 0
    np.testing.assert_array_equal(await y.to_host(), 3 * np.arange(16, dtype=np.float32))


async def test_a_launch_refused_mid_chain_fails_the_same_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver refusing the third launch of a chain: the error reaches the task, the
    submission counts as failed, the launches before it count, the flag is down and the
    lock free; the device works on."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            s, x, y, part = await prepared_saxpy(dev, 16)
            real = dev._driver.launch
            n = [0]

            def refuse_third(*a: Any, real: Any = real, n: list[int] = n) -> Any:
                n[0] += 1
                if n[0] == 3:
                    raise trio_cuda.LaunchError("refused by the test")
                return real(*a)

            monkeypatch.setattr(dev._driver, "launch", refuse_third)
            before = stats_of(dev)
            with pytest.raises(trio_cuda.LaunchError, match="refused by the test"):
                await on(saxpy_chain(x, part, 5), s)
            monkeypatch.undo()
            counted = delta(before, stats_of(dev))
            del counted["stream_waits"]  # (the second run waits once for what the first one's failure left; either order)
            seen[compiled] = (counted, n[0], lock_taken_by_another_thread(), _tls.submitting)
    assert seen[False] == seen[True]
    assert seen[True][0]["failed"] == 1 and seen[True][0]["launches"] == 2 and seen[True][1:] == (3, [True], False)
    await on(saxpy(1.0, x, part), s)
    np.testing.assert_array_equal(await y.to_host(), 4 * np.arange(16, dtype=np.float32))


async def test_chains_leak_no_reference() -> None:
    """200 chains through the compiled walk, plan and steps: the objects they touch keep
    their reference counts."""
    dev = trio_cuda.current_device()
    s = wordless_stream(dev)
    x, y = await api.arange(64), await api.zeros((64,))
    part = y.partition((64,))
    objs = (x, y, part, s, dev, saxpy, x._buffer, y._buffer, saxpy._fast)
    refs = []
    c0 = counters()
    for _ in range(3):  # (the first window settles what earlier tests left to collect)
        for _ in range(100):
            await on(saxpy_chain(x, part, 4), s)
        gc.collect()
        refs.append([sys.getrefcount(o) for o in objs])
    d = delta(c0, counters())
    assert d["plans"] + d["plans_python"] == 1200 and d["plans"] >= 1196  # (the first chain prepares)
    assert refs[1] == refs[2]
    np.testing.assert_array_equal(await y.to_host(), 1200 * np.arange(64, dtype=np.float32))


def test_the_walk_hands_back_what_it_does_not_know() -> None:
    """walk() on frames it does not handle returns False and leaves them as they were;
    run_steps() calls any step that is not a prepared launch."""
    sentinel = object()
    work: list[Any] = [(sentinel, None, -1)]
    values: list[Any] = []

    class P:
        claimed: list[Any] = []  # noqa: RUF012

    assert _hotpath.walk(P(), work, values) is False
    assert work == [(sentinel, None, -1)] and values == [] and P.claimed == []
    called = []
    _hotpath.run_steps([(lambda lane, arg: called.append((lane, arg)), "lane", 7)])
    assert called == [("lane", 7)]
    with pytest.raises(ValueError, match="not \\(fn, lane, arg\\)"):
        _hotpath.run_steps([(print, "lane")])


async def _drop_a_buffer_while_waiting(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[float]]:
    from trio_cuda._stream import Stream

    dev = trio_cuda.current_device()
    a, b, x, y, spare, c = await two_streams_and_operands(dev)
    yp = y.partition((64,))
    await on(saxpy(1.0, x, yp), a)
    await on(saxpy(1.0, x, yp), b)
    await lowlevel.submit(sleep(c.partition((1,)), 20_000_000), a)
    pending = await lowlevel.submit(saxpy(1.0, x, yp), a)  # y written on a, late
    real = Stream.wait_for
    freed: list[int] = []
    swapped: list[int] = []

    def swap(self: Any, other: Any, seq: int, **kw: Any) -> Any:
        if not swapped:
            swapped.append(1)
            old = yp.tensor._buffer
            weakref.finalize(old, freed.append, 1)
            yp.tensor._buffer = y._buffer = spare._buffer
            del old
            junk = [object() for _ in range(2000)]  # (reuses freed memory)
            del junk
        return real(self, other, seq, **kw)

    monkeypatch.setattr(Stream, "wait_for", swap)
    await on(saxpy_chain(x, yp, 2), b)
    monkeypatch.undo()
    await pending.wait()
    return freed, (await spare.to_host()).tolist()


async def test_a_buffer_dropped_while_waiting_for_another_stream_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replaced Stream.wait_for (a tool's wrapper) that drops the last reference to the
    buffer being ordered, mid-enqueue: the compiled enqueue holds it, as the Python's
    local variable does (found by review: it read the freed buffer)."""
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            seen[compiled] = await _drop_a_buffer_while_waiting(monkeypatch)
    assert seen[False] == seen[True]
    assert seen[True][0] == [1]  # the buffer went while its order was being made


def counting_stats(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The device's statistics replaced by an instance of a subclass of their class (as a
    tool's counting wrapper may), with the same counts."""
    from trio_cuda._device import _Counters

    class Counting(_Counters):
        __slots__ = ()

    mine = Counting()
    for f in _Counters.__slots__:
        setattr(mine, f, getattr(dev._stats, f))
    monkeypatch.setattr(dev, "_stats", mine)
    return mine


async def test_statistics_of_another_class_are_counted_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """device._stats replaced by a subclass (a tool's counting wrapper): a chain counts
    its launches in it both ways (found by review: the compiled steps raised after the
    first launch)."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            s, x, y, part = await prepared_saxpy(dev, 16)
            mine = counting_stats(dev, monkeypatch)
            s0, l0 = s.seq, mine.launches
            await on(saxpy_chain(x, part, 3), s)
            monkeypatch.undo()
            seen[compiled] = (s.seq - s0, mine.launches - l0, (await y.to_host()).tolist())
    assert seen[False] == seen[True] == (3, 3, (4 * np.arange(16, dtype=np.float32)).tolist())


async def test_statistics_of_another_class_count_replayed_ops_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for replayed ops' direct submissions (a launch: ops.add; a GEMM:
    ops.matmul): counted in the replacement, the work done, nothing raised after the
    enqueue (found by review: the compiled enqueues raised after the GEMM or the launch,
    losing the result)."""
    dev = trio_cuda.current_device()
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            w, x = await api.ones((8, 8)), await api.arange(8)
            y, z = await api.zeros((8,)), await api.zeros((8,))
            for _ in range(3):
                await ops.matmul(w, x, out=y)
                await ops.add(x, x, out=z)
            mine = counting_stats(dev, monkeypatch)
            c0, sub0, l0 = counters(), mine.submissions, mine.launches
            await ops.matmul(w, x, out=y)
            await ops.add(x, x, out=z)
            d = delta(c0, counters())
            monkeypatch.undo()
            seen[compiled] = (
                mine.submissions - sub0,
                mine.launches - l0,
                (await y.to_host()).tolist(),
                (await z.to_host()).tolist(),
            )
            if compiled:
                assert (d["op_submits"], d["gemms"]) == (2, 1)
    assert seen[False] == seen[True] == (2, 1, [28.0] * 8, (2 * np.arange(8, dtype=np.float32)).tolist())


async def test_a_replaced_event_at_is_called_by_the_compiled_enqueues(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stream.event_at replaced on the class (a tool's wrapper): every submission's event
    comes from it, both ways (found by review: the compiled enqueues made their own)."""
    from trio_cuda._stream import Stream

    w, x, y, z = await api.ones((8, 8)), await api.arange(8), await api.zeros((8,)), await api.zeros((8,))
    part = z.partition((8,))
    for _ in range(3):
        await ops.matmul(w, x, out=y)
        await add(part, x, x)
    seen = {}
    for compiled in (False, True):
        with mode(compiled):
            calls: list[int] = []
            real = Stream.event_at

            def event_at(self: Any, seq: int, real: Any = real, calls: list[int] = calls) -> Any:
                calls.append(seq)
                return real(self, seq)

            monkeypatch.setattr(Stream, "event_at", event_at)
            await ops.matmul(w, x, out=y)
            await add(part, x, x)
            monkeypatch.undo()
            seen[compiled] = len(calls)
    assert seen[False] == seen[True] == 2


async def test_step_functions_replaced_in_the_module_are_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """_kernel._prepared_step or _kernel._enqueue_launch replaced (a tool's wrapper): the
    compiled plan and steps call the wrapper for each launch, as the Python does (found by
    review: the compiled ones bypassed them)."""
    x, y = await api.arange(16), await api.zeros((16,))
    part = y.partition((16,))
    await saxpy(1.0, x, part)
    for name in ("_prepared_step", "_enqueue_launch"):
        for compiled in (False, True):
            with mode(compiled):
                real = getattr(_kernel, name)
                calls = [0]

                def wrapper(*a: Any, real: Any = real, calls: list[int] = calls) -> Any:
                    calls[0] += 1
                    return real(*a)

                monkeypatch.setattr(_kernel, name, wrapper)
                await saxpy_chain(x, part, 4)
                monkeypatch.undo()
                assert calls[0] == 4, (name, compiled)
    np.testing.assert_array_equal(await y.to_host(), 17 * np.arange(16, dtype=np.float32))


# -- the compiled await (DeviceOp.__await__) ---------------------------------------------
# Its behaviour against the Python generator's, scenario by scenario (cancels at each
# point, KeyboardInterrupt, throw/close/send at the trap, errors from the policy and
# from _submit_now, faults, guest mode, frames, references), is in
# tests/compiled/test_traps_equivalence.py, which runs each scenario three ways.


def drive(aw: Any) -> tuple[int, Any]:
    """Drive an await by hand inside a trio task, answering each trap as trio would
    (without the scheduling): (traps yielded, the value it returned)."""
    from trio_cuda import _notifier, _traps

    n = 0
    budget = _notifier._budget_ns
    _notifier._budget_ns = 60 * 10**9  # poll between the traps, never park (nothing wakes it here)
    try:
        got = aw.send(None)
        while True:
            assert got is _traps.CANCEL_SHIELDED_CHECKPOINT
            n += 1
            got = aw.send(outcome.Value(None))
    except StopIteration as stop:
        return n, stop.value
    finally:
        _notifier._budget_ns = budget


async def test_the_compiled_await_counts_its_awaits_and_hands_the_rest_over() -> None:
    dev = trio_cuda.current_device()
    _a, _b, x, y, z, c = await two_streams_and_operands(dev)
    p = z.partition((32,))
    await add(p, x, y)  # prepared
    before = counters()
    for _ in range(5):
        await add(p, x, y)  # direct: begun here
    await add(p, x, y).then(lambda t: t)  # the general path: _run_planned
    await sleep(c.partition((1,)), 2_000_000)  # the general path, a wait that goes on
    d = delta(before, counters())
    assert d["awaits"] == 5
    assert d["awaits_python"] == 0
    assert d["awaits_rest"] <= 5  # (a first poll that finds the add pending hands over)
    np.testing.assert_array_equal(await z.to_host(), np.arange(64))


async def test_the_compiled_await_as_an_iterator() -> None:
    """send/next/close/throw as a generator's: a non-None first send is refused, the
    value comes back in StopIteration (a tuple as one value), an exhausted await says
    StopIteration again, and a close or throw at the trap ends it."""
    dev = trio_cuda.current_device()
    _a, _b, x, y, z, _c = await two_streams_and_operands(dev)
    p = z.partition((32,))
    await add(p, x, y)
    aw = add(p, x, y).__await__()
    assert type(aw).__name__ == "Await"
    with pytest.raises(TypeError, match="non-None"):
        aw.send(1)
    traps, value = drive(aw)
    assert traps >= 1
    assert value == (p, x, y)  # a launch's output: its arguments, one tuple in StopIteration
    with pytest.raises(StopIteration) as stop:
        aw.send(None)
    assert stop.value.value is None
    # a tuple output (the general path, driven through the Python handed over to)
    u = await api.zeros((4,))
    pair = trio_cuda.zip(api.full((2,), 3.0), api.full((2,), 4.0)).then(lambda t: t)
    _, got = drive(pair.__await__())
    assert isinstance(got, tuple) and len(got) == 2
    assert [float((await t.to_host())[0]) for t in got] == [3.0, 4.0]
    # close and throw at the trap
    for action in ("close", "throw"):
        aw = add(u.partition((4,)), u, u).__await__()
        assert aw.send(None) is not None
        if action == "close":
            assert aw.close() is None
        else:
            with pytest.raises(KeyError, match="thrown"):
                aw.throw(KeyError("thrown"))
        with pytest.raises(StopIteration):
            aw.send(None)  # over
    await trio.to_thread.run_sync(dev.synchronize)


def test_the_compiled_await_outside_trio_fails_as_the_python_does() -> None:
    """Outside trio it hands the await to the Python generator, which lets trio say so."""
    with mode(True):
        errors = []
        for compiled in (True, False):
            DeviceOp.__await__ = _kernel._hot_calls[0] if compiled else _kernel._await_py  # type: ignore[method-assign]
            before = counters()
            aw = api.zeros((4,)).__await__()
            with pytest.raises(RuntimeError) as err:
                aw.send(None)
            errors.append(str(err.value))
            assert delta(before, counters())["awaits_python"] == (1 if compiled else 0)
        assert errors[0] == errors[1]


def test_setup_calls_refuses_trio_classes_it_does_not_know() -> None:
    """A trio class whose field is not a plain slot makes setup_calls fail as a whole;
    the await bound before keeps working."""

    class NotSlotted:
        _cancel_status = _runner = _cancel_points = None

    objs = dict(_kernel._hot_calls_objects() or {})
    assert objs, "trio's internals were not found"
    objs["Task"] = NotSlotted
    with pytest.raises(TypeError):
        _hotpath.setup_calls(objs)
    objs = dict(_kernel._hot_calls_objects() or {})
    del objs["await_rest"]
    with pytest.raises(KeyError):
        _hotpath.setup_calls(objs)

    async def main() -> float:
        before = counters()["awaits"]
        x = await api.full((4,), 2.0)
        p = x.partition((4,))
        await add(p, x, x)
        await add(p, x, x)
        assert counters()["awaits"] > before
        return float((await x.to_host())[0])

    assert trio.run(main) == 8.0


async def test_event_handles_come_from_the_pool_and_go_back_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled Device._event_handle takes the pool's handles of the device's
    generation (dropping older ones) and Event.__del__ gives them back, both ways; a
    method replaced on the class or the instance is called instead."""
    dev = trio_cuda.current_device()
    s = wordless_stream(dev)
    x = await api.full((32,), 1.0)
    p = x.partition((32,))
    seen = {}
    for compiled in (True, False):
        with mode(compiled):
            await on(add(p, x, x), s)
            await trio.to_thread.run_sync(dev.synchronize)
            gc.collect()
            with LOCK:
                dev._event_pool.clear()
                stale = object()
                dev._event_pool.append((dev.generation - 1, stale))  # an older generation's
                h = dev._event_handle()  # (the Python: a new one)
                dev._event_pool.append((dev.generation, h))
                dev._event_pool.append((dev.generation - 1, stale))
            held = s._last_event  # (held: a done last event no one holds is recorded again)
            await on(add(p, x, x), s)  # its event takes h (the stale entry on top is dropped)
            took = s._last_event.handle is h
            held = s._last_event
            await on(add(p, x, x), s)  # a new event (the pool has only a stale one) replaces it
            del held
            gc.collect()
            pool = list(dev._event_pool)
            seen[compiled] = (took, (dev.generation, h) in pool, all(g == dev.generation for g, _ in pool))
    assert seen == {True: (True, True, True), False: (True, True, True)}
    # replaced on the instance / the class: called
    calls: list[str] = []
    orig_recycle, orig_handle = trio_cuda.Device._recycle_event, trio_cuda.Device._event_handle

    def recycle(self: Any, generation: int, handle: Any) -> None:
        calls.append("recycle")
        orig_recycle(self, generation, handle)

    def handle(self: Any) -> Any:
        calls.append("handle")
        return orig_handle(self)

    monkeypatch.setattr(trio_cuda.Device, "_event_handle", handle)
    monkeypatch.setattr(dev, "_recycle_event", lambda g, h: recycle(dev, g, h))
    await on(add(p, x, x), s)
    gc.collect()
    assert "handle" in calls and "recycle" in calls
    np.testing.assert_array_equal(await x.to_host(), np.full(32, 128.0))  # doubled 7 times


async def test_awaits_from_many_tasks_and_threads_through_the_compiled_await() -> None:
    """256 tasks in this trio run and 4 threads each with its own trio run, all awaiting
    tiny launches on their own tensors: every result is right."""
    n_tasks, rounds = 64, 20
    xs = [await api.zeros((32,)) for _ in range(n_tasks)]

    async def worker(x: Any) -> None:
        p = x.partition((32,))
        for _ in range(rounds):
            await add(p, x, await api.full((32,), 1.0))

    def thread_main() -> list[float]:
        async def run() -> list[float]:
            x = await api.zeros((32,))
            for _ in range(rounds):
                await add(x.partition((32,)), x, await api.full((32,), 1.0))
            return list(await x.to_host())

        return trio.run(run)

    results: list[list[float]] = []

    async def in_thread() -> None:
        results.append(await trio.to_thread.run_sync(thread_main))

    async with trio.open_nursery() as nursery:
        for x in xs:
            nursery.start_soon(worker, x)
        for _ in range(4):
            nursery.start_soon(in_thread)
    for x in xs:
        np.testing.assert_array_equal(await x.to_host(), np.full(32, float(rounds)))
    assert results == [[float(rounds)] * 32] * 4


def _launch_slots(op: Any) -> tuple[Any, ...]:
    return (type(op), op._inputs, op._state, op._arity, op._kernel, op._args, op._inputs_at)


async def test_kernel_calls_make_the_same_launches_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel.__call__ in C makes the launch the Python makes (every slot), for plain
    tensors, partitions and scalars; op inputs, other scalars, a wrong count, a bad
    argument and a replaced _Launch.__init__ go to the Python method (same errors)."""
    x, y = await api.arange(32), await api.zeros((32,))
    p = y.partition((32,))
    pending = api.full((32,), 2.0)
    cases: list[tuple[Any, tuple[Any, ...]]] = [
        (add, (p, x, x)),
        (add, (y, x, x)),
        (saxpy, (p, 2.0, x)),
        (saxpy, (p, 2, x)),
        (saxpy, (p, np.float32(2.0), x)),  # a numpy scalar: the Python's
        (saxpy, (p, True, x)),  # bool is not exactly int: the Python's
        (add, (p, pending, x)),  # an op input: the Python's
    ]
    errors = [(add, (p, x)), (add, (p, x, "x"))]
    got: dict[bool, list[Any]] = {}
    for compiled in (True, False):
        with mode(compiled):
            before = counters()
            made = [_launch_slots(k(*a)) for k, a in cases]
            msgs = []
            for k, a in errors:
                with pytest.raises(TypeError) as err:
                    k(*a)
                msgs.append(str(err.value))
            with pytest.raises(TypeError):
                add(p, x, x, extra=1)  # type: ignore[call-arg]
            d = delta(before, counters())
            got[compiled] = [made, msgs, (d["calls"], d["calls_python"])]
    assert got[True][:2] == got[False][:2]
    assert got[True][2] == (4, 6)  # 4 made here; 3 cases, 2 errors and the keyword to the Python
    assert got[False][2] == (0, 0)
    # a replaced _Launch.__init__ is called
    inits: list[int] = []
    orig = _kernel._Launch.__init__

    def init(self: Any, k: Any, args: Any, ops: Any) -> None:
        inits.append(len(args))
        orig(self, k, args, ops)

    monkeypatch.setattr(_kernel._Launch, "__init__", init)
    op = add(p, x, x)
    assert inits == [3]
    await op
    np.testing.assert_array_equal(await y.to_host(), np.arange(32) * 2)


# -- found by review: the compiled await against the Python generator --------------------
def compiled_and_python(fn: Any, trace: bool = False) -> dict[str, Any]:
    """``trio.run(fn)`` through the compiled await (C) and the Python generator (P),
    optionally under a tracer (which makes 3.11's await call ``send`` instead of
    ``am_send``)."""
    assert _kernel._hot_calls is not None
    c, p = _kernel._hot_calls[0], _kernel._await_py
    out = {}
    for name, aw in (("C", c), ("P", p)):
        DeviceOp.__await__ = aw  # type: ignore[method-assign]
        if trace:
            sys.settrace(lambda *a: None)
        try:
            out[name] = trio.run(fn)
        finally:
            sys.settrace(None)
            DeviceOp.__await__ = c  # type: ignore[method-assign]
    return out


async def _prepared() -> tuple[Any, Any, Any]:
    x = await api.full((32,), 1.0)
    y = await api.zeros((32,))
    p = y.partition((32,))
    await add(p, x, x)
    return x, y, p


async def _stop_iteration_from_pick() -> tuple[Any, ...]:
    dev = trio_cuda.current_device()
    x, _y, p = await _prepared()
    mp = pytest.MonkeyPatch()
    mp.setitem(vars(dev), "_pick", iter([]).__next__)  # a policy pick over an exhausted iterator
    try:
        try:
            return ("returned", await add(p, x, x))
        except StopIteration:
            return ("caught StopIteration",)
        except RuntimeError as e:
            return ("RuntimeError", str(e))
    finally:
        mp.undo()


@pytest.mark.parametrize("trace", [False, True])
def test_a_stop_iteration_inside_the_await_becomes_runtime_error(trace: bool) -> None:
    """PEP 479 as a generator has it (found by review: it escaped, and under a tracer
    ``await op`` returned None)."""
    r = compiled_and_python(_stop_iteration_from_pick, trace)
    # P: ('RuntimeError', 'generator raised StopIteration') both ways
    # C: plain -> StopIteration escapes `await`; traced -> `await op` RETURNS None
    assert r["C"] == r["P"], r


async def at_the_trap(act: Any) -> Any:
    """``act(aw)`` on an await of a prepared add stopped at its first trap (the word says
    "not yet"), then the device synchronized."""
    dev = trio_cuda.current_device()
    x, _y, p = await _prepared()
    mp = pytest.MonkeyPatch()
    mp.setattr(dev, "reached", lambda ev: False)
    try:
        aw = add(p, x, x).__await__()
        aw.send(None)
        return act(aw)
    finally:
        mp.undo()
        await trio.to_thread.run_sync(dev.synchronize)


@pytest.mark.parametrize("how", ["throw", "send_error"])
def test_a_stop_iteration_thrown_at_the_trap_is_the_same(how: str) -> None:
    def act(aw: Any) -> Any:
        try:
            if how == "throw":
                aw.throw(StopIteration(42))
            else:
                aw.send(outcome.Error(StopIteration(42)))
        except StopIteration as e:
            return ("StopIteration", e.value)
        except RuntimeError as e:
            return ("RuntimeError", str(e))

    r = compiled_and_python(lambda: at_the_trap(act))
    assert r["C"] == r["P"] == ("RuntimeError", "generator raised StopIteration"), r


def test_throw_with_a_non_traceback_third_argument_is_refused_the_same() -> None:
    def act(aw: Any) -> Any:
        try:
            aw.throw(ValueError, None, 5)
        except BaseException as e:
            first = (type(e).__name__, str(e))
        try:
            aw.send(outcome.Value(None))
            then = "still running"
        except StopIteration:
            then = "over"
        except BaseException as e:
            then = type(e).__name__
        return first, then

    r = compiled_and_python(lambda: at_the_trap(act))
    assert r["C"] == r["P"], r
    assert r["C"][0][0] == "TypeError"


def test_a_named_fault_has_the_original_as_context_the_same() -> None:
    async def main() -> Any:
        dev = trio_cuda.current_device()
        x, _y, p = await _prepared()
        mp = pytest.MonkeyPatch()

        def query(h: Any) -> Any:
            raise trio_cuda.DeviceFault("injected", device=dev.ordinal)

        mp.setattr(dev._driver, "query", query)
        mp.setattr(dev, "reached", lambda ev: False)
        try:
            try:
                raise KeyError("outer")
            except KeyError:
                try:
                    await add(p, x, x)
                except trio_cuda.DeviceFault as e:
                    return (e.op, e.__context__ is e.__cause__, type(e.__context__).__name__)
        finally:
            mp.undo()
            await trio.to_thread.run_sync(dev.synchronize)

    r = compiled_and_python(main)
    assert r["C"] == r["P"], r  # P: ('add', True, 'DeviceFault'); C: ('add', False, 'KeyError')


@pytest.mark.parametrize("compiled", [True, False])
async def test_the_submission_stream_is_the_pools_pick(compiled: bool) -> None:
    """The compiled await takes the default pool's last stream itself while it is known
    idle (counted: pool_picks) and calls the policy for every other case: a busy last
    stream, a pool subclass (with or without its own submission_stream), another
    policy. The streams chosen are the Python's in each case."""
    dev = trio_cuda.current_device()
    old = dev.policy
    x, y, z = await api.arange(64), await api.zeros((64,)), await api.zeros((64,))
    c = await api.zeros((1,), np.int32)
    p = z.partition((32,))
    calls: list[str] = []

    class Mine(trio_cuda.StreamPoolRoundRobin):
        def submission_stream(self) -> trio_cuda.Stream:
            calls.append("mine")
            return super().submission_stream()

    class Plain(trio_cuda.StreamPoolRoundRobin):
        pass

    try:
        with mode(compiled):
            pool = trio_cuda.StreamPoolRoundRobin(dev)
            dev.policy = pool
            await add(p, x, y)  # prepared; the pool's first pick
            s1 = pool._last
            assert s1 is not None and s1.seq <= s1.done_seq
            before, seq1 = counters()["pool_picks"], s1.seq
            await add(p, x, y)  # the last stream is idle: the same one
            assert pool._last is s1 and s1.seq == seq1 + 1
            assert counters()["pool_picks"] - before == (1 if compiled else 0)
            h = await lowlevel.submit(sleep(c.partition((1,)), 20_000_000))  # on s1, which stays busy
            assert pool._last is s1 and s1.seq > s1.done_seq
            before = counters()["pool_picks"]
            await add(p, x, y)  # a busy last stream: the pool's next one
            s2 = pool._last
            assert s2 is not s1 and s2 in pool.streams and s2.seq <= s2.done_seq
            assert counters()["pool_picks"] == before
            await h.wait()
            for cls in (Mine, Plain):
                dev.policy = cls(dev)
                before = counters()["pool_picks"]
                await add(p, x, y)
                await add(p, x, y)
                assert counters()["pool_picks"] == before  # the policy's own method each time
                assert dev.policy._last is not None and dev.policy._last.seq <= dev.policy._last.done_seq
            assert calls == ["mine", "mine"]
            dev.policy = trio_cuda.SingleStream(dev)
            before = counters()["pool_picks"]
            await add(p, x, y)
            assert counters()["pool_picks"] == before
    finally:
        dev.policy = old
    np.testing.assert_array_equal(await z.to_host(), np.arange(64))


async def test_awaits_on_one_stream_record_its_done_last_event_again() -> None:
    """On CUDA, an await on a stream whose last event is done and held by nothing else
    records that event again (counter event_reuses) instead of dropping it and taking a
    pooled handle; an event someone holds is never recorded again. (The simulated
    device makes no direct records: it always takes a new event.)"""
    dev = trio_cuda.current_device()
    s = wordless_stream(dev)
    x = await api.full((32,), 1.0)
    p = x.partition((32,))
    await on(add(p, x, x), s)
    first, before = id(s._last_event), counters()["event_reuses"]
    for _ in range(5):
        await on(add(p, x, x), s)
    assert counters()["event_reuses"] - before == (5 if ON_CUDA else 0)
    if ON_CUDA:  # (the same object all along; on the simulated device ids may repeat by chance)
        assert id(s._last_event) == first
    held = s._last_event
    seq = held.seq
    await on(add(p, x, x), s)
    assert s._last_event is not held and held.seq == seq and held.done and s._last_event.seq == seq + 1
    np.testing.assert_array_equal(await x.to_host(), np.full(32, 128.0))  # doubled 7 times


@contextlib.contextmanager
def fake_handled_stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any, int]]:
    """(stream, fake entry points, fake CUDA driver, generation) for tests that make
    Events with a fake handle (0x100) on a stream with a fake handle (0x200), under the
    runtime lock. The stream is made first: on CUDA, making a stream makes the real
    context current on this thread, which would replace the fake driver's token. Its
    generation is one no device ever has, so a fake handle that an Event gives back to
    the device's pool when it dies (maybe after the test) is dropped there, never
    recorded (on CUDA, a record of it would crash); the pool is cleaned after."""
    from cuda.bindings import driver as cu

    dev = trio_cuda.current_device()
    s = wordless_stream(dev)
    fake = FakeDriver()
    d = _cuda_driver(fake, monkeypatch)
    real, real_generation = s.handle, s.generation
    never = -(1 << 40)
    try:
        with LOCK:
            s.handle, s.generation = cu.CUstream(0x200), never
            yield s, fake, d, never
    finally:
        with LOCK:
            s._last_event = None
            s.handle, s.generation = real, real_generation
            gc.collect()
            pool = list(dev._event_pool)
            dev._event_pool.clear()
            dev._event_pool.extend(e for e in pool if e[0] > never)


def test_a_done_unshared_last_event_is_recorded_again_only_then(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled submission's reuse of a stream's last event (test hook
    ``direct_call("event_reuse", driver, stream, seq)`` with fake entry points): made
    for a done event without an error that only the stream holds, record first and
    fields after; not made (None, nothing recorded) for an event held elsewhere or by
    a weak reference, pending, failed, of another generation, device or stream, or with
    a completion word, for a stream with a completion word, where the handle's return to
    the pool is not the compiled one (Event.__del__, the device's _recycle_event or
    _event_handle replaced on the class or the instance, a Device subclass), or the
    driver's record replaced; a reference or weak reference taken during the record
    leaves the event as it was; a refused record raises and leaves it as it was."""
    from cuda.bindings import driver as cu

    dev = trio_cuda.current_device()
    other = dev.create_stream()  # (before the fake driver's token: see fake_handled_stream)

    def fresh(**fields: Any) -> Event:
        ev = Event(s, 5, cu.CUevent(0x100))
        ev.done = True
        for k, v in fields.items():
            setattr(ev, k, v)
        s._last_event = ev
        return ev

    def reuse() -> Any:
        n = len(fake.calls)
        got = _hotpath.direct_call("event_reuse", d, s, 7)
        if got is None:
            assert len(fake.calls) == n, "recorded although not recorded again"
        return got

    with fake_handled_stream(monkeypatch) as (s, fake, d, never):
        ev = fresh()
        i = id(ev)
        del ev
        before = counters()["event_reuses"]
        got = reuse()
        assert got is s._last_event and id(got) == i
        assert (got.seq, got.done, got.error, got.ticket, int(got.stream_handle)) == (7, False, None, 0, 0x200)
        assert fake.calls[-1] == ("record", 0x100, 0x200) and counters()["event_reuses"] == before + 1
        del got
        held = fresh()
        assert reuse() is None and held.seq == 5
        del held
        w = weakref.ref(fresh())
        assert reuse() is None and w() is s._last_event

        class Elsewhere:  # (another device, as far as the event is concerned)
            def _recycle_event(self, generation: int, handle: Any) -> None:
                pass

        for fields in (
            {"done": False},
            {"error": RuntimeError("x")},
            {"generation": never - 1},
            {"flag": 0},
            {"device": Elsewhere()},
            {"_stream": other._wref},
        ):
            fresh(**fields)
            assert reuse() is None, fields
            assert s._last_event.seq == 5
        fresh()
        s._flag = 0
        assert reuse() is None
        s._flag = -1
        orig_recycle, orig_handle = trio_cuda.Device._recycle_event, trio_cuda.Device._event_handle
        for target, name, value in (
            (Event, "__del__", lambda self: None),
            (dev, "_recycle_event", lambda g, h: None),
            (trio_cuda.Device, "_recycle_event", lambda self, g, h: orig_recycle(self, g, h)),
            (dev, "_event_handle", lambda: orig_handle(dev)),
            (trio_cuda.Device, "_event_handle", lambda self: orig_handle(self)),
            (dev, "__class__", type("SubDevice", (trio_cuda.Device,), {})),
            (d, "record", lambda *a: None),
        ):
            with monkeypatch.context() as m:
                m.setattr(target, name, value)
                fresh()
                assert reuse() is None, name
        fresh()
        assert reuse() is not None  # (each case above undone)
        # the device's own methods bound to it in its instance dict (what some pytest
        # versions' monkeypatch leaves when it undoes a method set on the instance):
        # the same methods, so still recorded again
        for name in ("_recycle_event", "_event_handle"):
            with monkeypatch.context() as m:
                m.setattr(dev, name, getattr(dev, name))
                assert name in vars(dev)
                fresh()
                assert reuse() is not None, name
        # a reference or a weak reference taken while the GIL is released around the
        # record (here by the fake record itself): recorded, then left as it was
        real_call = fake._call
        for take in (lambda ev: ev, weakref.ref):
            grabbed: list[Any] = []

            def grab(name: str, args: tuple[Any, ...], take: Any = take, grabbed: list[Any] = grabbed) -> int:
                if name == "record":
                    grabbed.append(take(s._last_event))
                return real_call(name, args)

            fresh()
            n = len(fake.calls)
            fake._call = grab  # type: ignore[method-assign]
            try:
                assert _hotpath.direct_call("event_reuse", d, s, 7) is None
            finally:
                fake._call = real_call  # type: ignore[method-assign]
            assert len(fake.calls) == n + 1 and len(grabbed) == 1
            last = s._last_event
            assert (last.seq, last.done) == (5, True)
            del last, grabbed
        fresh()
        fake.answer["record"] = int(cu.CUresult.CUDA_ERROR_INVALID_HANDLE)
        with pytest.raises(trio_cuda.DeviceError, match="cuEventRecord"):
            reuse()
        fake.answer["record"] = 0
        last = s._last_event
        assert (last.seq, last.done, last.ticket) == (5, True, 0)
        del last


def test_an_event_finalized_and_resurrected_is_not_recorded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Event whose __del__ ran (collected in a cycle) and that a finalizer then made a
    stream's last event again: its handle is in the pool already and its __del__ never
    runs again, so the compiled submission must not record it again (the handle would
    serve two points)."""
    from cuda.bindings import driver as cu

    dev = trio_cuda.current_device()
    with fake_handled_stream(monkeypatch) as (s, fake, d, never):

        class Holder:
            def __del__(self) -> None:
                s._last_event = self.__dict__.pop("ev")

        h = Holder()
        h.me = h  # type: ignore[attr-defined]
        h.ev = Event(s, 5, cu.CUevent(0x100))  # type: ignore[attr-defined]
        h.ev.done = True  # type: ignore[attr-defined]
        s._last_event = None
        del h
        gc.collect()
        assert s._last_event is not None and gc.is_finalized(s._last_event)
        assert any(g == never for g, _ in dev._event_pool)  # its __del__ gave the handle back
        n = len(fake.calls)
        assert _hotpath.direct_call("event_reuse", d, s, 7) is None and len(fake.calls) == n


@pytest.mark.parametrize("compiled", [True, False])
async def test_the_pools_pick_is_called_where_its_method_or_last_is_replaced(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled await takes the pool's idle last stream only for the method as
    defined and a plain ``_last``: a method patched on the class before the pool was made
    (its pick is the patched function) and a ``_last`` property on the class are called."""
    dev = trio_cuda.current_device()
    old = dev.policy
    x, y, z = await api.arange(64), await api.zeros((64,)), await api.zeros((64,))
    p = z.partition((32,))
    calls: list[str] = []
    orig = trio_cuda.StreamPoolRoundRobin.submission_stream

    def spy(self: Any) -> trio_cuda.Stream:
        calls.append("pick")
        return orig(self)

    def get(self: Any) -> Any:
        calls.append("_last")
        return self.__dict__["_last"]

    def put(self: Any, v: Any) -> None:
        self.__dict__["_last"] = v

    try:
        with mode(compiled):
            with monkeypatch.context() as m:
                m.setattr(trio_cuda.StreamPoolRoundRobin, "submission_stream", spy)
                dev.policy = trio_cuda.StreamPoolRoundRobin(dev)
                before = counters()["pool_picks"]
                for _ in range(3):
                    await add(p, x, y)
                assert calls == ["pick"] * 3 and counters()["pool_picks"] == before
            calls.clear()
            dev.policy = trio_cuda.StreamPoolRoundRobin(dev)
            await add(p, x, y)
            monkeypatch.setattr(trio_cuda.StreamPoolRoundRobin, "_last", property(get, put), raising=False)
            before = counters()["pool_picks"]
            await add(p, x, y)
            assert "_last" in calls and counters()["pool_picks"] == before
    finally:
        dev.policy = old
    np.testing.assert_array_equal(await z.to_host(), np.arange(64))
