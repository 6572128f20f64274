"""Adversarial tests for three recent changes:

1. GEMMs are told by the runtime whether their stream records a graph
   (``_gemm_step`` -> ``driver.matmul(..., capturing)``), and ``GemmDesc`` caches its hash.
2. ``wait_event``'s common case (one scheduling pass, then a poll) before the budget.
3. Frees never use another library's stream; completion words given back by the
   housekeeping and by ``Device.reset``.

The promises: ``capturing`` is True exactly when the stream records a graph (None on
another library's stream); equal descs hash equal; ``TRIO_CUDA_POLL_BUDGET_US=0`` parks
every wait not complete at its first poll; a wait is cancellable and reports faults; no
free, record or destroy names another library's stream once trio-cuda is done with it;
a reset leaves the device usable and gives every word back exactly once.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import _notifier as notifier_mod
from trio_cuda import api, lowlevel, ops
from trio_cuda._backends._boundary import GemmDesc, GemmOperand
from trio_cuda.kernels import sleep

from .conftest import ON_CUDA, counter, needs_devices
from .test_adversarial import scribble
from .test_ops_cache import f32


# ======================================================================================
# helpers
# ======================================================================================
def spy_matmul(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> list[tuple[bool | None, bool]]:
    """Record (capturing as the runtime says, whether the simulated stream captures)."""
    calls: list[tuple[bool | None, bool]] = []
    drv = dev._driver
    orig = drv.matmul

    def matmul(
        desc: Any,
        a: int,
        b: int,
        d: int,
        bias: int,
        stream: Any,
        capturing: bool | None = None,
        foreign: bool = False,
        reuse: bool = False,
    ) -> None:
        calls.append((capturing, stream.capture is not None))
        orig(desc, a, b, d, bias, stream, capturing, foreign, reuse)

    monkeypatch.setattr(drv, "matmul", matmul)
    return calls


def assert_truthful(calls: list[tuple[bool | None, bool]], n: int) -> None:
    assert len(calls) >= n, calls
    for said, truth in calls:
        assert said is not None, "a stream of trio-cuda's own: the runtime knows whether it captures"
        assert said == truth, f"the backend was told capturing={said} on a stream that captures={truth}"


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ======================================================================================
# 1. GEMMs: capturing, GemmDesc's hash
# ======================================================================================
@pytest.mark.sim_only
async def test_gemms_outside_any_capture_are_told_not_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    calls = spy_matmul(monkeypatch, dev)
    hx, hw, hb = f32(8, 16), f32(12, 16), f32(12)
    x, w, b = await api.from_host(hx), await api.from_host(hw), await api.from_host(hb)
    for _ in range(3):  # the first builds, the others replay the cached recipe
        close(await ops.matmul(x, w.T).to_host(), hx @ hw.T)
        close(await ops.linear(x, w, b, activation="relu").to_host(), np.maximum(hx @ hw.T + hb, 0))
    # forked lanes: zip puts the branches on other streams of the policy
    o1, o2 = await api.zeros((8, 12)), await api.zeros((8, 12))
    await trio_cuda.zip(ops.matmul(x, w.T, out=o1), ops.linear(x, w, b, out=o2))
    close(await o1.to_host(), hx @ hw.T)
    close(await o2.to_host(), hx @ hw.T + hb)
    assert_truthful(calls, 8)
    assert all(said is False for said, _ in calls)


@pytest.mark.sim_only
async def test_gemms_in_graph_captures_forks_and_scopes_are_told_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    hx, hw, hb = f32(8, 16), f32(12, 16), f32(12)
    x, w, b = await api.from_host(hx), await api.from_host(hw), await api.from_host(hb)
    o1, o2, o3 = await api.zeros((8, 12)), await api.zeros((8, 12)), await api.zeros((8, 12))
    # cached outside first: the capture replays the recipe
    await ops.matmul(x, w.T, out=o1)
    await ops.linear(x, w, b, out=o2)
    calls = spy_matmul(monkeypatch, dev)
    g1 = ops.matmul(x, w.T, out=o1).graph()
    g2 = trio_cuda.zip(ops.matmul(x, w.T, out=o1), ops.linear(x, w, b, out=o2), ops.linear(x, w, out=o3)).graph()
    with trio_cuda.capture_graph() as scope:
        scope.record(ops.linear(x, w, b, activation="gelu", out=o3))
        scope.record(trio_cuda.zip(ops.matmul(x, w.T, out=o1), ops.linear(x, w, b, out=o2)))
    assert_truthful(calls, 7)
    assert all(said is True for said, _ in calls)
    # after the captures, the same ops outside are told "not capturing" again
    calls.clear()
    await ops.matmul(x, w.T, out=o1)
    await trio_cuda.zip(ops.linear(x, w, b, out=o2), ops.linear(x, w, out=o3))
    assert_truthful(calls, 3)
    assert all(said is False for said, _ in calls)
    for g in (g1, g2, scope.graph):
        assert g is not None
        await g.launch()
    close(await o1.to_host(), hx @ hw.T)
    close(await o2.to_host(), hx @ hw.T + hb)


@pytest.mark.sim_only
@needs_devices(2)
async def test_gemm_on_another_device_while_a_scope_captures_is_not_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
    hx, hw = f32(8, 16), f32(16, 4)
    x0, w0, o0 = await api.from_host(hx), await api.from_host(hw), await api.zeros((8, 4))
    with trio_cuda.use_device(1):
        x1, w1 = await api.from_host(hx), await api.from_host(hw)
    calls0, calls1 = spy_matmul(monkeypatch, d0), spy_matmul(monkeypatch, d1)
    with trio_cuda.capture_graph() as scope:
        scope.record(ops.matmul(x0, w0, out=o0))
        # the scope is open on device 0: GEMMs on device 1 (also from device 0's
        # context, on a forked lane of device 1) run now and are not captured
        close(await ops.matmul(x1, w1).to_host(), hx @ hw)
        with trio_cuda.use_device(1):
            close(await ops.matmul(x1, w1).to_host(), hx @ hw)
        with pytest.raises(trio_cuda.GraphCaptureError):
            scope.record(ops.matmul(x1, w1))  # one device per graph
    assert_truthful(calls0, 1)
    assert_truthful(calls1, 2)
    assert [s for s, _ in calls1] == [False, False]
    assert scope.graph is not None
    await scope.graph.launch()
    close(await o0.to_host(), hx @ hw)


@pytest.mark.sim_only
async def test_gemm_on_another_librarys_stream_lets_the_backend_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulated device has no external streams: a stream of ours marked foreign
    # stands in for one (the runtime must not claim to know whether it captures).
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    s._foreign = True
    monkeypatch.setattr(dev, "_foreign_streams", True)  # as lowlevel.external_stream sets it
    hx, hw = f32(8, 16), f32(16, 4)
    x, w, o = await api.from_host(hx), await api.from_host(hw), await api.zeros((8, 4))
    calls = spy_matmul(monkeypatch, dev)
    for _ in range(2):
        await (await lowlevel.submit(ops.matmul(x, w, out=o), s)).wait()
    assert [said for said, _ in calls] == [None, None]
    # and once another library's stream exists, ours are asked about too: one of ours
    # that waited for work of a stream that library captures joins its capture
    calls.clear()
    await ops.matmul(x, w, out=o)
    assert [said for said, _ in calls] == [None]
    close(await o.to_host(), hx @ hw)
    s._foreign = False  # destroyed like ours at the end


def _desc(**kw: Any) -> GemmDesc:
    base: dict[str, Any] = {
        "m": 8,
        "n": 4,
        "k": 16,
        "batch": 1,
        "a": GemmOperand(8, 16, 16, False, 0),
        "b": GemmOperand(16, 4, 4, False, 0),
        "dtype": "float32",
    }
    base.update(kw)
    return GemmDesc(**base)


def test_gemm_desc_hash_is_consistent_with_equality_through_replace_and_copies() -> None:
    d = _desc()
    h = hash(d)
    assert hash(d) == h  # cached
    fresh = _desc()
    assert fresh == d and hash(fresh) == h
    # replace: a new desc; its hash follows its fields, not the cached one of the original
    r = dataclasses.replace(d, align=16)
    assert r != d and "_hash" not in r.__dict__
    assert hash(r) == hash(_desc(align=16))
    assert dataclasses.replace(r, align=256) == d and hash(dataclasses.replace(r, align=256)) == h
    # the cached hash is no field: equality, repr, astuple and fields ignore it
    assert "_hash" not in repr(d)
    assert dataclasses.astuple(d) == dataclasses.astuple(fresh)
    assert [f.name for f in dataclasses.fields(d)][-1] == "align"
    for c in (copy.copy(d), copy.deepcopy(d), pickle.loads(pickle.dumps(d))):
        assert c == d and hash(c) == h
    # a dict keyed by descs finds equal ones, whichever was hashed first
    table = {d: 1}
    assert table[_desc()] == 1 and table[pickle.loads(pickle.dumps(fresh))] == 1
    # equal values of other types (bool/int) hash alike, as the dataclass compares them
    assert _desc(has_bias=1) == _desc(has_bias=True) and hash(_desc(has_bias=1)) == hash(_desc(has_bias=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.m = 3  # type: ignore[misc]


def test_gemm_desc_unpickled_in_another_process_hashes_like_an_equal_fresh_one() -> None:
    # A desc's hash covers its dtype and activation names (strings, hashed with the
    # process's seed): a cached hash pickled along with the fields is stale elsewhere.
    code = textwrap.dedent(
        """
        import pickle, sys
        from trio_cuda._backends._boundary import GemmDesc, GemmOperand
        def make():
            return GemmDesc(8, 4, 16, 1, GemmOperand(8, 16, 16, False, 0), GemmOperand(16, 4, 4, False, 0), "float32")
        if sys.argv[1] == "dump":
            d = make()
            hash(d)
            sys.stdout.write(pickle.dumps(d).hex())
        else:
            d = pickle.loads(bytes.fromhex(sys.stdin.read()))
            f = make()
            print(d == f, hash(d) == hash(f), f in {d})
        """
    )

    def run(arg: str, seed: str, stdin: str = "") -> str:
        env = dict(os.environ, PYTHONHASHSEED=seed, TRIO_CUDA_QUIET="1")
        r = subprocess.run([sys.executable, "-c", code, arg], input=stdin, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    out = run("load", "2", run("dump", "1"))
    assert out == "True True True", f"equal descs (==, hash ==, found in a set): {out}"


# ======================================================================================
# 2. wait_event
# ======================================================================================
def _poll_not_done_at_first(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> list[int]:
    """The trio thread's first poll of each event answers 'not done' (the op completes
    just after it); the notifier thread's polls and later ones ask the device."""
    trio_thread = threading.get_ident()
    seen: dict[int, Any] = {}  # the events themselves are kept: an id is not reused meanwhile
    polls: list[int] = []
    orig = dev.poll

    def poll(ev: Any) -> bool:
        if threading.get_ident() == trio_thread:
            polls.append(id(ev))
            if id(ev) not in seen:
                seen[id(ev)] = ev
                return False
        return orig(ev)

    monkeypatch.setitem(vars(dev), "poll", poll)  # (setattr would leave a bound method behind)
    return polls


async def _five_waits_pending_at_first_poll(monkeypatch: pytest.MonkeyPatch, budget_ns: int) -> tuple[int, int, int]:
    """Five awaited adds whose first poll says 'not done', under ``budget_ns``:
    (waits done on the fast path, waits parked, polls made in the trio thread)."""
    dev = trio_cuda.current_device()
    x = await api.zeros((4,))
    await ops.add(x, 1.0, out=x)
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    monkeypatch.setattr(notifier_mod, "_spin_ns", 0)
    polls = _poll_not_done_at_first(monkeypatch, dev)
    before = lowlevel.notifier_statistics()
    for _ in range(5):
        await ops.add(x, 1.0, out=x)
    after = lowlevel.notifier_statistics()
    monkeypatch.undo()
    np.testing.assert_array_equal(await x.to_host(), np.full(4, 6.0, np.float32))
    return after.fast_path - before.fast_path, after.slow_path - before.slow_path, len(polls)


async def test_zero_budget_parks_every_wait_not_complete_at_its_first_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/notifier.md: "TRIO_CUDA_POLL_BUDGET_US=0 parks every wait that is not complete
    # at its first poll".
    n_fast, n_slow, n_polls = await _five_waits_pending_at_first_poll(monkeypatch, 0)
    assert (n_fast, n_slow) == (0, 5), (
        f"budget 0: {n_fast} waits not complete at their first poll stayed on the fast path "
        f"({n_polls} polls in the trio thread for 5 waits)"
    )


async def test_budget_still_covers_waits_not_complete_at_their_first_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    # The other side: a budget keeps such waits on the fast path (no parking).
    n_fast, n_slow, _ = await _five_waits_pending_at_first_poll(monkeypatch, 10_000_000_000)
    assert (n_fast, n_slow) == (5, 0)


@pytest.mark.parametrize("budget_ns", [0, 10_000_000_000])
async def test_move_on_after_zero_around_a_long_op_submits_nothing_and_returns(
    monkeypatch: pytest.MonkeyPatch, budget_ns: int, dev: trio_cuda.Device
) -> None:
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    c = await counter()
    await sleep(c, 1000)  # loaded
    before = lowlevel.notifier_statistics()
    launches = dev.statistics().launches
    with trio.move_on_after(0) as scope:
        await sleep(c, 300_000_000)
    assert scope.cancelled_caught
    after = lowlevel.notifier_statistics()
    assert after.parked == 0 and after.slow_path == before.slow_path
    assert dev.statistics().launches == launches  # cancelled before it was submitted
    monkeypatch.undo()
    np.testing.assert_array_equal(await c.to_host(), [1])


@pytest.mark.parametrize("budget_ns", [0, 10_000_000_000])
async def test_cancelled_at_the_first_pass_then_parked_then_cancelled(monkeypatch: pytest.MonkeyPatch, budget_ns: int) -> None:
    # Cancelled while in the first scheduling pass, and (budget 0) while parked: the
    # wait ends with Cancelled promptly, nothing stays parked, the submitted work runs.
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    c = await counter()
    await sleep(c, 1000)
    cancel_first = trio.CancelScope()

    async def waiter(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with cancel_first:
            sub = await lowlevel.submit(sleep(c, 1_000_000_000))
            task_status.started()
            await sub.wait()  # runs to wait_event's first checkpoint before we resume

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        await n.start(waiter)
        cancel_first.cancel()
    assert cancel_first.cancelled_caught
    with trio.move_on_after(0.05) as scope:
        await sleep(c, 1_000_000_000)
    assert scope.cancelled_caught
    assert trio.current_time() - t0 < 0.6, "a cancelled wait waited for its 1 s of work"
    with trio.fail_after(2):
        while lowlevel.notifier_statistics().parked:
            await trio.sleep(0.005)
    monkeypatch.undo()
    np.testing.assert_array_equal(await c.to_host(), [3])


@pytest.mark.faults_device
@pytest.mark.parametrize("budget_ns", [0, 10_000_000_000])
async def test_a_fault_is_reported_by_the_first_poll_and_by_the_parked_path(
    monkeypatch: pytest.MonkeyPatch, budget_ns: int, dev: trio_cuda.Device
) -> None:
    monkeypatch.setattr(notifier_mod, "_budget_ns", budget_ns)
    t = await api.zeros((32,))
    try:
        with trio.fail_after(10):
            with pytest.raises(trio_cuda.DeviceFault):
                await scribble(t.partition((32,)))
            # known faulted now: a later wait reports it too, it never hangs
            with pytest.raises((trio_cuda.DeviceFault, trio_cuda.DeviceUnavailable)):
                await api.zeros((4,))
    finally:
        monkeypatch.undo()
    if ON_CUDA:
        # The CUDA driver keeps an illegal-address error for the whole process.
        with pytest.raises(trio_cuda.DeviceFault, match="restart the process"):
            await trio.to_thread.run_sync(dev.reset)
        return
    await trio.to_thread.run_sync(dev.reset)
    np.testing.assert_array_equal(await (await api.ones((4,))).to_host(), np.ones(4, np.float32))


@pytest.mark.faults_device
async def test_a_reset_during_the_first_pass_is_reported(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> None:
    # The reset lands between the submission and the first poll (the poll after the
    # first scheduling pass): the wait reports DeviceReset, it neither hangs nor says done.
    c = await counter()
    await sleep(c, 1000)
    orig = dev.poll
    trio_thread = threading.get_ident()
    state = {"reset": False}

    def poll(ev: Any) -> bool:
        if threading.get_ident() == trio_thread and not state["reset"]:
            state["reset"] = True
            threading.Thread(target=dev.reset).start()
            while dev.generation == ev.generation:
                pass
        return orig(ev)

    monkeypatch.setitem(vars(dev), "poll", poll)  # (setattr would leave a bound method behind)
    with trio.fail_after(10):
        with pytest.raises(trio_cuda.DeviceReset):
            await sleep(c, 300_000_000)
    monkeypatch.undo()
    while dev._resetting:
        await trio.sleep(0.001)
    np.testing.assert_array_equal(await (await api.ones((4,))).to_host(), np.ones(4, np.float32))


# ======================================================================================
# 3. frees, foreign streams, words and resets
# ======================================================================================
def _spy_stream_uses(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> list[tuple[str, Any]]:
    """Record (driver call, stream handle) for the calls that name a stream."""
    drv = dev._driver
    uses: list[tuple[str, Any]] = []
    for name, pos in (("free", 1), ("record", 1), ("destroy_stream", 0), ("wait_event", 0), ("alloc", 1)):
        orig = getattr(drv, name)

        def wrapper(*args: Any, _orig: Any = orig, _name: str = name, _pos: int = pos, **kw: Any) -> Any:
            if len(args) > _pos:
                uses.append((_name, args[_pos]))
            return _orig(*args, **kw)

        monkeypatch.setattr(drv, name, wrapper)
    return uses


@pytest.mark.sim_only
async def test_memory_used_only_on_another_librarys_stream_is_freed_on_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    s._foreign = True  # stands in for an external stream (the simulator has none)
    handle = s.handle
    c = await counter()
    await sleep(c, 1000)
    sub = await lowlevel.submit(api.zeros((64,)), s)
    x = await sub.wait()
    await (await lowlevel.submit(sleep(c, 50_000_000).then(lambda _, x=x: ops.add(x, 1.0, out=x)), s)).wait()
    uses = _spy_stream_uses(monkeypatch, dev)
    del x, sub
    gc.collect()
    await api.zeros((1,))  # flushes the free
    frees = [h for name, h in uses if name == "free"]
    assert frees, "the dropped tensor was not freed"
    assert handle not in frees, "memory freed on another library's stream"
    s._foreign = False


@pytest.mark.sim_only
async def test_a_dropped_foreign_stream_with_pending_work_is_never_named_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # After the last reference goes, trio-cuda must not record on, wait on, free on or
    # destroy another library's stream (the library may have destroyed it); its word
    # comes back once its work is done; the memory it used is freed after that work.
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    s._foreign = True
    handle, word = s.handle, s._flag
    c = await counter()
    await sleep(c, 1000)
    x = await (await lowlevel.submit(api.zeros((64,)), s)).wait()
    await lowlevel.submit(sleep(c, 100_000_000).then(lambda _, x=x: ops.add(x, 1.0, out=x)), s)
    uses = _spy_stream_uses(monkeypatch, dev)
    del s
    gc.collect()
    y = await api.zeros((4,))  # housekeeping: the stream lingers (its work is pending)
    if word >= 0:
        assert word not in dev._flag_free
    np.testing.assert_array_equal(await x.to_host(), np.ones(64, np.float32))  # waits for the add
    del x
    for _ in range(3):
        gc.collect()
        await ops.add(y, 1.0, out=y)
    await trio.to_thread.run_sync(dev.synchronize)
    await api.zeros((1,))
    named = [(name, h) for name, h in uses if h is handle]
    assert not named, f"another library's dropped stream was used: {named}"
    if word >= 0:
        holders = dev._flag_free.count(word) + sum(1 for st in list(dev._streams) if st._flag == word)
        assert holders == 1, "the word of the dropped stream was lost or given back twice"


@pytest.mark.faults_device
def test_a_stream_dropped_while_a_reset_gives_words_back_leaves_the_device_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stream.__del__ appends to the device's dead-stream queue from any thread, without
    # the lock (a GC pass in another thread, or in this one while the reset allocates).
    # A reset that iterates that queue must survive an append made meanwhile, and must
    # not leave the device "being reset" forever.
    dev = trio_cuda.device(0)
    gc.collect()
    dev.synchronize()
    free0 = len(dev._flag_free) + sum(1 for s in list(dev._streams) if s._flag >= 0)
    first = dev.create_stream()
    late = [dev.create_stream()]
    del first
    gc.collect()
    assert len(dev._dead_streams) >= 1
    orig = dev._give_flag

    def give(s: Any) -> None:
        orig(s)
        if late:
            late.pop()  # the last reference goes now: Stream.__del__ appends to the queue

    monkeypatch.setattr(dev, "_give_flag", give)
    try:
        dev.reset()
    finally:
        monkeypatch.undo()
        stuck = dev._resetting
        if stuck:  # leave the device usable for the tests that follow
            dev._resetting = False
            dev.reset()
    assert not stuck, "the reset failed half-way and left the device 'being reset'"
    s = dev.create_stream()
    x = api.ones((4,)).schedule(trio_cuda.SingleStream(dev)).sync()
    np.testing.assert_array_equal(api.memcpy(np.zeros(4, np.float32), x).sync(), np.ones(4, np.float32))
    del s, x
    gc.collect()
    dev.synchronize()
    words = list(dev._flag_free) + [st._flag for st in list(dev._streams) if st._flag >= 0]
    words += [flag for _, _, flag, _ in dev._lingering if flag >= 0]  # held until that work is done
    assert len(set(words)) == len(words), "a word given back twice"
    assert len(words) == free0, f"{free0 - len(words)} words leaked"


@pytest.mark.faults_device
async def test_streams_dropped_with_pending_work_during_a_reset_in_another_thread(dev: trio_cuda.Device) -> None:
    # Some dropped and housekept (lingering) before the reset, some dropped while it runs:
    # afterwards every word is back exactly once and nothing of the old work reads done.
    for _ in range(3):
        gc.collect()
        await api.zeros((1,))
    words0 = sorted(list(dev._flag_free) + [s._flag for s in list(dev._streams) if s._flag >= 0])
    c = await counter()
    await sleep(c, 1000)
    early = [dev.create_stream() for _ in range(6)]
    late = [dev.create_stream() for _ in range(6)]
    evs = []
    for s in early + late:
        evs.append((await lowlevel.submit(sleep(c, 200_000_000), s)).event)
    del early, s
    gc.collect()
    await api.zeros((1,))  # the early ones linger now
    assert len(dev._lingering) >= 6
    started = threading.Event()

    def drop_late() -> None:
        started.wait()
        late.clear()
        gc.collect()

    t = threading.Thread(target=drop_late)
    t.start()

    def reset() -> None:
        started.set()
        dev.reset()

    await trio.to_thread.run_sync(reset)
    t.join()
    for ev in evs:
        assert not dev.reached(ev)
        with pytest.raises(trio_cuda.DeviceReset):
            dev.poll(ev)
    del c, evs, ev
    for _ in range(3):
        gc.collect()
        await api.zeros((1,))
    words = sorted(list(dev._flag_free) + [s._flag for s in list(dev._streams) if s._flag >= 0])
    assert len(set(words)) == len(words), "a word given back twice"
    assert words == words0, "words lost or made up by the reset"
