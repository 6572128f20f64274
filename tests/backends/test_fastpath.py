"""The CUDA backend's compiled fast path (trio_cuda/_backends/_cudafast.c, issue 12).

Without a GPU the C module is driven with ctypes callbacks in place of the driver's
entry points: what each call passes, what it returns, and what it refuses. On CUDA the
backend runs the same work, launch errors and waits with the fast path and with the
pure-Python path (cuda.bindings), in this process and in a child with the fast path
switched off (``_cuda._use_fast_path``, a test hook).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api
from trio_cuda._backends import _cuda
from trio_cuda.kernels import add

from numba import cuda

from ..helpers.fakes import GRAPH_LAUNCH, LAUNCH, QUERY, RECORD, VP, FakeDriver, address, fake_cuda_driver

try:
    from trio_cuda._backends import _cudafast
except ImportError:
    _cudafast = None

if _cudafast is None and os.environ.get("TRIO_CUDA_REQUIRE_FASTPATH") != "1":
    pytestmark = pytest.mark.skip(reason="the C fast path was not built (no C compiler at install)")


@pytest.fixture(autouse=True)
def _built() -> None:
    """With TRIO_CUDA_REQUIRE_FASTPATH=1 (CI where a compiler and Python's headers exist)
    every test here fails, instead of skipping, when the module is missing."""
    if _cudafast is None:
        pytest.fail("TRIO_CUDA_REQUIRE_FASTPATH=1 but trio_cuda._backends._cudafast was not built (see the build_ext output)")


def test_launch_passes_every_argument_and_returns_the_driver_result() -> None:
    seen: list[tuple[Any, ...]] = []

    def fake(*args: Any) -> int:
        seen.append(args)
        return 719 if len(seen) == 2 else 0

    cb = LAUNCH(fake)
    big = 0x7FFF_FFFF_F000_0008  # handles and pointers are 64-bit
    r1 = _cudafast.launch(address(cb), big, 65535, 2, 3, 32, 4, 2, 48 * 1024, big + 16, big + 32)
    r2 = _cudafast.launch(address(cb), 5, 1, 1, 1, 32, 1, 1, 0, 0, 0)
    assert (r1, r2) == (0, 719)
    f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra = seen[0]
    assert (f, stream, params) == (big, big + 16, big + 32)
    assert (gx, gy, gz, bx, by, bz, shmem) == (65535, 2, 3, 32, 4, 2, 48 * 1024)
    assert extra is None  # no "extra" launch options
    assert seen[1][8] is None and seen[1][9] is None  # stream 0 and params 0 are NULL


def test_integer_likes_are_taken_as_integers() -> None:
    seen: list[Any] = []
    qry = QUERY(lambda e: seen.append(e) or 0)
    assert _cudafast.query(np.uint64(address(qry)), np.int64(0x40)) == 0
    assert seen == [0x40]


def test_record_and_query_pass_their_handles() -> None:
    records: list[tuple[Any, ...]] = []
    queries: list[Any] = []
    rec = RECORD(lambda e, s: records.append((e, s)) or 0)
    answers = iter([600, 0, 700])
    qry = QUERY(lambda e: queries.append(e) or next(answers))
    assert _cudafast.record(address(rec), 0xABC0, 0xDEF0) == 0
    assert records == [(0xABC0, 0xDEF0)]
    # NOT_READY, then done, then an illegal address: the result is passed on as is.
    assert [_cudafast.query(address(qry), 0x1230) for _ in range(3)] == [600, 0, 700]
    assert queries == [0x1230] * 3


def test_graph_launch_passes_its_handles_and_returns_the_driver_result() -> None:
    seen: list[tuple[Any, ...]] = []
    answers = iter([0, 400])
    cb = GRAPH_LAUNCH(lambda g, s: seen.append((g, s)) or next(answers))
    big = 0x7FFF_FFFF_F000_0008
    assert _cudafast.graph_launch(address(cb), big, big + 8) == 0
    assert _cudafast.graph_launch(address(cb), np.uint64(0x10), 0) == 400  # passed on as is
    assert seen == [(big, big + 8), (0x10, None)]  # stream 0 is NULL


@pytest.mark.parametrize(
    ("call", "args", "error", "match"),
    [
        ("graph_launch", (1, 2), TypeError, "3 integer arguments"),
        ("graph_launch", (0, 1, 2), ValueError, "no driver entry point"),
        ("graph_launch", (1, -1, 2), OverflowError, None),
        ("launch", (1, 2, 3), TypeError, "11 integer arguments"),
        ("record", (1, 2), TypeError, "3 integer arguments"),
        ("query", (1,), TypeError, "2 integer arguments"),
        ("launch", (1, 1, 2**32, 1, 1, 1, 1, 1, 0, 0, 0), OverflowError, "32 bits"),
        ("launch", (1, 1, 1, 1, 1, 1, 1, 1, 0, -1, 0), OverflowError, None),
        ("record", (1, 2**64, 0), OverflowError, None),
        ("query", (1, "event"), TypeError, None),
        ("query", (0, 5), ValueError, "no driver entry point"),
        ("launch", (0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0), ValueError, "no driver entry point"),
    ],
)
def test_bad_arguments_are_refused_before_any_call(call: str, args: tuple[Any, ...], error: type, match: str | None) -> None:
    called: list[Any] = []
    fakes = {
        "launch": LAUNCH(lambda *a: called.append(a) or 0),
        "record": RECORD(lambda *a: called.append(a) or 0),
        "query": QUERY(lambda *a: called.append(a) or 0),
        "graph_launch": GRAPH_LAUNCH(lambda *a: called.append(a) or 0),
    }
    pfn = args[0] and address(fakes[call])
    with pytest.raises(error, match=match):
        getattr(_cudafast, call)(pfn, *args[1:])
    assert called == []


@pytest.mark.gpu
async def test_the_backend_runs_the_same_work_with_and_without_the_fast_path(dev: trio_cuda.Device) -> None:
    drv = dev._driver
    fast = drv._fast
    assert fast is not None, "the CUDA backend did not take the fast path although the module is built"

    @trio_cuda.kernel(block=(2048,))
    def too_wide_fp(z):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < z.shape[0]:
            z[i] = 1.0

    counts = {"launch": 0, "record": 0, "query": 0}
    real = _cuda._cudafast

    class Counting:  # the module, counting its calls
        def __getattr__(self, name: str) -> Any:
            fn = getattr(real, name)

            def call(*args: Any) -> Any:
                counts[name] += 1
                return fn(*args)

            return call

    results, messages, used = [], [], []
    try:
        for way in (fast, None):
            drv._fast = way
            _cuda._cudafast = Counting()
            before = dict(counts)
            x = await api.arange(1000)
            out = await add(api.zeros((1000,)).partition((256,)), x, x).first()
            for _ in range(50):  # waits that find work pending and done
                out = await add(api.zeros((1000,)).partition((256,)), out, x).first()
            results.append(await out.to_host())
            with pytest.raises(trio_cuda.LaunchError) as info:
                await too_wide_fp(api.zeros((2048,)).partition((2048,)))
            messages.append(str(info.value))
            assert not dev.is_faulted
            used.append({k: counts[k] - before[k] for k in counts})
    finally:
        drv._fast = fast
        _cuda._cudafast = real
    # The fast path made every launch, record and query of its run; the other none.
    assert used[0]["launch"] >= 51 and used[0]["record"] >= 51 and used[0]["query"] >= 1, used
    assert used[1] == {"launch": 0, "record": 0, "query": 0}, used
    expected = np.arange(1000, dtype=np.float32) * 52
    np.testing.assert_array_equal(results[0], expected)
    np.testing.assert_array_equal(results[1], expected)
    assert messages[0] == messages[1] and "too_wide_fp" in messages[0]


@pytest.mark.gpu
def test_without_the_fast_path_the_driver_calls_go_through_cuda_bindings() -> None:
    code = textwrap.dedent(
        """
        import sys
        import numpy as np, trio, trio_cuda
        from trio_cuda._backends import _cuda
        _cuda._use_fast_path = sys.argv[1] == "1"  # before the first device is opened
        from trio_cuda import api
        from trio_cuda.kernels import add
        async def main():
            x = await api.arange(64)
            out = await add(api.zeros((64,)).partition((64,)), x, x).first().to_host()
            np.testing.assert_array_equal(out, 2 * np.arange(64))
        trio.run(main)
        print("fast", trio_cuda.device(0)._driver._fast is not None)
        """
    )
    for value, expect in (("0", "fast False"), ("1", "fast True")):
        r = subprocess.run([sys.executable, "-c", code, value], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert expect in r.stdout


@pytest.mark.parametrize("call", ["launch", "record", "query", "graph_launch"])
def test_a_blocking_driver_call_lets_other_threads_run(call: str) -> None:
    # A launch (or record) blocks while the driver's queue is full; like cuda.bindings
    # (which releases it around every driver call) it must not hold the GIL meanwhile (a Python host function another library queued could
    # be what the queue waits for). The stand-in driver call is libc's usleep, a C
    # function that blocks without touching Python: its first argument is the sleep in us
    # (the remaining arguments are ignored under the C calling convention).
    libc = ctypes.CDLL(None)
    usleep = int(ctypes.cast(libc.usleep, VP).value or 0)
    ticks = 0
    stop = threading.Event()

    running = threading.Event()

    def count() -> None:
        nonlocal ticks
        running.set()
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        running.wait()
        before = ticks
        time.sleep(0.05)  # the other thread's pace with the GIL free: 50 ms worth of counting
        pace = ticks - before
        before = ticks
        if call == "launch":
            _cudafast.launch(usleep, 300_000, 1, 1, 1, 1, 1, 1, 0, 0, 0)
        elif call == "record":
            _cudafast.record(usleep, 300_000, 0)
        elif call == "graph_launch":
            _cudafast.graph_launch(usleep, 300_000, 0)
        else:
            _cudafast.query(usleep, 300_000)
        during = ticks - before
    finally:
        stop.set()
        t.join()
    # Free, the other thread counts about six times its 50 ms pace during the 0.3 s call
    # (less on a loaded host, which slows it more during the longer call); with the GIL
    # held it only runs until the call starts (one 5 ms switch interval: a tenth of it).
    assert during > pace, f"the other thread counted {during} during a 0.3 s driver call, {pace} in 50 ms"


def test_the_backend_announcement_says_when_the_fast_path_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda._backends import _cuda

    assert _cuda._fast_path_note((1, 2, 3)) == ""  # on: nothing to say
    monkeypatch.setattr(_cuda, "_use_fast_path", False)
    assert "fast path off" in _cuda._fast_path_note(None)
    assert _cuda.fast_path() is None  # switched off: no entry points are even asked for
    monkeypatch.setattr(_cuda, "_use_fast_path", True)
    assert "no entry point" in _cuda._fast_path_note(None)
    monkeypatch.setattr(_cuda, "_BUILT", False)
    assert "not built" in _cuda._fast_path_note(None)
    assert _cuda.fast_path() is None  # not built: no entry points are even asked for


def test_the_cuda_backend_glue_passes_handles_and_maps_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend's launch, record and query on the fast path, with the driver's
    entry points replaced by fakes (no GPU needed): what they pass, and how result codes
    become the project's errors, as on the cuda.bindings path."""
    from cuda.bindings import driver as cu

    fake = FakeDriver()
    d = fake_cuda_driver(fake, monkeypatch)
    ev, st = cu.CUevent(0x100), cu.CUstream(0x200)

    d.record(ev, st)
    assert fake.calls[-1] == ("record", 0x100, 0x200)
    assert d.query(ev) is True and fake.calls[-1] == ("query", 0x100)
    fake.answer["query"] = int(cu.CUresult.CUDA_ERROR_NOT_READY)
    assert d.query(ev) is False
    fake.answer["query"] = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(trio_cuda.DeviceOutOfMemory, match="cuEventQuery"):
        d.query(ev)

    class Prepared:
        fn, function, params, name = 0x300, None, 0x400, "k"
        gx, gy, gz, bx, by, bz = 7, 6, 5, 4, 3, 2

    d.launch(Prepared(), st)
    assert fake.calls[-1] == ("launch", 0x300, 7, 6, 5, 4, 3, 2, 0, 0x200, 0x400, None)
    fake.answer["launch"] = int(cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(trio_cuda.LaunchError, match=r"grid=\(7, 6, 5\) block=\(4, 3, 2\)") as info:
        d.launch(Prepared(), st)
    assert info.value.op == "kernel k"
    fake.answer["record"] = 99999  # a code this cuda-bindings does not know: still an error
    with pytest.raises(trio_cuda.LaunchError, match="cuEventRecord"):
        d.record(ev, st)
    assert d._fault is None
    # A sticky fault (illegal address) faults the device; NOT_READY afterwards reports it.
    fake.answer["query"] = int(cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(trio_cuda.DeviceFault):
        d.query(ev)
    assert d._fault is not None
    fake.answer["query"] = int(cu.CUresult.CUDA_ERROR_NOT_READY)
    with pytest.raises(trio_cuda.DeviceFault):
        d.query(ev)
