"""What a trace records while ``trio_cuda.trace(...)`` is open (see trio_cuda/trace.py).

``active`` is the open tracer or None; the submission path checks it once per
submission (its whole cost when no trace is open). While a trace is open:

* each submission's host span: from planning to the end of its enqueue (task, thread);
* each step that enqueues device work (a kernel, a copy, a GEMM, a collective, a graph
  launch): its stream and device, and a timestamp on its stream before it (after the
  stream waits it enqueues for its inputs) and after it (on CUDA timing events, on the
  simulated device the host time at which its stream thread reached them), so the trace
  shows when the device ran it;
* each cross-stream wait the runtime enqueued (which stream waits for which point).

Nothing here blocks. Each traced submission also records, on each stream it enqueued
device work on, the event its work there completes at (``ends``, the newest per stream):
``async with`` waits for exactly those at its exit, in trio, so untraced work of other
tasks is never waited for and a cancelled exit stops waiting at once. Ops whose
timestamps have not been reached when the trace closes are written as unfinished.

With ``TRIO_CUDA_NVTX=1`` (and the ``nvtx`` package installed) every op's enqueue is
also an NVTX range named after the op, on the thread that enqueues it, so Nsight Systems
shows the ops' names next to the CUDA calls they make; it is on for the whole process.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from . import _loop

__all__ = ["Tracer", "active"]

active: Tracer | _Nvtx | None = None

# steps that enqueue no device work of their own (joins, bookkeeping)
_SILENT = frozenset({"_join", "_mark_done", "_depend_shared"})
_LABELS = {
    "_h2d_step": "copy host->device",
    "_d2h_step": "copy device->host",
    "_d2d_step": "copy device->device",
    "_fill_step": "fill",
    "_gemm_step": "matmul (cuBLASLt)",
    "_graph_step": "graph launch",
    "_collective_step": "collective",
}


def step_label(fn: Callable[..., Any], arg: Any) -> str:
    name = getattr(fn, "__name__", "step")
    if name in ("_launch_step", "_prepared_step"):
        first = arg[0] if isinstance(arg, tuple) and arg else None  # the Kernel, or its launch config
        kname = getattr(first, "name", None)
        return f"kernel {kname}" if kname else "kernel"
    if name == "_collective_step":
        op = arg[0]
        return str(getattr(op, "name", "collective"))
    if name == "_external_step":
        return str(getattr(arg, "name", "external"))
    return _LABELS.get(name, name.strip("_").removesuffix("_step"))


def work_labels(steps: list[tuple[Callable[..., Any], Any, Any]]) -> tuple[str, ...]:
    """The labels of the steps that enqueue device work (the ops of a plan, named as a
    trace names them, copies and fills included)."""
    return tuple(step_label(fn, arg) for fn, _, arg in steps if getattr(fn, "__name__", "") not in _SILENT)


class _Nvtx:
    """Only NVTX ranges (TRIO_CUDA_NVTX=1 with no trace open)."""

    def __init__(self, nvtx: Any) -> None:
        self.nvtx = nvtx

    def begin(self, plan: Any) -> None:
        pass

    def wait(self, stream: Any, other: Any, seq: int) -> None:
        pass

    def run_steps(self, plan: Any, steps: list[tuple[Callable[[Any, Any], None], Any, Any]]) -> None:
        push, pop = self.nvtx.push_range, self.nvtx.pop_range
        for fn, lane, arg in steps:
            if getattr(fn, "__name__", "") in _SILENT:
                fn(lane, arg)
                continue
            push(step_label(fn, arg), domain="trio_cuda")
            try:
                fn(lane, arg)
            finally:
                pop(domain="trio_cuda")


def _nvtx_from_env() -> _Nvtx | None:
    from ._config import env_flag

    if not env_flag("TRIO_CUDA_NVTX"):
        return None
    try:
        import nvtx
    except ImportError as exc:
        raise ImportError(f"TRIO_CUDA_NVTX=1 needs the nvtx package (pip install nvtx): {exc}") from exc
    return _Nvtx(nvtx)


class Tracer:
    """The records of one open trace (under the runtime's LOCK where the runtime is)."""

    def __init__(self, nvtx: _Nvtx | None = None) -> None:
        self.nvtx = nvtx
        self.t0 = time.perf_counter()
        self.clocks: dict[int, tuple[Any, Any]] = {}  # device ordinal -> (driver, reference)
        # stream -> (device, number): weak (tracing must not keep streams alive), numbered
        # per device as they appear (a new stream never takes a dead one's track)
        self.streams: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
        self.labels: list[tuple[int, int]] = []
        self.subs: list[dict[str, Any]] = []
        self.ops: list[dict[str, Any]] = []
        self.waits: list[dict[str, Any]] = []
        # (device, stream number) -> the event after the newest traced work on that stream:
        # a stream runs in order, so it covers every traced op before it there
        self.ends: dict[tuple[int, int], Any] = {}
        self._ids = itertools.count()
        # The step being enqueued: [stream, driver, its "before" timestamp]. A stream wait
        # the step enqueues moves "before" after it (the op starts once its inputs are ready).
        self._step: list[Any] | None = None

    # -- streams and clocks --------------------------------------------------------------
    def stream_label(self, stream: Any) -> tuple[int, int]:
        got = self.streams.get(stream)
        if got is None:
            dev = stream.device.ordinal
            got = self.streams[stream] = (dev, sum(1 for d, _ in self.labels if d == dev))
            self.labels.append(got)
        return got

    def _clock(self, device: Any) -> tuple[Any, Any]:
        c = self.clocks.get(device.ordinal)
        if c is None:
            driver = device._driver
            c = self.clocks[device.ordinal] = (driver, driver.trace_clock())
        return c

    # -- hooks of the submission path --------------------------------------------------------
    def begin(self, plan: Any) -> None:
        plan._trace = {"t_begin": time.perf_counter()}

    def run_steps(self, plan: Any, steps: list[tuple[Callable[[Any, Any], None], Any, Any]]) -> None:
        """Run the plan's steps (its enqueue), timestamping those that enqueue device work."""
        info = getattr(plan, "_trace", None) or {"t_begin": time.perf_counter()}
        sub = next(self._ids)
        task = task_key = None
        current = _loop.current_task()
        if current is not None:
            # (the task itself: ids are reused; asyncio's tasks are named by get_name())
            task, task_key = getattr(current, "name", None) or current.get_name(), current
        info.update(
            id=sub, task=task, task_key=task_key, thread=threading.current_thread().name, ops=list(getattr(plan, "ops", ()))[:8]
        )
        capturing = getattr(plan, "capture", None) is not None
        used: dict[Any, None] = {}  # the streams this submission enqueued traced work on
        try:
            for fn, lane, arg in steps:
                name = getattr(fn, "__name__", "")
                if name in _SILENT or capturing:  # a capture records no timestamps (they would be graph nodes)
                    fn(lane, arg)
                    continue
                stream = lane.stream
                driver, _ = self._clock(lane.device)
                t_enq = time.perf_counter()
                step = self._step = [stream, driver, driver.timestamp(stream.handle)]
                try:
                    if self.nvtx is not None:
                        self.nvtx.nvtx.push_range(step_label(fn, arg), domain="trio_cuda")
                        try:
                            fn(lane, arg)
                        finally:
                            self.nvtx.nvtx.pop_range(domain="trio_cuda")
                    else:
                        fn(lane, arg)
                finally:
                    self._step = None
                before = step[2]
                after = driver.timestamp(stream.handle)
                dev, num = self.stream_label(stream)
                self.ops.append(
                    {
                        "name": step_label(fn, arg),
                        "device": dev,
                        "stream": num,
                        "sub": sub,
                        "seq": stream.seq,
                        "before": before,
                        "after": after,
                        "t_enq": t_enq,
                    }
                )
                used[stream] = None
            # Each step closed its point (lane.end), so the stream's seq covers its work;
            # the root's event is the one the submission itself records next (reused).
            for stream in used:
                self.ends[self.stream_label(stream)] = stream.event_at(stream.seq)
        finally:  # a submission that fails part-way keeps its span with the ops it enqueued
            info["t_end"] = time.perf_counter()
            self.subs.append(info)

    def wait(self, stream: Any, other: Any, seq: int) -> None:
        step = self._step
        if step is not None and step[0] is stream:
            step[2] = step[1].timestamp(stream.handle)  # the op's start: after this wait
        self.waits.append(
            {
                "stream": self.stream_label(stream),
                "other": self.stream_label(other),
                "seq": seq,
                "at_seq": stream.seq,
            }
        )


_nvtx_only = _nvtx_from_env()
active = _nvtx_only


def start() -> Tracer:
    global active
    if isinstance(active, Tracer):
        raise RuntimeError("a trace is already open (traces do not nest)")
    tracer = active = Tracer(_nvtx_only)
    return tracer


def stop(tracer: Tracer) -> None:
    global active
    if active is tracer:
        active = _nvtx_only
