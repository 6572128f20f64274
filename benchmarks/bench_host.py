"""The host path of one await, against raw cuda.bindings, cuda.core, CuPy and PyTorch.

The benchmark of the issue "Await per kernel at least as fast as PyTorch eager: the host
path". Everything is measured in one run, in one process, on one GPU (device 0); the
targets in the table are the issue's. Figures (medians; trio-cuda's part first, then
the peers of ``_peers.py``, then PyTorch's decode step):

* ``dependent chain awaited once, us/op``: N tiny kernels (one block of 32 threads,
  ``x[i] += 1`` on one 32-element float32 array) that depend on each other, submitted
  and waited for once; wall time per kernel. trio-cuda: the chain ``op =
  inc(op.first())`` built beforehand, then one ``await`` (the build cost is reported
  apart); peers: N launches on one stream, one stream synchronize (``_peers``'
  ``chain_us_per_op``).
* ``sync after every op, us/op``: the same kernel with a wait after every launch
  (trio-cuda: one ``await inc(p)`` per op, the op made each time, on one stream; peers:
  their stream synchronize, ``sync_each_us_per_op``), max(N/4, 100) launches.
* ``one tiny op round trip in trio, us``: one tiny op submitted and waited for;
  trio-cuda: ``await op`` of a prebuilt op inside ``trio.run``; peers: launch, record an
  event, busy-query it (``roundtrip_us``); median over the round trips.

  trio-cuda and the raw cuda.bindings peer (the floor the targets are ratios to) are
  measured in the same ``--tiny-rounds`` interleaved rounds (one chain, one sync loop
  and ``--roundtrips`` round trips each per round, the order reversed every other
  round), in the same process and trio task: a lent machine's host speed drifts by
  tens of percent within one process (run 91: the first 20 s of a process ran this
  Python 1.6x slower than its later figures), and figures measured minutes apart
  compared the drift, not the code. Each figure is the median over the rounds of the
  round's value (a round's round trip: the median of its round trips); the verdict
  line also gives the median and range of the per-round ratios. cuda.core, CuPy and
  PyTorch are measured after trio-cuda's part by ``_peers.run_all`` (the raw peer
  again too); their "x raw" is against that later raw figure.

  In the same rounds, the round trip's floor without trio-cuda's host code: the same
  prepared kernel launched through the backend's compiled calls (``cuLaunchKernel``,
  ``cuEventRecord``, then ``cuEventQuery`` until done, on a stream of its own), alone
  and with one trio schedule point between the record and the first query (the
  checkpoint every await makes). What trio-cuda's round trip costs above "floor + trio
  pass" is its own host code.
* ``decode step, 88 kernels, await per kernel, ms/token``: the decode step of
  ``examples/cuda_graphs_deviceop.py`` (hidden 2048, 22 layers of rms_norm, two GEMVs
  and a residual add: 4 kernels per layer) with one ``await`` per kernel, on one stream
  (``bench_decode.per_kernel_ops``), against PyTorch eager on the same shapes (rms_norm
  as PyTorch ops: 9 kernels per layer) with one ``torch.cuda.synchronize()`` per token
  (``bench_decode.TorchSteps``). In the same ``--rounds`` interleaved rounds of
  ``--tokens`` tokens each (the order reversed every other round, so that a drift of the
  machine's speed, which moves PyTorch's figure by tens of percent between processes,
  falls on both alike): PyTorch with a synchronize after every op (the same program as
  an await per kernel), and the step's floor without trio-cuda's host code
  (``bench_decode.per_kernel_floor``: each kernel captured as a one-node graph, then per
  kernel the compiled ``cuGraphLaunch`` + ``cuEventRecord`` + ``cuEventQuery`` until
  done), alone and with one trio schedule point per kernel (an await's checkpoint).
  Medians over the rounds; the verdict line also gives the median and range of the
  per-round ratios. The other peers have no such figure.
* ``awaits/s, T concurrent tasks, tiny kernels``: T trio tasks in one nursery, each
  doing ``await inc(part)`` k times on its own 32-element tensor, under the device's
  default policy (a pool of streams); total awaits / wall seconds of the nursery, median
  of 3 repetitions after a warm-up round. Every tensor is read back and checked (each
  element must equal the awaits made on it). T = 256 is the issue's figure; 1, 16 and
  64 tasks are extra rows, to show the scaling. trio-cuda only.
* ``idle CPU``: after all the above, with the notifier's helper thread started (an
  await of one ``trio_cuda.kernels.sleep`` of 20 ms, longer than the poll budget, parks
  and starts it; the sleep is lengthened if the await did not park), the process's CPU
  time (``time.process_time``: every thread) over ``--idle-s`` seconds of
  ``trio.sleep`` with nothing pending, in ms of CPU per s of idle; the helper thread's
  own CPU time where Linux gives it (``time.pthread_getcpuclockid``). The target is the
  notifier's: its helper thread ~0 (read here as below 1 ms per s, 0.1 % of a core) and
  no wake-ups while idle; the process figure also counts the CUDA driver's own threads.
  Measured before the peers run, so that no other library's threads are counted.

After the table come the notifier's counters (``lowlevel.notifier_statistics()``, fast
path vs parked waits, helper wake-ups) spent by each of trio-cuda's figures, and the
device's statistics.

Usage: ``python benchmarks/bench_host.py [--n 2000] [--tiny-rounds 7] [--tokens 30]
[--tasks 256] [--out DIR]``; ``--smoke`` runs tiny sizes (for the simulated device,
``TRIO_CUDA_BACKEND=sim``, where the figures mean nothing). Writes ``host-<date>.md``
and ``.json`` under ``--out`` (default benchmarks/results). Exits 1 if a trio-cuda
figure failed or computed a wrong result.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import pathlib
import resource
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import trio_cuda
from benchmarks import _peers, _results, bench_decode, bench_runtime
from trio_cuda import api, lowlevel
from trio_cuda.kernels import sleep

#: Sizes of ``--smoke`` (any of them can still be given explicitly).
SMOKE = {
    "n": 20,
    "reps": 2,
    "hidden": 16,
    "layers": 2,
    "tokens": 2,
    "rounds": 2,
    "tiny_rounds": 2,
    "roundtrips": 10,
    "tasks": 8,
    "tasks_extra": "1,2,4",
    "awaits": 32,
}

#: Columns: (key, heading); "trio" is trio-cuda, the others are _peers' names.
COLUMNS = [
    ("trio", "trio-cuda"),
    ("raw_cuda_bindings", "raw cuda.bindings"),
    ("cuda_core", "cuda.core"),
    ("cupy", "CuPy"),
    ("torch", "PyTorch"),
]

_IDLE_TARGET_MS_PER_S = 1.0
_FORCE_PARK_NS = 20_000_000  # one sleep kernel this long parks an await (budget: 5 ms on CUDA)
_NOTIFIER_THREAD = "trio-cuda-notifier"


def _notifier_counts() -> dict[str, int]:
    return dataclasses.asdict(lowlevel.notifier_statistics())


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("fast_path", "slow_path", "wakeups", "batches")}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


def _progress(msg: str) -> None:
    print(f"[bench_host] {msg}", file=sys.stderr, flush=True)


# -- trio-cuda's figures ----------------------------------------------------------------


async def _tasks_figure(n_tasks: int, k: int, reps: int = 3) -> dict[str, Any]:
    """``n_tasks`` tasks, each awaiting ``inc`` ``k`` times on its own tensor; awaits/s."""
    inc = bench_runtime.inc
    xs = [await api.zeros((32,)) for _ in range(n_tasks)]
    parts = [x.partition((32,)) for x in xs]

    async def worker(p: Any, count: int) -> None:
        for _ in range(count):
            await inc(p)

    async def one_round(count: int) -> float:
        t0 = time.perf_counter_ns()
        async with trio.open_nursery() as nursery:
            for p in parts:
                nursery.start_soon(worker, p, count)
        return (time.perf_counter_ns() - t0) / 1e9

    warm = min(k, 20)
    await one_round(warm)
    policy = trio_cuda.current_device().policy
    by_load = isinstance(policy, trio_cuda.StreamPoolByLoad)
    before = policy.statistics() if by_load else None
    rates = [n_tasks * k / await one_round(k) for _ in range(reps)]
    choices = None
    if before is not None:  # how the default policy chose: what the awaits cost besides their own work
        after = policy.statistics()
        n = n_tasks * k * reps
        choices = {f: (getattr(after, f) - getattr(before, f)) / n for f in ("kept", "idle", "grown", "shared", "asked")}
    expected = warm + reps * k
    wrong = []
    for i, x in enumerate(xs):
        got = await x.to_host()
        if not np.all(got == expected):
            wrong.append(f"tensor {i}: {sorted(set(got.tolist()))[:4]}")
    error = None
    if wrong:
        error = f"{len(wrong)} of {n_tasks} tensors wrong, expected {expected} everywhere ({'; '.join(wrong[:3])})"
    return {
        "tasks": n_tasks,
        "awaits_per_task": k,
        "awaits_per_s": statistics.median(rates),
        "samples": rates,
        "policy_per_await": choices,
        "error": error,
    }


def _thread_cpu_s(thread: threading.Thread | None) -> float | None:
    if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:
        return None


async def _idle_figure(idle_s: float) -> dict[str, Any]:
    """CPU spent by the process over ``idle_s`` of ``trio.sleep``, helper thread started."""
    counter = (await api.zeros((1,), np.int32)).partition((1,))
    ns = _FORCE_PARK_NS
    parked = False
    for _ in range(4):  # a longer sleep if a poll budget set by the environment outlasted it
        before = lowlevel.notifier_statistics().slow_path
        await sleep(counter, ns)
        if lowlevel.notifier_statistics().slow_path > before:
            parked = True
            break
        ns *= 4
    thread = next((t for t in threading.enumerate() if t.name == _NOTIFIER_THREAD), None)
    await trio.sleep(0.05)  # let the wake-up that ended the park settle
    gc.collect()
    s0 = _notifier_counts()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    th0 = _thread_cpu_s(thread)
    c0, w0 = time.process_time(), time.perf_counter()
    await trio.sleep(idle_s)
    c1, w1 = time.process_time(), time.perf_counter()
    th1 = _thread_cpu_s(thread)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    s1 = _notifier_counts()
    wall = w1 - w0
    return {
        "idle_s": wall,
        "cpu_ms_per_s": (c1 - c0) * 1e3 / wall,
        "notifier_thread_cpu_ms_per_s": None if th0 is None or th1 is None else (th1 - th0) * 1e3 / wall,
        "context_switches_per_s": (ru1.ru_nvcsw - ru0.ru_nvcsw + ru1.ru_nivcsw - ru0.ru_nivcsw) / wall,
        "notifier_during_idle": _delta(s0, s1),
        "parked_now": s1["parked"],
        "park_sleep_ms": ns / 1e6,
        "notifier_thread_found": thread is not None,
        "threads": sorted(t.name for t in threading.enumerate()),
        "error": None if parked else f"no await parked (sleeps up to {ns / 1e6:.0f} ms): the helper thread may not be running",
    }


TINY = ("chain_us_per_op", "sync_each_us_per_op", "roundtrip_us")


def _open_raw_peer() -> tuple[Any, str | None]:
    """The raw cuda.bindings peer, opened and warm, or (None, why not)."""
    if trio_cuda.backend_name() != "cuda":
        return None, "not on the CUDA backend"
    peer = _peers._RawBindingsPeer()
    try:
        peer.open()
        peer.chain(200)
        peer.sync()
        peer.sync_each(20)
        peer.roundtrip_ns(20)
    except Exception as exc:  # reported; trio-cuda's figures are still measured
        try:
            peer.close()
        except Exception:
            pass
        return None, _describe(exc)
    return peer, None


def _tiny_floor(kernel: Any) -> Any:
    """The round trip's floor: ``kernel``'s prepared launch (the one trio-cuda's direct
    submissions made; the probe's final check says it wrote the same array) through the
    backend's compiled calls on a stream and event of its own. Returns an async function
    ``floor(k, trio_pass)`` giving each of ``k`` round trips' nanoseconds, or None where
    there is no such path (the simulated device, no compiled calls)."""
    dev = trio_cuda.current_device()
    drv = dev._driver  # type: ignore[attr-defined]
    fast = getattr(drv, "_fast", None)
    if trio_cuda.backend_name() != "cuda" or fast is None:
        return None
    from trio_cuda._backends import _cudafast

    preps = [hit[3] for hit in kernel._fast.values() if hit[0] is dev and hasattr(hit[3], "params")]
    if len(preps) != 1:
        return None
    p = preps[0]
    stream, event = drv.create_stream(), drv.create_event()
    sh, eh = int(stream), int(event)
    launch, record, query = _cudafast.launch, _cudafast.record, _cudafast.query
    checkpoint = trio.lowlevel.cancel_shielded_checkpoint
    now = time.perf_counter_ns

    async def floor(k: int, trio_pass: bool) -> list[int]:
        ns = []
        for _ in range(k):
            t0 = now()
            if launch(fast[0], p.fn, p.gx, p.gy, p.gz, p.bx, p.by, p.bz, 0, sh, p.params) or record(fast[1], eh, sh):
                raise RuntimeError("the round trip's floor: a launch or record failed")
            if trio_pass:
                await checkpoint()
            while (r := query(fast[2], eh)) != 0:
                if r != 600:  # CUDA_ERROR_NOT_READY
                    raise RuntimeError(f"the round trip's floor: cuEventQuery returned {r}")
            ns.append(now() - t0)
        return ns

    floor.keep = (stream, event, p)  # type: ignore[attr-defined]  # (alive with the function)
    return floor


async def _tiny_figures(args: argparse.Namespace) -> dict[str, Any]:
    """The chain, sync-after-every-op and round-trip figures of trio-cuda and the raw
    peer in ``--tiny-rounds`` interleaved rounds (see the module's docstring); both
    results are checked (every element of each array equals its launches)."""
    inc = bench_runtime.inc
    n, m, k = args.n, max(args.n // 4, 100), args.roundtrips
    x = await api.zeros((32,))
    p = x.partition((32,))
    for _ in range(20):  # warm-up: compile and load the kernel, fill the pools
        await inc(p)
    ours_launches = 20
    raw, raw_error = _open_raw_peer()
    raw_launches = 200 + 20 + 20
    floor = _tiny_floor(inc)

    async def ours() -> dict[str, float]:
        nonlocal ours_launches
        build, chain = await bench_runtime.chain_us(p, n)
        t2 = time.perf_counter_ns()
        for _ in range(m):
            await inc(p)
        t3 = time.perf_counter_ns()
        rt = await bench_runtime.roundtrips_ns(p, k)
        ours_launches += n + m + k
        return {
            "chain_build_us_per_op": build,
            "chain_us_per_op": chain,
            "sync_each_us_per_op": (t3 - t2) / m / 1e3,
            "roundtrip_us": statistics.median(rt) / 1e3,
        }

    def raw_round() -> dict[str, float]:
        nonlocal raw_launches
        t0 = time.perf_counter_ns()
        raw.chain(n)
        raw.sync()
        t1 = time.perf_counter_ns()
        raw.sync_each(m)
        t2 = time.perf_counter_ns()
        rt = raw.roundtrip_ns(k)
        raw_launches += n + m + k
        return {
            "chain_us_per_op": (t1 - t0) / n / 1e3,
            "sync_each_us_per_op": (t2 - t1) / m / 1e3,
            "roundtrip_us": statistics.median(rt) / 1e3,
        }

    async def floor_round(trio_pass: bool) -> dict[str, float]:
        nonlocal ours_launches
        ns = await floor(k, trio_pass)
        ours_launches += k
        return {"roundtrip_us": statistics.median(ns) / 1e3}

    rounds: dict[str, list[dict[str, float]]] = {"trio": [], "raw": [], "floor": [], "floor + trio pass": []}
    try:
        for r in range(args.tiny_rounds):
            for who in list(rounds) if r % 2 == 0 else reversed(list(rounds)):
                if who == "trio":
                    rounds["trio"].append(await ours())
                elif who == "raw" and raw is not None:
                    rounds["raw"].append(raw_round())
                elif who.startswith("floor") and floor is not None:
                    rounds[who].append(await floor_round(who != "floor"))
        got = await x.to_host()
        if not np.all(got == ours_launches):
            raise AssertionError(f"trio-cuda's inc computed {got[0]}, expected {ours_launches}")
        if raw is not None:
            values = raw.read_x()
            if any(v != float(raw_launches) for v in values):
                raw_error = f"check: the raw peer's array holds {values[:2]!r}..., expected {raw_launches}"
    finally:
        if raw is not None:
            raw.close()

    def medians(rs: list[dict[str, float]]) -> dict[str, float]:
        return {key: statistics.median(r[key] for r in rs) for key in rs[0]} if rs else {}

    out: dict[str, Any] = {
        "rounds": rounds,
        "trio": medians(rounds["trio"]),
        "raw": medians(rounds["raw"]),
        "floor": medians(rounds["floor"]),
        "floor + trio pass": medians(rounds["floor + trio pass"]),
        "raw_error": raw_error,
    }
    if rounds["raw"] and raw_error is None:
        out["ratio_per_round"] = {
            key: [t[key] / w[key] for t, w in zip(rounds["trio"], rounds["raw"], strict=True)] for key in TINY
        }
    else:
        out["raw"] = {}
    return out


async def _decode_figure(args: argparse.Namespace) -> dict[str, Any]:
    """The decode step awaited kernel by kernel, PyTorch's step (eager, and with a sync
    after every op) and the step's floor without trio-cuda's host code, in ``--rounds``
    interleaved rounds of ``--tokens`` tokens (the order reversed every other round), so
    that a drift of the machine's speed falls on every variant alike."""
    dev = trio_cuda.current_device()
    m = await bench_decode.build(args.hidden, args.layers)
    dev.policy = trio_cuda.SingleStream(dev)  # one stream: bench_decode's "await per kernel"
    makers = bench_decode.per_kernel_ops(m)
    for make in makers:  # warm-up: compile and load every kernel
        await make()

    async def trio_ms(tokens: int) -> float:
        t0 = time.perf_counter()
        for _ in range(tokens):
            for make in makers:
                await make()
        return (time.perf_counter() - t0) / tokens * 1e3

    variants: dict[str, Any] = {"trio": trio_ms}
    torch_error = "not on the CUDA backend"
    if trio_cuda.backend_name() == "cuda":
        steps, torch_error = bench_decode.torch_steps(args.hidden, args.layers)
        if steps is not None:

            async def eager(tokens: int) -> float:
                return steps.ms_per_token(tokens)

            async def synced(tokens: int) -> float:
                return steps.ms_per_token(tokens, sync_each=True)

            variants["torch eager"] = eager
            variants["torch sync each"] = synced
    floor = await bench_decode.per_kernel_floor(makers)
    if floor is not None:

        async def bare(tokens: int) -> float:
            return await floor(tokens, False)

        async def with_pass(tokens: int) -> float:
            return await floor(tokens, True)

        variants["floor"] = bare
        variants["floor + trio pass"] = with_pass
    rounds: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name in list(variants) if r % 2 == 0 else reversed(list(variants)):
            rounds[name].append(await variants[name](args.tokens))
    out: dict[str, Any] = {
        "rounds": rounds,
        "median": {k: statistics.median(v) for k, v in rounds.items()},
        "torch_error": torch_error if "torch eager" not in variants else None,
    }
    if "torch eager" in rounds:
        out["ratio_per_round"] = [t / e for t, e in zip(rounds["trio"], rounds["torch eager"], strict=True)]
    return out


async def _trio_part(args: argparse.Namespace) -> dict[str, Any]:
    dev = trio_cuda.current_device()
    default_policy = dev.policy
    out: dict[str, Any] = {"policy": type(default_policy).__name__, "notifier": {}, "errors": []}

    async def section(name: str, fn: Any, *fargs: Any) -> Any:
        _progress(name)
        s0 = _notifier_counts()
        try:
            res = await fn(*fargs)
        except Exception as exc:  # recorded and reported; the other figures still run
            out["errors"].append(f"{name}: {_describe(exc)}")
            res = None
        finally:
            dev.policy = default_policy  # bench_decode.trio_modes leaves a SingleStream behind
        out["notifier"][name] = _delta(s0, _notifier_counts())
        if isinstance(res, dict) and res.get("error"):
            out["errors"].append(f"{name}: {res['error']}")
        return res

    out["runtime"] = await section("chain, sync each, round trip", _tiny_figures, args)

    out["tasks"] = {}
    for t in [args.tasks, *args.tasks_extra]:
        k = max(1, args.awaits // t)
        out["tasks"][t] = await section(f"awaits/s, {t} task{'s' if t > 1 else ''}", _tasks_figure, t, k)

    out["decode"] = await section("decode step", _decode_figure, args)
    out["idle"] = await section("idle", _idle_figure, args.idle_s)
    out["device_statistics"] = dataclasses.asdict(dev.statistics())
    return out


# -- the table --------------------------------------------------------------------------


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.3g}" if v < 1 else f"{v:.2f}"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "missed")


def build_rows(args: argparse.Namespace, ours: dict[str, Any], peers: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The table's lines and the verdict lines under it."""
    tiny = ours.get("runtime") or {}
    rt, raw = tiny.get("trio") or {}, tiny.get("raw") or {}
    later_raw = peers.get("raw_cuda_bindings", {})
    per_round = tiny.get("ratio_per_round") or {}
    lines = [
        "| figure | " + " | ".join(h for _, h in COLUMNS) + " | target |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    checks = []
    for key, label, limit in (
        ("chain_us_per_op", "dependent chain awaited once, us/op", 1.25),
        ("sync_each_us_per_op", "sync after every op, us/op", 1.3),
        ("roundtrip_us", "one tiny op round trip in trio, us", 1.3),
    ):
        cells = []
        base = raw.get(key)
        for col, _ in COLUMNS:
            if col == "trio":
                v, against = rt.get(key), base
            elif col == "raw_cuda_bindings":
                v, against = base, None
            else:  # measured later, against the raw figure of that later pass
                v, against = peers.get(col, {}).get(key), later_raw.get(key)
            if v is None:
                cells.append("n/a")
            elif against:
                cells.append(f"{_fmt(v)} ({v / against:.2f}x raw)")
            else:
                cells.append(_fmt(v))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | <= {limit}x raw |")
        v = rt.get(key)
        ok = None if v is None or not base else v / base <= limit
        ratio = f"{v / base:.2f}x raw" if v is not None and base else "no raw figure"
        ratios = per_round.get(key) or []
        spread = (
            f"; per round {statistics.median(ratios):.2f}x median, {min(ratios):.2f}x-{max(ratios):.2f}x over {len(ratios)} rounds"
            if ratios
            else ""
        )
        checks.append(f"- {label}: {ratio} (target <= {limit}x){spread}: {_verdict(ok)}")
    for key, what in (
        ("floor", "round trip's floor: the same prepared launch, record, query until done (compiled calls), us"),
        ("floor + trio pass", "the round trip's floor with one trio schedule point, us"),
    ):
        f = (tiny.get(key) or {}).get("roundtrip_us")
        if f is not None:
            cell = _fmt(f) + (f" ({f / raw['roundtrip_us']:.2f}x raw)" if raw.get("roundtrip_us") else "")
            lines.append(f"| {what} |  | {cell} |  |  |  |  |")
    if later_raw.get("roundtrip_us") is not None:
        checks.append(
            "- the raw peer measured again after trio-cuda's part (_peers.run_all, the other peers' base): "
            + ", ".join(f"{k} {later_raw[k]:.2f}" for k in TINY if later_raw.get(k) is not None)
        )

    kernels = 4 * args.layers
    dec = ours.get("decode") or {}
    med = dec.get("median") or {}
    v, torch_eager = med.get("trio"), med.get("torch eager")
    label = f"decode step, {kernels} kernels, await per kernel, ms/token"
    trio_cell = "n/a" if v is None else _fmt(v) + (f" ({v / torch_eager:.2f}x torch)" if torch_eager else "")
    torch_cell = "n/a" if torch_eager is None else _fmt(torch_eager)
    lines.append(f"| {label} | {trio_cell} |  |  |  | {torch_cell} | <= PyTorch eager |")
    ok = None if v is None or torch_eager is None else v <= torch_eager
    ratio = f"{v / torch_eager:.2f}x torch eager" if v is not None and torch_eager else "no torch figure"
    per_round = dec.get("ratio_per_round") or []
    spread = (
        f"; per round {statistics.median(per_round):.2f}x median, {min(per_round):.2f}x-{max(per_round):.2f}x over {len(per_round)} rounds"
        if per_round
        else ""
    )
    checks.append(f"- {label}: {ratio} (target <= 1x){spread}: {_verdict(ok)}")
    synced = med.get("torch sync each")
    if v is not None and synced is not None:
        lines.append(
            f"| decode step, a sync after every op (trio-cuda: the same await per kernel), ms/token | {_fmt(v)} "
            f"({v / synced:.2f}x torch) |  |  |  | {_fmt(synced)} |  |"
        )
    for key, what in (
        ("floor", "decode step's floor: per kernel a one-node graph launch, record, query until done, ms/token"),
        ("floor + trio pass", "the floor with one trio schedule point per kernel, ms/token"),
    ):
        f = med.get(key)
        if f is not None:
            cell = _fmt(f) + (f" ({f / torch_eager:.2f}x torch eager)" if torch_eager else "")
            lines.append(f"| {what} |  | {cell} |  |  |  |  |")

    for i, t in enumerate([args.tasks, *args.tasks_extra]):
        r = (ours.get("tasks") or {}).get(t) or {}
        v = r.get("awaits_per_s") if not r.get("error") else None
        label = f"awaits/s, {t} concurrent tasks, tiny kernels" if t > 1 else "awaits/s, 1 task, tiny kernels"
        target = ">= 60k" if i == 0 else ""
        lines.append(f"| {label} | {'n/a' if v is None else _fmt(v)} |  |  |  |  | {target} |")
        per = r.get("policy_per_await")
        if per:
            checks.append(f"- {label}, the default policy per await: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))
        if i == 0:
            ok = None if v is None else v >= 60_000
            checks.append(f"- {label}: {'n/a' if v is None else _fmt(v)} (target >= 60000): {_verdict(ok)}")
    return lines, checks


def _idle_lines(idle: dict[str, Any] | None) -> list[str]:
    if not idle:
        return ["idle CPU: n/a"]
    th = idle["notifier_thread_cpu_ms_per_s"]
    # The target is the notifier's (the helper thread's CPU and its wake-ups); the
    # process figure also counts the driver's own threads, reported as information.
    ok = th is not None and th < _IDLE_TARGET_MS_PER_S and idle["notifier_during_idle"]["wakeups"] == 0 and not idle["error"]
    return [
        f"idle, notifier thread started: notifier thread {'n/a' if th is None else f'{th:.3f} ms'} CPU per s of idle "
        f"(target ~0, read as < {_IDLE_TARGET_MS_PER_S:g}): {_verdict(ok)}; "
        f"whole process (the CUDA driver's threads included) {idle['cpu_ms_per_s']:.3f} ms/s; "
        f"{idle['context_switches_per_s']:.1f} context switches/s; "
        f"helper wake-ups during idle {idle['notifier_during_idle']['wakeups']}, parked {idle['parked_now']}; "
        f"{idle['idle_s']:.2f} s measured, helper started by a {idle['park_sleep_ms']:.0f} ms sleep kernel"
    ]


def _notifier_lines(ours: dict[str, Any]) -> list[str]:
    lines = [
        "| trio-cuda figure | awaits on the fast path | parked (slow path) | helper wake-ups | wake batches |",
        "|---|---|---|---|---|",
    ]
    for name, d in ours["notifier"].items():
        lines.append(f"| {name} | {d['fast_path']} | {d['slow_path']} | {d['wakeups']} | {d['batches']} |")
    ds = ours.get("device_statistics") or {}
    total = lowlevel.notifier_statistics()
    lines.append("")
    lines.append(
        f"device 0 statistics: launches {ds.get('launches')}, submissions {ds.get('submissions')}, "
        f"stream_waits {ds.get('stream_waits')}, streams {ds.get('streams')}; "
        f"notifier_statistics() now: {dataclasses.asdict(total)}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for the simulated device")
    ap.add_argument("--n", type=int, default=2000, help="tiny kernels in the chain figure")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the peers' later chain and sync figures (_peers.run_all)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--tokens", type=int, default=30, help="tokens per variant per round of the decode figure")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the decode figure")
    ap.add_argument("--tiny-rounds", type=int, default=7, help="interleaved rounds of the chain, sync and round-trip figures")
    ap.add_argument("--roundtrips", type=int, default=300, help="round trips per round of the round-trip figure")
    ap.add_argument("--tasks", type=int, default=256, help="concurrent tasks of the awaits/s figure")
    ap.add_argument("--tasks-extra", default="1,16,64", help="task counts of the extra awaits/s rows")
    ap.add_argument("--awaits", type=int, default=51_200, help="awaits per repetition of an awaits/s row (all tasks)")
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument(
        "--out",
        default=None,
        help="write the report and its figures (<name>-<date>.md/.json) into this folder (default: print only)",
    )
    known, _ = ap.parse_known_args(argv)
    if known.smoke:
        ap.set_defaults(**SMOKE)
    args = ap.parse_args(argv)
    args.tasks_extra = [int(t) for t in str(args.tasks_extra).split(",") if t.strip()]

    t_start = time.perf_counter()
    ours = trio.run(_trio_part, args)
    _progress("peers")
    peers = {r["name"]: r for r in _peers.run_all(n=args.n, reps=args.reps)}

    dev = trio_cuda.current_device()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    tiny = ours.get("runtime") or {}
    rt = tiny.get("trio") or {}
    header = (
        f"# The host path of one await ({stamp})\n\n"
        f"GPU: {dev.name} (cc {dev.compute_capability[0]}.{dev.compute_capability[1]}), backend {trio_cuda.backend_name()}, "
        f"python {sys.version.split()[0]}, trio {trio.__version__}, trio-cuda {trio_cuda.__version__}; medians. "
        f"Chain N={args.n}, sync max(N/4, 100), {args.roundtrips} round trips, in {args.tiny_rounds} rounds interleaved "
        f"with the raw peer; decode hidden {args.hidden}, {args.layers} layers, {args.tokens} tokens, "
        f"one stream; awaits/s: {args.awaits} awaits per repetition over all tasks, 3 repetitions, "
        f"default policy ({ours['policy']}).\n"
    )
    table, checks = build_rows(args, ours, peers)
    torch_error = (ours.get("decode") or {}).get("torch_error")
    notes = []
    if rt.get("chain_build_us_per_op") is not None:
        notes.append(f"- trio-cuda chain build cost (not in the chain figure): {rt['chain_build_us_per_op']:.2f} us/op")
    if tiny.get("raw_error"):
        notes.append(f"- raw peer interleaved with trio-cuda: {tiny['raw_error']}")
    for e in ours["errors"]:
        notes.append(f"- ERROR trio-cuda {e}")
    for name, r in peers.items():
        if r.get("error"):
            notes.append(f"- {name}: {r['error']}")
    if torch_error:
        notes.append(f"- torch decode step: {torch_error}")
    text = "\n".join(
        [
            header,
            *table,
            "",
            *_idle_lines(ours.get("idle")),
            "",
            *checks,
            *notes,
            "",
            "Notifier counters spent by each trio-cuda figure:",
            "",
            *_notifier_lines(ours),
            "",
            f"Whole run: {time.perf_counter() - t_start:.1f} s.",
            "",
        ]
    )
    record = {
        "when": stamp,
        "gpu": dev.name,
        "backend": trio_cuda.backend_name(),
        "args": vars(args),
        "trio": ours,
        "peers": list(peers.values()),
    }
    _results.write(args.out, "host", text, record)
    return 1 if ours["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
