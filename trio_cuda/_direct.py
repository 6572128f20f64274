"""The direct submission: a lone op of one step on allocated memory, planned and
enqueued at once, with the effects the general path would have."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._guard import _tls
from ._memory import Buffer
from ._plan import Lane, counts

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Event, Stream

__all__ = ["direct_enqueue", "direct_failed", "direct_ready", "direct_tidy", "lane_step", "note_accesses", "order_accesses"]

# -- direct submissions ---------------------------------------------------------------
# A lone op whose enqueue is one step on memory that is allocated and not captured
# (``await kernel(tensors...)``, a replayed ``ops.*`` call) is planned and enqueued in
# one step: the op checks its own arguments, direct_ready() tidies the device as the
# general path would and says whether that path would do anything more than run the
# step (raise, wait, capture), and direct_enqueue() runs it with the same effects. When
# it says no, the op takes the general path, which does (or explains) the rest.


def direct_ready(s: Stream, generation: int) -> bool:
    """Whether a one-step submission made for device generation ``generation`` may
    enqueue on ``s`` now without a plan, after freeing the memory and destroying the
    streams and graphs the device holds for the next submission (under LOCK)."""
    device = s.device
    if (
        generation != device.generation
        or device._resetting
        or device._driver._fault is not None
        or s.generation != generation
        or s.capture is not None
        or s._dropped
    ):
        return False
    if device._dead_buffers or device._dead_streams or device._lingering or device._dead_graphs:
        direct_tidy(device)
    return True


def direct_tidy(device: Device) -> None:
    """What the general path does before its first driver call (under LOCK): free the
    memory, destroy the streams and graphs the device holds for the next submission. A
    failure counts as an abandoned submission, as there."""
    try:
        if device._dead_buffers:
            device.flush_frees()  # before streams are destroyed: a free may name one
        if device._dead_streams or device._lingering or device._dead_graphs:
            device._housekeeping()
    except BaseException:
        counts["planned"] += 1
        counts["abandoned"] += 1
        raise


def direct_failed() -> None:
    """Count a direct submission whose enqueue failed part-way, as the general path does."""
    counts["planned"] += 1
    counts["failed"] += 1


def direct_enqueue(s: Stream, step: Callable[[Stream, Any], None], arg: Any) -> Event | None:
    """Run ``step(s, arg)`` as the general path runs the one step of a plan of one lane
    (under LOCK, after direct_ready): counted as a submission; returns the event to
    wait for (None if the step enqueued nothing)."""
    start = s.seq
    tls = _tls
    tls.submitting = True
    try:
        if s._keep:
            s.retire()
        step(s, arg)
        seq = s.seq
        ev = s.event_at(seq) if seq > start and seq > s.done_seq else None
    except BaseException:
        direct_failed()
        raise
    finally:
        tls.submitting = False
    device = s.device
    device._stats.submissions += 1
    c = counts
    c["planned"] += 1
    c["enqueued"] += 1
    c["direct"] += 1
    return ev


class _NoPlan:
    """What a direct submission's lane has for a plan: no capture."""

    __slots__ = ()
    capture = None


_NO_PLAN: Any = _NoPlan()


def lane_step(s: Stream, arg: tuple[Callable[[Lane, Any], None], Any]) -> None:
    """A plan step ``fn(lane, a)`` (for ``arg = (fn, a)``) run by direct_enqueue on a lane of
    ``s``: for steps that use only the lane's accesses and see that nothing is captured."""
    fn, a = arg
    fn(Lane(_NO_PLAN, s), a)


def order_accesses(s: Stream, writes: Iterable[tuple[Buffer, bool]], reads: Iterable[tuple[Buffer, bool]]) -> None:
    """Order the next work on ``s`` after the pending accesses on other streams of what
    it writes (writer and readers) and reads (writer); (buffer, tracked) pairs. Not
    capturing (Lane.write / Lane.read otherwise). Under LOCK."""
    for b, tracked in writes:
        if tracked:
            w = b.writer
            if w is not None and w[0] is not s:
                s.wait_for(w[0], w[1])
            if b.readers:
                for r, rseq in b.readers.items():
                    if r is not s:
                        s.wait_for(r, rseq)
    for b, tracked in reads:
        if tracked:
            w = b.writer
            if w is not None and w[0] is not s:
                s.wait_for(w[0], w[1])


def note_accesses(s: Stream, seq: int, writes: Iterable[tuple[Buffer, bool]], reads: Iterable[tuple[Buffer, bool]]) -> None:
    """Register point ``seq`` of ``s`` as the writer / a reader of these buffers (an
    untracked one only keeps its memory until then). Under LOCK."""
    for b, tracked in writes:
        if tracked:
            b.writer = (s, seq)
            if b.readers:
                b.readers.clear()
        else:
            b.lifetime[s] = seq
    for b, tracked in reads:
        if tracked:
            b.readers[s] = seq
        else:
            b.lifetime[s] = seq
