"""Device buffers and the pending accesses of their memory.

A :class:`Buffer` is one device allocation. It remembers its last writer and its
readers since, as markers ``(stream, seq)``: an op on another stream waits for them
before touching the memory (automatic cross-stream ordering), and the memory is
freed, when the last view is dropped, only after all of them (a stream-ordered free).
Accesses through untracked views are remembered apart (``lifetime``): they order
nothing, but the free waits for them too. So nothing is freed under the GPU,
cancelled or not, tracked or not.

A buffer is made when a submission is *planned* and allocated when it is *enqueued*
(allocations come first in the enqueue, so an out-of-memory error leaves nothing
half-run). Until then ``ptr`` is None and ``owner`` is the plan that will allocate
it; a plan that is abandoned leaves a buffer with no memory that refuses use.

Owner: a buffer's fields change only under the runtime lock, by the submission that
uses it. Its finalizer queues the free on its device without locking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._backends._boundary import ArrayArg
from ._errors import GraphCaptureError

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Stream

__all__ = ["Buffer", "ForeignBuffer"]


def _name(what: object) -> str:
    return what if isinstance(what, str) else repr(what)


class Buffer:
    """One device allocation and its pending accesses. Internal.

    Attributes:
        device: The device of the memory.
        nbytes: Its size.
        ptr: The device address, or None before the allocating submission enqueues.
        generation: The device generation of the memory.
        writer: The last tracked write, ``(stream, seq)``, or None.
        readers: Tracked reads since that write, ``{stream: seq}``.
        lifetime: Untracked accesses, ``{stream: seq}`` (for the free only).
        owner: The unfinished plan that will allocate it, or None.
        capture: The open capture that recorded an access to it, or None.
    """

    __slots__ = (
        "__weakref__",
        "args",
        "capture",
        "device",
        "generation",
        "lifetime",
        "nbytes",
        "owner",
        "ptr",
        "readers",
        "writer",
    )

    def __init__(self, device: Device, nbytes: int, owner: Any) -> None:
        self.device = device
        self.nbytes = nbytes
        self.generation = device.generation
        self.writer: tuple[Stream, int] | None = None
        self.readers: dict[Stream, int] = {}
        self.lifetime: dict[Stream, int] = {}
        self.capture: Any = None
        # Kernel argument descriptors of views of this buffer, by geometry (and tracking):
        # views made anew (reshape, partition) share them, so prepared launches stay cached.
        self.args: dict[tuple[Any, ...], tuple[ArrayArg, ArrayArg]] = {}
        if nbytes == 0:
            self.ptr: int | None = 0
            self.owner: Any = None
        else:
            self.ptr = None
            self.owner = owner

    def accesses(self) -> list[tuple[Stream, int]]:
        """Every pending access, the writer first."""
        acc = list(self.readers.items())
        acc.extend(self.lifetime.items())
        if self.writer is not None:
            acc.insert(0, self.writer)
        return acc

    def check(self, plan: Any, what: object) -> None:
        """Raise if the buffer cannot be used by ``plan`` (stale, abandoned, being captured).

        A buffer another unfinished plan will allocate makes ``plan`` wait for that plan.
        ``what`` names the buffer in errors: a string, or an object whose repr is taken
        only then (most calls are for a buffer the plan itself allocates, and raise
        nothing: a repr a call would cost a planned op about a tenth of its planning).
        """
        if self.generation != self.device.generation:
            raise ValueError(f"{_name(what)} was allocated before device {self.device.ordinal} was reset; its memory is gone")
        if self.ptr is None:
            owner = self.owner
            if owner is None:
                raise ValueError(
                    f"{_name(what)} belongs to a submission that was cancelled or failed before it ran (or to an op of it that did not run); it has no memory"
                )
            if owner is not plan:
                plan.wait_for_plan(owner)
        cap = self.capture
        if cap is not None and cap is not plan.capture:
            raise GraphCaptureError(
                f"{_name(what)} is being recorded into a graph capture that is still open; finish the capture first",
                device=self.device.ordinal,
            )

    def __repr__(self) -> str:
        where = f"{self.ptr:#x}" if self.ptr else ("unallocated" if self.ptr is None else "empty")
        return f"<Buffer {self.nbytes} bytes at {where} on device {self.device.ordinal}>"

    def __del__(self) -> None:
        ptr = self.ptr
        if ptr:
            try:
                self.device._defer_free(self.generation, ptr, self.nbytes, self.accesses())
            except Exception:  # interpreter shutdown
                pass


class ForeignBuffer(Buffer):
    """Memory another library owns, seen as a buffer (``api.from_dlpack``). Internal.

    trio-cuda never frees it: when the last view is dropped, ``release`` (which lets the
    owner go) runs once every pending access of trio-cuda's streams has completed.
    """

    __slots__ = ("release",)

    def __init__(self, device: Device, nbytes: int, ptr: int, release: Any) -> None:
        super().__init__(device, nbytes, None)
        self.ptr = ptr
        self.owner = None
        self.release = release

    def __del__(self) -> None:
        release, self.release = self.release, None
        if release is None:
            return
        try:
            self.device._defer_free(self.generation, 0, 0, self.accesses(), release)
        except Exception:  # interpreter shutdown
            pass
