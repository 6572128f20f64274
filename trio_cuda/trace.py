"""Traces of what ran where: ``with trio_cuda.trace("run.json"):``.

While the block runs, every submission is recorded: its host span (the trio task or
thread that submitted it, from planning to the end of its enqueue) and each op it
enqueued, with its device, its stream, and the time the device ran it (on CUDA from
timing events recorded around each op only while a trace is open; on the simulated
device the host times at which its stream threads ran it). Cross-stream waits the
runtime inserted are recorded too. When the block ends the trace is written as Chrome /
Perfetto trace JSON (open it at https://ui.perfetto.dev or chrome://tracing): one track
per host task and per device stream, flow arrows from each submission to its device
work and from the work a stream waited for to the work that waited.

``async with trio_cuda.trace(path):`` first waits, in trio, for the device work it
traced (only that: not other work of the same devices), so every op has its device
times; the wait honours cancellation and deadlines. Its entry is a checkpoint and its
exit a schedule point, as every await of the runtime. The plain ``with`` never blocks. Ops
that have not finished when the trace closes (the plain ``with``'s, or a cancelled
exit's) are written marked ``"unfinished": true`` in their args: one that started as a
span from its start to the close, one that had not started as an instant event at the
close, on its stream's track; the file's ``otherData.unfinished`` counts them.
``python -m trio_cuda.trace run.json --png run.png`` draws a timeline picture of a trace
file (needs matplotlib).

Cost: when no trace is open, one check of a module global per submission.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import types
import zlib
from typing import Any

from . import _loop, _trace
from ._guard import LOCK

__all__ = ["Trace", "draw", "main", "trace", "traced"]


class Trace:
    """An open trace (see the module doc); ``events`` holds the trace once it is closed."""

    def __init__(self, path: str | pathlib.Path | None = None) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self.events: dict[str, Any] | None = None  # the trace, once closed
        self._tracer: _trace.Tracer | None = None

    def __enter__(self) -> Trace:
        self._tracer = _trace.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    async def __aenter__(self) -> Trace:
        # A checkpoint, as every await of the runtime: a cancelled task opens no trace.
        await _loop.checkpoint()
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, *exc: object) -> None:
        tracer = self._tracer
        try:
            if tracer is not None and exc_type is None:
                from ._errors import DeviceError
                from ._notifier import wait_event

                # Submissions record under the runtime lock: once stopped under it, no
                # traced enqueue is under way and ``ends`` is complete.
                with LOCK:
                    _trace.stop(tracer)
                    ends = list(tracer.ends.values())
                if not ends:  # nothing to wait for: a schedule point still (as a nursery's exit)
                    await _loop.cancel_shielded_checkpoint()
                # Only the traced work, awaited in trio: other tasks' work on the same
                # devices is not waited for, and a cancel or deadline ends the wait.
                for ev in ends:
                    try:
                        await wait_event(ev)
                    except DeviceError:
                        pass  # a fault or reset: its ops stay unfinished; the next use reports it
        finally:  # written on every exit (a failing or cancelled block included)
            self._close()

    def _close(self) -> None:
        tracer = self._tracer
        if tracer is None:
            return
        with LOCK:  # (as in __aexit__: no traced enqueue is under way after this)
            _trace.stop(tracer)
        self._tracer = None
        self.events = build(tracer)
        if self.path is not None:
            self.path.write_text(json.dumps(self.events))


def trace(path: str | pathlib.Path | None = None) -> Trace:
    """Record a trace while the ``with`` (or ``async with``) block runs; write it to
    ``path`` (Chrome/Perfetto JSON) when it ends."""
    return Trace(path)


async def traced(main: Any, *args: Any) -> Any:
    """``await main(*args)``, traced into FILE when the command line has ``--trace FILE``
    (taken out of ``sys.argv`` first): the examples run as
    ``trio.run(trio_cuda.trace.traced, main)``."""
    argv = sys.argv
    path = None
    for i, a in enumerate(argv):
        if a == "--trace" and i + 1 < len(argv):
            path = argv[i + 1]
            del argv[i : i + 2]
            break
        if a.startswith("--trace="):
            path = a.split("=", 1)[1]
            del argv[i]
            break
    if path is None:
        return await main(*args)
    async with Trace(path):
        result = await main(*args)
    print(f"trace written to {path} (python -m trio_cuda.trace {path} --png PICTURE draws it)", file=sys.stderr)
    return result


def build(tracer: _trace.Tracer) -> dict[str, Any]:
    """The Chrome trace of a closed tracer."""
    t0 = tracer.t0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "host"}}]
    tids: dict[Any, int] = {}  # a track per trio task (or thread)
    named: dict[str, int] = {}
    for sub in tracer.subs:
        key = sub["task_key"] if sub["task"] else ("thread", sub["thread"])
        if key not in tids:
            tids[key] = len(tids) + 1
            who = sub["task"] or f"thread {sub['thread']}"
            named[who] = named.get(who, 0) + 1
            label = who if named[who] == 1 else f"{who} [{named[who]}]"
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tids[key], "args": {"name": label}})
        sub["tid"] = tids[key]
        names = (
            ", ".join(sub["ops"]) or ", ".join(dict.fromkeys(o["name"] for o in tracer.ops if o["sub"] == sub["id"])) or "nothing"
        )
        events.append(
            {
                "ph": "X",
                "cat": "host",
                "name": f"submit {names}",
                "pid": 0,
                "tid": sub["tid"],
                "ts": us(sub["t_begin"]),
                "dur": max(us(sub["t_end"]) - us(sub["t_begin"]), 0.001),
                "args": {"submission": sub["id"], "thread": sub["thread"]},
            }
        )
    subs = {s["id"]: s for s in tracer.subs}
    seen_devices: set[int] = set()
    for dev, num in sorted(tracer.labels):
        if dev not in seen_devices:
            seen_devices.add(dev)
            events.append({"ph": "M", "name": "process_name", "pid": dev + 1, "args": {"name": f"device {dev}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": dev + 1, "tid": num + 1, "args": {"name": f"stream {num}"}})
    # The end first: an op whose end was reached had started, so a start that is reached
    # between the two reads can never leave a finished op without one.
    times = []
    for op in tracer.ops:
        driver, ref = tracer.clocks[op["device"]]
        end = driver.timestamp_seconds(ref, op["after"])
        times.append((driver.timestamp_seconds(ref, op["before"]), end))
    closed = time.perf_counter()  # after every read: no stamp read as reached is later
    unfinished = 0
    placed: list[dict[str, Any]] = []
    flow = 0
    for op, (start, end) in zip(tracer.ops, times, strict=True):
        pid, tid = op["device"] + 1, op["stream"] + 1
        args: dict[str, Any] = {"submission": op["sub"], "device": op["device"], "stream": op["stream"]}
        if end is None:
            unfinished += 1
            args.update(unfinished=True, started=start is not None)
        if start is None:  # still queued when the trace closed: a mark at the close
            events.append(
                {"ph": "i", "s": "t", "cat": "device", "name": op["name"], "pid": pid, "tid": tid, "ts": us(closed), "args": args}
            )
            continue
        # (an op still running is drawn up to the close)
        op["start"], op["end"] = start, max(end if end is not None else closed, start)
        placed.append(op)
        events.append(
            {
                "ph": "X",
                "cat": "device",
                "name": op["name"],
                "pid": pid,
                "tid": tid,
                "ts": us(start),
                "dur": max(us(op["end"]) - us(start), 0.001),
                "args": args,
            }
        )
        owner = subs.get(op["sub"])
        if owner is not None:  # submission -> its device work, from the moment it was
            # enqueued (host and GPU clocks agree to microseconds)
            flow += 1
            events += _flow("submit", "submit", flow, (0, owner["tid"], min(us(op["t_enq"]), us(start))), (pid, tid, us(start)))
    by_stream: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for op in placed:
        by_stream.setdefault((op["device"], op["stream"]), []).append(op)
    for w in tracer.waits:  # the work waited for -> the first work after the wait
        src = next((o for o in by_stream.get(w["other"], ()) if o["seq"] >= w["seq"]), None)
        dst = next((o for o in by_stream.get(w["stream"], ()) if o["seq"] > w["at_seq"]), None)
        if src is None or dst is None:
            continue
        flow += 1
        to = (dst["device"] + 1, dst["stream"] + 1, us(dst["start"]))
        events += _flow("wait", "stream wait", flow, (src["device"] + 1, src["stream"] + 1, min(us(src["end"]), to[2])), to)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "trio_cuda.trace",
            "submissions": len(tracer.subs),
            "ops": len(tracer.ops),
            "unfinished": unfinished,
            "stream_waits": len(tracer.waits),
        },
    }


def _flow(cat: str, name: str, fid: int, src: tuple[int, int, float], dst: tuple[int, int, float]) -> list[dict[str, Any]]:
    """An arrow from (pid, tid, ts) to (pid, tid, ts): Chrome's flow start and end events."""
    return [
        {"ph": "s", "cat": cat, "name": name, "id": fid, "pid": src[0], "tid": src[1], "ts": src[2]},
        {"ph": "f", "bp": "e", "cat": cat, "name": name, "id": fid, "pid": dst[0], "tid": dst[1], "ts": dst[2]},
    ]


def draw(
    trace_json: dict[str, Any],
    png: str | pathlib.Path,
    title: str | None = None,
    window: tuple[float | None, float | None] = (None, None),
) -> int:
    """A timeline picture of a trace: a row per host task and per device stream.

    ``window`` (ms since the trace opened, either end open) keeps the spans that overlap
    it and the rows that have one there. Ops unfinished when the trace closed are drawn
    hatched (running) or as an x (not started). Returns how many spans were drawn.
    """
    lo, hi = window
    if lo is not None and hi is not None and hi <= lo:
        raise ValueError(f"an empty window: from {lo} ms to {hi} ms")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"drawing a trace needs matplotlib (pip install matplotlib): {exc}") from exc
    names: dict[tuple[int, int], str] = {}
    procs: dict[int, str] = {}
    for e in trace_json["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
    for e in trace_json["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            names[(e["pid"], e["tid"])] = f"{procs.get(e['pid'], e['pid'])}: {e['args']['name']}"
    # spans, and the instant marks of ops that had not started when the trace closed
    spans = [
        e
        for e in trace_json["traceEvents"]
        if e.get("ph") in ("X", "i")
        and (lo is None or (e["ts"] + e.get("dur", 0)) / 1e3 >= lo)
        and (hi is None or e["ts"] / 1e3 <= hi)
    ]
    if lo is None and hi is None:
        rows = sorted(names)
    else:  # only the tracks with something in the window
        rows = sorted({(e["pid"], e["tid"]) for e in spans} & set(names))
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    left = lo if lo is not None else min((e["ts"] / 1e3 for e in spans), default=0.0)
    right = hi if hi is not None else max(((e["ts"] + e.get("dur", 0)) / 1e3 for e in spans), default=1.0)
    thin = (right - left) / 500  # narrower than this would not show: drawn as a tick
    cut_short = 0
    for i, key in enumerate(rows):
        for e in spans:
            if (e["pid"], e["tid"]) == key:
                color = f"C{zlib.crc32(e['name'].encode()) % 10}"
                start, dur = e["ts"] / 1e3, e.get("dur", 0) / 1e3
                unfinished = bool(e.get("args", {}).get("unfinished"))
                cut_short += unfinished
                if e["ph"] == "i":  # queued, not started, when the trace closed
                    ax.plot([start], [i], marker="x", markersize=8, color=color)
                elif dur < thin:
                    ax.plot([start], [i], marker="|", markersize=14, color=color)
                else:  # hatched: still running when the trace closed
                    ax.broken_barh([(start, dur)], (i - 0.4, 0.8), facecolors=color, hatch="//" if unfinished else None)
    seen: dict[str, str] = {}
    for e in spans:
        seen.setdefault(e["name"], f"C{zlib.crc32(e['name'].encode()) % 10}")
    from matplotlib.patches import Rectangle

    handles = [Rectangle((0, 0), 1, 1, color=c) for c in list(seen.values())[:12]]
    ax.legend(handles, list(seen)[:12], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    ax.set_yticks(range(len(rows)), [names[k] for k in rows])
    ax.invert_yaxis()
    if lo is not None or hi is not None:
        ax.set_xlim(left=lo, right=hi)
    ax.set_xlabel("ms since the trace opened")
    heading = title or "trio_cuda trace"
    if cut_short:
        heading += f"\n{cut_short} ops unfinished when it closed: hatched (running), x (not started)"
    ax.set_title(heading)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return len(spans)


def main(argv: list[str] | None = None) -> int:
    """``python -m trio_cuda.trace run.json --png run.png``."""
    ap = argparse.ArgumentParser(prog="python -m trio_cuda.trace", description="draw a trio_cuda trace")
    ap.add_argument("trace", type=pathlib.Path, help="a trace written by trio_cuda.trace")
    ap.add_argument("--png", type=pathlib.Path, required=True, help="the picture to write")
    ap.add_argument("--title", default=None)
    ap.add_argument(
        "--from", dest="lo", type=float, default=None, metavar="MS", help="draw from this time (ms since the trace opened)"
    )
    ap.add_argument(
        "--to", dest="hi", type=float, default=None, metavar="MS", help="draw up to this time (ms since the trace opened)"
    )
    args = ap.parse_args(argv)
    data = json.loads(args.trace.read_text())
    try:
        drawn = draw(data, args.png, args.title or args.trace.name, (args.lo, args.hi))
    except ValueError as exc:
        ap.error(str(exc))
    other = data["otherData"]
    left = f", {other['unfinished']} of them unfinished" if other.get("unfinished") else ""
    print(f"wrote {args.png}: {drawn} spans ({other['ops']} ops{left}, {other['submissions']} submissions in the trace)")
    return 0


class _CallableModule(types.ModuleType):
    """``trio_cuda.trace`` is this module and the function: ``trio_cuda.trace(path)``."""

    def __call__(self, path: str | pathlib.Path | None = None) -> Trace:
        return Trace(path)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
