"""A device's statistics: the counters it keeps under the runtime lock, and the frozen
snapshot :meth:`trio_cuda.Device.statistics` gives of them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Counters", "DeviceStatistics"]


@dataclass(frozen=True)
class DeviceStatistics:
    """A snapshot of one device's runtime counters (see :meth:`Device.statistics`).

    Attributes:
        ordinal: The device ordinal.
        backend: ``"cuda"`` or ``"sim"``.
        generation: How many times the device was reset.
        submissions: DAG submissions so far.
        launches: Kernel launches enqueued.
        graph_launches: CUDA graph replays enqueued.
        allocations: Device allocations made.
        frees: Device frees enqueued.
        copies: Copies and fills enqueued.
        stream_waits: Cross-stream waits enqueued by dependency tracking and joins.
        bytes_in_use: Bytes of live device buffers plus frees not yet enqueued.
        streams: Live streams of the device.
        streams_destroyed: Streams destroyed because nothing referenced them any more.
        staging_bytes: Pinned host staging memory held for this device (idle or lent).
        staging_pins: Pinned buffers allocated for it so far.
        staging_unpins: Pinned buffers released (idle beyond the cap).
        staging_unpinning: Bytes of those buffers the janitor thread has not unpinned
            yet (unpinning may wait for the device, so it runs in the background; 0
            once it is done). They no longer count in ``staging_bytes``.
        faulted: Whether the device is faulted (and refuses work until reset).
        bytes_allocated: Bytes of device memory allocated so far (all allocations).
        bytes_freed: Bytes of device memory whose free was enqueued so far.
        queue_depths: Per live stream of the device, the points of work enqueued on it
            that are not yet known to have completed (``seq - done_seq``; the runtime
            learns of completions when it polls or waits, so this is an upper bound).
    """

    ordinal: int
    backend: str
    generation: int
    submissions: int
    launches: int
    graph_launches: int
    allocations: int
    frees: int
    copies: int
    stream_waits: int
    bytes_in_use: int
    streams: int
    streams_destroyed: int
    staging_bytes: int
    staging_pins: int
    staging_unpins: int
    faulted: bool
    bytes_allocated: int = 0
    bytes_freed: int = 0
    queue_depths: tuple[int, ...] = ()
    staging_unpinning: int = 0


class Counters:
    """The counts a device keeps (under the runtime lock)."""

    __slots__ = (
        "allocations",
        "bytes_allocated",
        "bytes_freed",
        "copies",
        "frees",
        "graph_launches",
        "launches",
        "staging_bytes",
        "staging_pins",
        "staging_unpinning",
        "staging_unpins",
        "stream_waits",
        "streams_destroyed",
        "submissions",
    )

    def __init__(self) -> None:
        self.submissions = self.launches = self.graph_launches = self.allocations = 0
        self.frees = self.copies = self.stream_waits = self.streams_destroyed = 0
        self.staging_bytes = self.staging_pins = self.staging_unpins = self.staging_unpinning = 0
        self.bytes_allocated = self.bytes_freed = 0
