"""Collectives on the simulated device, as NCCL would compute them (the same reductions,
in the data's dtype, rank by rank).

Within one process (a Group of simulated devices) each rank's command meets the others'
at a rendezvous, and the last to arrive computes every rank's result. Across processes
(a ProcessGroup joined through a launcher, each process with its own simulated device)
each rank's command sends its part to every peer through the launcher's channel (MPI's
messages, or a store's keys: see trio_cuda._rendezvous) and computes its own result from
what the peers sent, every rank in the same rank order, so that every rank's result is
bitwise the same."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import DeviceFault
from .._rendezvous import Channel, exchange, ranks
from ._boundary import CollectiveCall, DeviceDriver

__all__ = ["ProcessComm", "Rendezvous", "SimComms", "reduce_arrays"]


def reduce_arrays(op: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """NCCL's reduction ``op`` of equal-shaped arrays, in their dtype, rank by rank."""
    dtype = arrays[0].dtype
    if op == "avg" and (dtype == np.float16 or dtype.name == "bfloat16"):
        # half types average in float32 (a sum of large halves would overflow first)
        return reduce_arrays(op, [a.astype(np.float32) for a in arrays]).astype(dtype)
    r = arrays[0].copy()
    with np.errstate(all="ignore"):
        for x in arrays[1:]:
            if op in ("sum", "avg"):
                r = r + x
            elif op == "prod":
                r = r * x
            elif op == "max":
                r = np.maximum(r, x)
            else:
                r = np.minimum(r, x)
        if op == "avg":  # NCCL's: the sum divided, integers truncated toward zero
            n = len(arrays)
            if r.dtype.kind in "iu":
                r = np.where(r >= 0, r // n, -((-r) // n)).astype(r.dtype)
            else:
                r = (r / r.dtype.type(n)).astype(r.dtype)
    return r.astype(arrays[0].dtype, copy=False)


class SimComms:
    """The simulated devices of one group (rank i is drivers[i])."""

    def __init__(self, drivers: Sequence[DeviceDriver]) -> None:
        self.drivers = list(drivers)


class Rendezvous:
    """One collective across simulated devices. Each rank's command blocks its stream
    until every rank has arrived; the last to arrive computes every rank's result and
    writes it. A rank whose inputs are poisoned (or whose stream saw a failed wait) makes
    every result poisoned, as on a GPU the data would not be there; a rank whose device
    faults or is reset before it arrives never will, so the others give up and poison
    their results instead of hanging."""

    def __init__(self, kind: str, calls: Sequence[CollectiveCall], dtype: np.dtype[Any], op: str, root: int) -> None:
        self.kind, self.calls, self.dtype, self.op, self.root = kind, list(calls), dtype, op, root
        self.n = len(self.calls)
        self.arrived: dict[int, DeviceFault | None] = {}
        self.finished = False
        self.lost: DeviceFault | None = None
        self.cond = threading.Condition()
        self.generations = [c.driver.generation for c in self.calls]  # type: ignore[attr-defined]

    def _sizes(self) -> tuple[int, int]:
        """(elements sent, elements received) per rank."""
        count, n = self.calls[0].count, self.n
        if self.kind == "all_gather":
            return count, count * n
        if self.kind == "reduce_scatter":
            return count * n, count
        return count, count

    def _gone(self) -> DeviceFault | None:
        """A fault naming a rank whose device faulted or was reset since the collective
        was enqueued (its memory and its part are gone), or None."""
        for c, gen in zip(self.calls, self.generations, strict=True):
            d: Any = c.driver
            if d._fault is not None or d.generation != gen:
                what = "faulted" if d._fault is not None else "was reset"
                return DeviceFault(
                    f"collective {self.kind}: device {d.ordinal} (rank {c.rank}) {what} before the collective completed",
                    op=f"collective {self.kind}",
                )
        return None

    def arrive(self, rank: int, bad: DeviceFault | None) -> None:
        with self.cond:
            self.arrived[rank] = bad
            if len(self.arrived) == self.n:
                try:
                    self._complete()
                finally:  # whatever happens, no rank waits any longer
                    self.finished = True
                    self.cond.notify_all()
                return
            while not self.finished and self.lost is None:
                self.cond.wait(0.005)
                if not self.finished:
                    self.lost = self._gone()
                    if self.lost is not None:
                        self.cond.notify_all()
            if self.lost is not None and not self.finished:
                me: Any = self.calls[rank].driver
                if me.generation == self.generations[rank]:
                    me._poison((self.calls[rank].recv,), DeviceFault(self.lost.message, device=me.ordinal, op=self.lost.op))

    def _complete(self) -> None:
        bad = next((b for b in self.arrived.values() if b is not None), None) or self._gone()
        if bad is None:
            try:
                self._compute()
                return
            except IndexError:
                bad = self._gone()  # a device reset while its memory was being read or written
                if bad is None:
                    raise  # an address that was never valid: a fault, as on a GPU
        for c, gen in zip(self.calls, self.generations, strict=True):
            d: Any = c.driver
            if d.generation == gen:  # a reset device's memory is gone: nothing to mark
                d._poison((c.recv,), DeviceFault(bad.message, device=d.ordinal, op=f"collective {self.kind}"))

    def _compute(self) -> None:
        dt, isz = self.dtype, self.dtype.itemsize
        sent, received = self._sizes()
        inputs = [c.driver._bytes(c.send, sent * isz).view(dt).copy() for c in self.calls]  # type: ignore[attr-defined]
        if self.kind == "all_reduce":
            r = reduce_arrays(self.op, inputs)
            outs = [r] * self.n
        elif self.kind == "broadcast":
            outs = [inputs[self.root]] * self.n
        elif self.kind == "all_gather":
            outs = [np.concatenate(inputs)] * self.n
        else:  # reduce_scatter
            r = reduce_arrays(self.op, inputs)
            outs = [r[i * received : (i + 1) * received] for i in range(self.n)]
        if self._gone() is not None:
            raise IndexError("a device of the collective was reset")  # handled by _complete
        for c, out in zip(self.calls, outs, strict=True):
            d = c.driver
            d._bytes(c.recv, received * isz).view(dt)[...] = out  # type: ignore[attr-defined]
            if d._whole(c.recv, received * isz):  # type: ignore[attr-defined]
                a = d._alloc_at(c.recv)  # type: ignore[attr-defined]
                if a is not None:
                    a.poison = None  # written whole: an earlier failure's mark is gone


_OK, _FAILED = b"\x00", b"\x01"  # a part's first byte: its data follows, or why it has none


class ProcessComm:
    """This process's rank of a collective across processes on the simulated device.

    Every collective gets the next tag when it is enqueued (ranks enqueue their
    collectives in one order, as NCCL requires), so a stream's collectives may run in any
    order relative to another stream's. A peer whose part does not come within the
    channel's timeout (it died, hangs, or its device was reset before its part ran)
    fails this rank's result (marked as not written: the await raises DeviceFault naming
    it) instead of hanging; so does a peer whose part failed (poisoned inputs), which says
    so in its message."""

    def __init__(self, driver: DeviceDriver, channel: Channel, rank: int, nranks: int) -> None:
        self.driver, self.channel, self.rank, self.nranks = driver, channel, rank, nranks
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self._waiting: set[int] = set()  # tags enqueued whose part has not started

    def next_tag(self) -> int:
        with self._lock:
            tag = next(self._tags)
            self._waiting.add(tag)
            return tag

    def abandon(self) -> None:
        """The device was reset (called by the reset): the parts still waiting on its
        streams never run, so tell the peers now, as a failed part, rather than let them
        wait for their timeout."""
        with self._lock:
            tags, self._waiting = sorted(self._waiting), set()
        d: Any = self.driver
        why = _FAILED + f"device {d.ordinal} (rank {self.rank}) was reset before its part ran".encode()
        for tag in tags:
            self.channel.post(tag, [why] * self.nranks)

    def run(
        self, kind: str, call: CollectiveCall, dtype: np.dtype[Any], op: str, root: int, tag: int, bad: DeviceFault | None
    ) -> None:
        """This rank's part of collective ``tag`` (on its stream's thread): send, collect,
        compute, write."""
        with self._lock:
            if tag not in self._waiting:
                return  # abandoned by a reset: the peers were told
            self._waiting.discard(tag)
        d: Any = call.driver
        gen, n, me, isz = d.generation, self.nranks, self.rank, dtype.itemsize
        count = call.count
        sent, received = {"all_gather": (count, count * n), "reduce_scatter": (count * n, count)}.get(kind, (count, count))
        mine = b""
        if bad is None:
            try:
                mine = d._bytes(call.send, sent * isz).tobytes()
            except IndexError:
                if d.generation == gen:
                    raise  # an address that was never valid: a fault, as on a GPU
                bad = DeviceFault(f"device {d.ordinal} (rank {me}) was reset while its part ran")
        if bad is not None:
            payloads = [_FAILED + bad.message.encode()] * n
        elif kind == "reduce_scatter":
            part = received * isz
            payloads = [_OK + mine[p * part : (p + 1) * part] for p in range(n)]
        elif kind == "broadcast" and me != root:
            payloads = [_OK] * n  # (an empty part still says this rank is here)
        else:
            payloads = [_OK + mine] * n
        timeout = self.channel.timeout
        failure = bad.message if bad is not None else None
        try:
            got, missing = exchange(self.channel, tag, payloads, time.monotonic() + timeout, lambda: d.generation != gen)
        except Exception as exc:  # the channel failed (a store whose host is gone, say): this result is lost, not the device
            got, missing = {}, []
            failure = f"collective {kind}: the launcher's channel failed: {type(exc).__name__}: {exc}"
        if d.generation != gen:
            return  # this rank's device was reset: nothing of its memory is left to write
        if missing:
            failure = f"collective {kind}: {ranks(missing)} of {n} did not take part within {timeout:g} s"
        for p in sorted(got):
            if failure is None and got[p][:1] == _FAILED:
                failure = f"collective {kind}: rank {p}'s part failed: {got[p][1:].decode(errors='replace')}"
        if failure is not None:
            fault = DeviceFault(failure, device=d.ordinal, op=f"collective {kind}")
            d._poison((call.recv,), fault)
            # as a failed wait: the stream's later work of this submission is not done,
            # and the submission's record carries the fault to its await
            stream: Any = call.stream
            stream.error = fault
            return
        own = payloads[me][1:] if kind == "reduce_scatter" else mine
        parts = [np.frombuffer(own if p == me else got[p][1:], dtype=dtype) for p in range(n)]
        if kind == "all_reduce":
            out = reduce_arrays(op, parts)
        elif kind == "broadcast":
            out = parts[root]
        elif kind == "all_gather":
            out = np.concatenate(parts)
        else:
            out = reduce_arrays(op, parts)
        try:
            d._bytes(call.recv, received * isz).view(dtype)[...] = out
        except IndexError:
            if d.generation != gen:
                return
            raise
        if d._whole(call.recv, received * isz):
            a = d._alloc_at(call.recv)
            if a is not None:
                a.poison = None  # written whole: an earlier failure's mark is gone
