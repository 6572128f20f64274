"""trio_cuda.trace: the trace file's shape (every op, stream tracks, flows), waits
between streams, devices, the picture, and the trace's own life cycle."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import _trace, api, lowlevel, ops
from trio_cuda.kernels import sleep

from ..helpers.devices import counter, needs_devices


def spans(events: dict, cat: str) -> list[dict]:
    return [e for e in events["traceEvents"] if e.get("ph") == "X" and e.get("cat") == cat]


def unfinished(events: dict) -> list[dict]:
    return [e for e in events["traceEvents"] if e.get("args", {}).get("unfinished")]


def check_schema(events: dict) -> None:
    """Every event has the fields Chrome/Perfetto need; every track is named; flows pair up."""
    assert set(events) >= {"traceEvents", "displayTimeUnit", "otherData"}
    named = {(e["pid"], e["tid"]) for e in events["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}
    starts, finishes = {}, {}
    for e in events["traceEvents"]:
        assert e["ph"] in ("M", "X", "i", "s", "f"), e
        if e["ph"] == "X":
            assert {"name", "pid", "tid", "ts", "dur", "cat"} <= set(e) and e["dur"] > 0 and e["ts"] >= 0, e
            assert (e["pid"], e["tid"]) in named, e
        elif e["ph"] == "i":
            assert {"name", "pid", "tid", "ts", "cat"} <= set(e) and e["s"] == "t" and e["ts"] >= 0, e
            assert (e["pid"], e["tid"]) in named, e
        elif e["ph"] == "s":
            starts[e["id"]] = e
        elif e["ph"] == "f":
            finishes[e["id"]] = e
    assert set(starts) == set(finishes), "every flow has a start and an end"
    for i, s in starts.items():
        assert finishes[i]["ts"] >= s["ts"] - 1e-3, (s, finishes[i])


async def test_every_submission_and_op_is_in_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run.json"
    a = np.arange(1000, dtype=np.float32)
    results = {}

    async def task(i: int) -> None:
        x = await api.from_host(a)
        results[i] = await ((x * float(i) + 1.0).sum()).to_host()

    async with trio_cuda.trace(path) as tr:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(task, i, name=f"worker {i}")
    assert _trace.active is None
    events = json.loads(path.read_text())
    assert events == tr.events
    check_schema(events)
    assert events["otherData"]["unfinished"] == 0
    assert events["otherData"]["submissions"] == 6  # an upload and an expression per task
    device_ops = [e["name"] for e in spans(events, "device")]
    for name in ("kernel ops.multiply", "kernel ops.add", "kernel ops.sum", "copy host->device", "copy device->host"):
        assert device_ops.count(name) == 3, (name, device_ops)
    host = spans(events, "host")
    tracks = {
        e["args"]["name"] for e in events["traceEvents"] if e.get("ph") == "M" and e["pid"] == 0 and e["name"] == "thread_name"
    }
    assert tracks == {"worker 0", "worker 1", "worker 2"}
    assert len(host) == 6
    flows = [e for e in events["traceEvents"] if e.get("ph") == "s" and e["cat"] == "submit"]
    assert len(flows) == len(device_ops)  # one arrow from its submission to each op
    for i in range(3):
        assert results[i] == pytest.approx(float((a * i + 1).sum()))


async def test_a_wait_between_streams_is_an_arrow(tmp_path: pathlib.Path) -> None:
    dev = trio_cuda.current_device()
    s1, s2 = dev.create_stream(), dev.create_stream()
    x = await api.zeros((1 << 12,))
    async with trio_cuda.trace(tmp_path / "w.json") as tr:
        first = await lowlevel.submit(ops.add(x, 1.0, out=x), s1)  # a write on stream 1
        second = await lowlevel.submit(ops.multiply(x, 3.0, out=x), s2)  # stream 2 must wait for it
        await first.wait()
        await second.wait()
    events = tr.events
    assert events is not None
    check_schema(events)
    assert events["otherData"]["stream_waits"] >= 1
    waits = [e for e in events["traceEvents"] if e.get("ph") == "s" and e["cat"] == "wait"]
    assert waits, "the stream wait has an arrow"
    ops_by_id = {}
    for e in spans(events, "device"):
        ops_by_id[e["name"]] = e
    add_op, mul_op = ops_by_id["kernel ops.add"], ops_by_id["kernel ops.multiply"]
    assert (add_op["pid"], add_op["tid"]) != (mul_op["pid"], mul_op["tid"])
    assert mul_op["ts"] >= add_op["ts"] + add_op["dur"] - 1e-3  # the device ran them in order
    np.testing.assert_array_equal(await x.to_host(), np.full(1 << 12, 3.0, np.float32))


@needs_devices(2)
async def test_each_device_has_its_own_tracks(tmp_path: pathlib.Path) -> None:
    async with trio_cuda.trace(tmp_path / "d.json") as tr:
        y = await api.dup(api.arange(64, dtype=np.float32) * 2, device=1)
        z = await (y + 1).to_host()
    np.testing.assert_array_equal(z, np.arange(64) * 2 + 1)
    events = tr.events
    assert events is not None
    check_schema(events)
    procs = {e["args"]["name"] for e in events["traceEvents"] if e.get("ph") == "M" and e["name"] == "process_name"}
    assert {"host", "device 0", "device 1"} <= procs
    on_1 = [e["name"] for e in spans(events, "device") if e["pid"] == 2]
    assert "kernel ops.add" in on_1


async def test_the_plain_with_never_blocks_and_traces_do_not_nest(tmp_path: pathlib.Path) -> None:
    with trio_cuda.trace(tmp_path / "p.json") as tr:
        with pytest.raises(RuntimeError, match="nest"):
            trio_cuda.trace().__enter__()
        await (await api.ones((8,)) * 2)
    events = tr.events
    assert events is not None
    check_schema(events)
    # every op is there once: a span, or (queued when the trace closed) an instant mark
    marks = [e for e in events["traceEvents"] if e.get("ph") == "i" and e["cat"] == "device"]
    assert events["otherData"]["ops"] == len(spans(events, "device")) + len(marks)
    assert events["otherData"]["unfinished"] == len(unfinished(events))
    assert _trace.active is None
    with pytest.raises(ValueError):
        with trio_cuda.trace():
            raise ValueError("the block fails")
    assert _trace.active is None  # closed anyway


def test_the_picture_is_drawn(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run.json"

    async def main() -> None:
        async with trio_cuda.trace(path):
            await (await api.arange(32, dtype=np.float32) + 1).to_host()

    trio.run(main)
    png = tmp_path / "run.png"
    r = subprocess.run(
        [sys.executable, "-m", "trio_cuda.trace", str(path), "--png", str(png)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "RuntimeWarning" not in r.stderr


async def test_statistics_count_bytes_queues_and_notifier_paths() -> None:
    import gc

    dev = trio_cuda.current_device()
    before = dev.statistics()
    waits = trio_cuda.lowlevel.notifier_statistics()
    x = await api.zeros((1000,), np.float64)  # 8000 bytes
    mid = dev.statistics()
    now = trio_cuda.lowlevel.notifier_statistics()
    assert mid.bytes_allocated - before.bytes_allocated == 8000
    assert now.fast_path + now.slow_path > waits.fast_path + waits.slow_path
    assert len(mid.queue_depths) == mid.streams and all(d >= 0 for d in mid.queue_depths)
    del x
    gc.collect()
    await api.zeros((1,))  # a submission flushes the deferred free
    after = dev.statistics()
    assert after.bytes_freed - mid.bytes_freed >= 8000
    assert after.bytes_in_use <= mid.bytes_in_use - 8000 + 8


def test_nvtx_ranges_name_every_op(tmp_path: pathlib.Path) -> None:
    """TRIO_CUDA_NVTX=1: each op's enqueue is an NVTX range named after it (a stand-in
    nvtx module records the calls; the real one talks to Nsight Systems)."""
    (tmp_path / "nvtx.py").write_text(
        "calls = []\n"
        "def push_range(message, domain=None):\n    calls.append(('push', message, domain))\n"
        "def pop_range(domain=None):\n    calls.append(('pop', None, domain))\n"
    )
    program = (
        "import numpy as np, trio, nvtx, trio_cuda\n"
        "from trio_cuda import api\n"
        "async def main():\n"
        "    x = await api.from_host(np.arange(4, dtype=np.float32))\n"
        "    assert (await (x * 2).to_host() == np.arange(4) * 2).all()\n"
        "trio.run(main)\n"
        "names = [m for kind, m, d in nvtx.calls if kind == 'push']\n"
        "assert all(d == 'trio_cuda' for _, _, d in nvtx.calls)\n"
        "assert sum(1 for k, _, _ in nvtx.calls if k == 'push') == sum(1 for k, _, _ in nvtx.calls if k == 'pop')\n"
        "assert names == ['copy host->device', 'kernel ops.multiply', 'copy device->host'], names\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRIO_CUDA_NVTX="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


def test_nvtx_ranges_with_the_real_nvtx_package() -> None:
    """The same through the nvtx package itself (its C calls are no-ops without a
    profiler attached): the runtime's calls match its API, every range is closed."""
    pytest.importorskip("nvtx")
    program = (
        "import nvtx\n"
        "calls = []\n"
        "real_push, real_pop = nvtx.push_range, nvtx.pop_range\n"
        "def push_range(message=None, color=None, domain=None, **kw):\n"
        "    calls.append(('push', message, domain))\n"
        "    return real_push(message, color=color, domain=domain, **kw)\n"
        "def pop_range(domain=None):\n"
        "    calls.append(('pop', None, domain))\n"
        "    return real_pop(domain=domain)\n"
        "nvtx.push_range, nvtx.pop_range = push_range, pop_range\n"
        "import numpy as np, trio, trio_cuda\n"
        "from trio_cuda import api\n"
        "async def main():\n"
        "    x = await api.from_host(np.arange(4, dtype=np.float32))\n"
        "    assert (await (x * 2).to_host() == np.arange(4) * 2).all()\n"
        "trio.run(main)\n"
        "names = [m for kind, m, d in calls if kind == 'push']\n"
        "assert all(d == 'trio_cuda' for _, _, d in calls)\n"
        "assert [k for k, _, _ in calls] == ['push', 'pop'] * 3, calls\n"
        "assert names == ['copy host->device', 'kernel ops.multiply', 'copy device->host'], names\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRIO_CUDA_NVTX="1")
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


async def test_a_graph_capture_inside_a_trace_records_no_timestamps_but_its_launch_is_traced(tmp_path: pathlib.Path) -> None:
    x = await api.zeros((64,))
    async with trio_cuda.trace(tmp_path / "g.json") as tr:
        graph = ops.add(x, 1.0, out=x).graph()  # captured: nothing runs, no timestamp nodes
        await graph.launch()
        await graph.launch()
    np.testing.assert_array_equal(await x.to_host(), np.full(64, 2.0, np.float32))
    events = tr.events
    assert events is not None
    check_schema(events)
    names = [e["name"] for e in spans(events, "device")]
    assert names.count("graph launch") == 2 and "kernel ops.add" not in names


# -- found by an adversarial review -------------------------------------------------------------
async def test_the_trace_is_written_when_the_block_is_cancelled_or_fails(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.json"
    with trio.move_on_after(0.2):
        async with trio_cuda.trace(path) as tr:
            await (await api.ones((8,)) + 1)
            await trio.sleep_forever()
    assert path.exists() and tr.events is not None and _trace.active is None
    with pytest.raises(ValueError, match="own"):
        async with trio_cuda.trace(tmp_path / "f.json") as tr2:
            await (await api.ones((8,)) * 2)
            raise ValueError("the body's own error")
    assert tr2.events is not None and (tmp_path / "f.json").exists()


async def test_each_task_has_its_own_track_even_when_ids_are_reused(tmp_path: pathlib.Path) -> None:
    async with trio_cuda.trace() as tr:
        for k in range(12):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_one_submission, name=f"task {k}")
    events = tr.events
    assert events is not None
    host_tracks = [e for e in events["traceEvents"] if e.get("ph") == "M" and e["pid"] == 0 and e["name"] == "thread_name"]
    assert sorted(e["args"]["name"] for e in host_tracks) == sorted(f"task {k}" for k in range(12))


async def _one_submission() -> None:
    await api.zeros((4,))


async def test_a_submission_failing_part_way_keeps_its_span(tmp_path: pathlib.Path) -> None:
    def broken(stream: object) -> None:
        raise RuntimeError("refused")

    x = await api.zeros((4,))
    async with trio_cuda.trace() as tr:
        with pytest.raises(trio_cuda.ExternalCallError, match="refused"):
            await trio_cuda.zip(ops.add(x, 1.0, out=x), trio_cuda.external(broken, writes=[x]))
    events = tr.events
    assert events is not None
    subs = {e["args"]["submission"] for e in spans(events, "host")}
    assert all(e["args"]["submission"] in subs for e in spans(events, "device"))


async def test_a_stream_made_after_another_died_gets_its_own_track() -> None:
    import gc

    dev = trio_cuda.current_device()
    x = await api.zeros((8,))
    async with trio_cuda.trace() as tr:
        for _ in range(6):
            s = dev.create_stream()  # each one dropped before the next: addresses get reused
            await (await lowlevel.submit(ops.add(x, 1.0, out=x), s)).wait()
            del s
            gc.collect()
            await api.zeros((1,))  # housekeeping destroys the dropped stream
    events = tr.events
    assert events is not None
    check_schema(events)
    adds = [(e["pid"], e["tid"]) for e in spans(events, "device") if e["name"] == "kernel ops.add"]
    assert len(adds) == 6 and len(set(adds)) == 6  # one track per stream
    np.testing.assert_array_equal(await x.to_host(), np.full(8, 6.0, np.float32))


# -- the exit of a trace under cancellation -------------------------------------------------------
LONG_NS = 4_000_000_000  # far longer than the deadlines below, so their bounds are loose
DEADLINE_S = 0.3


async def _busy(stream: trio_cuda.Stream, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Another task's long work, enqueued on ``stream`` before it reports started."""
    c = await counter()
    sub = await lowlevel.submit(sleep(c, LONG_NS), stream)
    task_status.started()
    await sub.wait()


async def test_the_exit_waits_only_for_traced_work_and_honours_its_deadline(tmp_path: pathlib.Path) -> None:
    dev = trio_cuda.current_device()
    busy, free = dev.create_stream(), dev.create_stream()
    await sleep(counter(), 1000)  # the first launch of a kernel may compile it
    x = await api.zeros((64,))
    async with trio.open_nursery() as nursery:
        await nursery.start(_busy, busy)  # enqueued before any trace opens: never traced

        # Traced work on a free stream: the exit waits for it, not for the busy stream.
        start = trio.current_time()
        with trio.move_on_after(DEADLINE_S) as scope:
            async with trio_cuda.trace(tmp_path / "free.json"):
                await lowlevel.submit(ops.add(x, 1.0, out=x), free)
        elapsed = trio.current_time() - start
        assert not scope.cancelled_caught and elapsed < LONG_NS / 1e9 / 2, elapsed
        events = json.loads((tmp_path / "free.json").read_text())
        check_schema(events)
        assert [e["name"] for e in spans(events, "device")] == ["kernel ops.add"]
        assert events["otherData"]["unfinished"] == 0 and not unfinished(events)

        # Traced work queued behind the busy stream's: the deadline ends the exit's wait,
        # the file is still written, with the op that had not run marked unfinished.
        start = trio.current_time()
        with trio.move_on_after(DEADLINE_S) as scope:
            async with trio_cuda.trace(tmp_path / "queued.json"):
                await lowlevel.submit(ops.add(x, 1.0, out=x), busy)
        elapsed = trio.current_time() - start
        assert scope.cancelled_caught and elapsed < LONG_NS / 1e9 / 2, elapsed
        assert _trace.active is None
        events = json.loads((tmp_path / "queued.json").read_text())
        check_schema(events)
        assert events["otherData"]["unfinished"] == 1
        [op] = unfinished(events)
        assert op["name"] == "kernel ops.add" and op["cat"] == "device" and op["args"]["started"] is False
    np.testing.assert_array_equal(await x.to_host(), np.full(64, 2.0, np.float32))


async def test_a_cancelled_exit_writes_the_traced_work_that_had_not_finished_as_unfinished(tmp_path: pathlib.Path) -> None:
    dev = trio_cuda.current_device()
    stream = dev.create_stream()
    await sleep(counter(), 1000)  # the first launch of a kernel may compile it
    c = await counter()
    path = tmp_path / "long.json"
    start = trio.current_time()
    with trio.move_on_after(DEADLINE_S) as scope:
        async with trio_cuda.trace(path):
            await lowlevel.submit(sleep(c, LONG_NS), stream)
    elapsed = trio.current_time() - start
    assert scope.cancelled_caught and elapsed < LONG_NS / 1e9 / 2, elapsed
    events = json.loads(path.read_text())
    check_schema(events)
    assert events["otherData"]["unfinished"] == 1
    [op] = unfinished(events)
    # It ran from its start to the moment the trace closed, and still runs.
    assert op["name"] == "kernel sleep" and op["ph"] == "X" and op["args"]["started"] is True
    assert DEADLINE_S * 1e6 * 0.5 < op["ts"] + op["dur"] < LONG_NS / 1e3
    png = tmp_path / "long.png"
    assert trio_cuda.trace.main([str(path), "--png", str(png)]) == 0  # the picture copes with it
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(await c.to_host(), [1])  # the work itself went on


async def test_the_plain_with_writes_the_work_it_did_not_wait_for_as_unfinished(tmp_path: pathlib.Path) -> None:
    stream = trio_cuda.current_device().create_stream()
    await sleep(counter(), 1000)  # the first launch of a kernel may compile it
    c = await counter()
    x = await api.zeros((8,))
    with trio_cuda.trace(tmp_path / "plain.json") as tr:
        await lowlevel.submit(sleep(c, LONG_NS // 4), stream)
        await lowlevel.submit(ops.add(x, 1.0, out=x), stream)  # queued behind the sleep
    events = tr.events
    assert events is not None
    check_schema(events)
    assert events["otherData"]["unfinished"] == 2
    assert [(e["name"], e["args"]["started"]) for e in unfinished(events)][-1] == ("kernel ops.add", False)
    np.testing.assert_array_equal(await x.to_host(), np.ones(8, np.float32))


def test_ctrl_c_during_the_exit_writes_the_trace_and_interrupts_promptly(tmp_path: pathlib.Path) -> None:
    """SIGINT, as a terminal's Ctrl+C sends it, while the exit waits for long traced work."""
    path = tmp_path / "ki.json"
    program = (
        "import json, os, signal, sys, time\n"
        "import numpy as np, trio, trio.testing, trio_cuda\n"
        "from trio_cuda import api, lowlevel\n"
        "from trio_cuda.kernels import sleep\n"
        "async def main():\n"
        "    stream = trio_cuda.current_device().create_stream()\n"
        "    c = await api.zeros((1,), np.int32).partition((1,))\n"
        "    async def interrupt():\n"
        "        await trio.testing.wait_all_tasks_blocked(0.05)  # the trace's exit is waiting\n"
        "        await trio.to_thread.run_sync(os.kill, os.getpid(), signal.SIGINT)\n"
        "    async with trio.open_nursery() as nursery:\n"
        "        nursery.start_soon(interrupt)\n"
        "        async with trio_cuda.trace(sys.argv[1]):\n"
        f"            await lowlevel.submit(sleep(c, {LONG_NS}), stream)\n"
        "start = time.perf_counter()\n"
        "try:\n"
        "    trio.run(main)\n"
        "except BaseException as exc:\n"
        "    caught = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]\n"
        "    assert [type(e) for e in caught] == [KeyboardInterrupt], repr(exc)\n"
        "else:\n"
        "    raise AssertionError('not interrupted')\n"
        f"print('interrupted after', time.perf_counter() - start, 'of', {LONG_NS / 1e9})\n"
        f"assert time.perf_counter() - start < {LONG_NS / 1e9 / 2}\n"
    )
    r = subprocess.run([sys.executable, "-c", program, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "interrupted" in r.stdout, r.stdout + r.stderr[-3000:]
    events = json.loads(path.read_text())
    check_schema(events)
    [op] = unfinished(events)
    assert op["name"] == "kernel sleep" and events["otherData"]["unfinished"] == 1
