"""Reclaiming what nothing references any more, for one device: buffers' memory (freed
after every pending access to it, on any stream of any device), another library's memory
(let go the same way), and streams and graphs (destroyed once their work is done).

Finalizers never lock: they queue on the device (``Device._dead_buffers``,
``_dead_streams``, ``_dead_graphs``); the functions here drain those queues under the
runtime lock (:data:`trio_cuda._guard.LOCK`), before a submission's first driver call
and at :meth:`Device.synchronize`. Nothing of a reset device's old generation is
touched: its memory, streams and graphs went with the driver's reset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import DeviceError

if TYPE_CHECKING:
    from ._stream import Stream

__all__ = ["flush_frees", "housekeeping"]


class _Released:
    """A foreign buffer's release, run when its stream point completes."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def stream_done(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            try:
                fn()
            except Exception:  # a library's deleter failing must not break the runtime
                pass


def flush_frees(dev: Any) -> None:
    """Enqueue ``dev``'s deferred frees, each after every pending access to its memory
    (under LOCK)."""
    pending = dev._dead_buffers
    if not pending or dev._resetting:
        return
    gen = dev.generation
    while pending:
        g, ptr, nbytes, accesses, release = pending.popleft()
        if release is not None:
            _release_foreign(dev, g, release, accesses)
            continue
        if g != gen:
            continue  # memory of a reset device is gone already
        dev._bytes_in_use -= nbytes
        # Free on the stream of the last writer if it is usable, else on the utility
        # stream; after every pending access (of any stream, any device).
        target = None
        for s, _ in accesses:
            # Never another library's stream: it may be destroyed by now (its last
            # event, recorded by the submission that used it, is all a free waits for).
            if s.device is dev and s.generation == gen and s.capture is None and s.handle is not None and not s._foreign:
                target = s
                break
        if target is None:
            target = dev._utility_stream()
        _after(target, accesses)
        dev._driver.free(ptr, target.handle)
        target.mark()
        dev._stats.frees += 1
        dev._stats.bytes_freed += nbytes


def _release_foreign(dev: Any, g: int, release: Any, accesses: list[tuple[Stream, int]]) -> None:
    """Let another library's memory go once trio-cuda's accesses are done (under LOCK)."""
    if g != dev.generation:
        _Released(release).stream_done()  # the device was reset: nothing of ours is pending
        return
    target = dev._utility_stream()
    _after(target, accesses)
    target.keep(_Released(release))
    target.mark()


def _after(target: Stream, accesses: list[tuple[Stream, int]]) -> None:
    """Order ``target``'s next work after each access (a stream and its point) that may
    still be pending: on a device reset since, or being reset, there is none."""
    for s, seq in accesses:
        other = s.device
        if s.generation != other.generation or other._resetting:
            continue
        try:
            target.wait_for(s, seq, ordering_only=True)
        except DeviceError:
            pass  # the other device faulted: its work will never touch this memory


def housekeeping(dev: Any) -> None:
    """Destroy ``dev``'s streams and graphs nothing references any more (under LOCK)."""
    gen = dev.generation
    if dev._resetting:
        return
    dead = dev._dead_streams
    while dead:
        s = dead.popleft()
        if s.generation != gen or s.handle is None:
            continue  # its work went with a reset
        pending = s.seq > s.done_seq or bool(s._keep)
        handle = None if s._foreign else s.handle  # another library's stream is never destroyed here
        if pending:
            # Its last work may still run: an event after it stands in for the stream
            # (for waits on it, synchronize() and out-of-memory retries), and holds what
            # that work uses and its driver stream until that work is done (destroying a
            # driver stream with a long kernel queued made the next stream created wait
            # for that kernel).
            s._final = s.event_at(s.seq)
            dev._lingering.append((s._final, s._keep, handle))
        elif handle is not None:
            destroy_driver_stream(dev, handle)
        s.handle = None
    if dev._lingering:
        still = []
        for ev, keep, handle in dev._lingering:
            try:
                done = dev._driver.query(ev.handle)
            except DeviceError:
                done = False  # a fault: kept until the reset drops everything
            if done:
                for _, obj in keep:
                    release = getattr(obj, "stream_done", None)
                    if release is not None:
                        release()
                if handle is not None:
                    destroy_driver_stream(dev, handle)
            else:
                still.append((ev, keep, handle))
        dev._lingering = still
    graphs = dev._dead_graphs
    while graphs:
        g, handle = graphs.popleft()
        if g == gen:
            dev._driver.graph_destroy(handle)  # replays in flight finish first


def destroy_driver_stream(dev: Any, handle: Any) -> None:
    """Destroy one of ``dev``'s driver streams, counted (under LOCK)."""
    dev._driver.destroy_stream(handle)
    dev._stats.streams_destroyed += 1
