"""Scheduling policies: which stream an op runs on. Nothing else.

Dependencies between streams are tracked elsewhere (per buffer), so a policy is free
to spread work: any stream choice is correct, the choice only affects overlap. A
policy owns its streams; a dropped policy's streams are destroyed once their work is
done (see :class:`~trio_cuda.Stream`).
"""

from __future__ import annotations

import abc
import itertools

from ._checks import as_int
from ._device import Device, set_default_policy_factory
from ._registry import as_device
from ._stream import Stream

__all__ = ["SchedulingPolicy", "SingleStream", "StreamPoolRoundRobin"]


class SchedulingPolicy(abc.ABC):
    """Decides the stream of each submission (and of each independent ``zip`` branch).

    Attributes:
        device: The device whose streams this policy hands out.
    """

    device: Device

    @abc.abstractmethod
    def next_stream(self) -> Stream:
        """The stream for the next submission or independent branch (any thread)."""

    def submission_stream(self) -> Stream:
        """The stream for a submission that names none (``await op``, ``op.sync()``,
        ``lowlevel.submit(op)``); independent branches inside it use :meth:`next_stream`.
        By default :meth:`next_stream` (any thread)."""
        return self.next_stream()

    @property
    @abc.abstractmethod
    def streams(self) -> tuple[Stream, ...]:
        """Every stream the policy may return."""


class StreamPoolRoundRobin(SchedulingPolicy):
    """Rotates over a fixed pool of streams so independent work overlaps (the default).

    A submission goes to the stream the previous submission got while that stream is
    known to be idle (everything on it seen complete), and to the next stream of the
    pool otherwise: work submitted while earlier work still runs is spread, one await
    after another stays on one stream (measured on an H200: ~3 us less per await than
    moving to an idle stream each time). Independent branches of one submission always
    rotate.

    Args:
        device: The device (default: the current device).
        num_streams: Size of the pool (default 4).
    """

    def __init__(self, device: Device | int | None = None, num_streams: int = 4) -> None:
        n = as_int(num_streams, "num_streams", minimum=1)
        self.device = as_device(device)
        self._streams = tuple(self.device.create_stream() for _ in range(n))
        # itertools.cycle's __next__ is one C call: atomic under the GIL, no lock needed.
        self._next = itertools.cycle(self._streams).__next__
        self._last: Stream | None = None  # a race only picks another stream: any choice is correct

    def next_stream(self) -> Stream:
        return self._next()

    def submission_stream(self) -> Stream:
        last = self._last
        if last is not None and last.seq <= last.done_seq:
            return last
        s = self._last = self._next()
        return s

    @property
    def streams(self) -> tuple[Stream, ...]:
        return self._streams

    def __repr__(self) -> str:
        return f"StreamPoolRoundRobin(device={self.device.ordinal}, num_streams={len(self._streams)})"


class SingleStream(SchedulingPolicy):
    """Pins all work to one stream: everything runs in submission order.

    Args:
        device: The device (default: the current device, or the stream's device).
        stream: The stream to use (default: a new stream of the device).
    """

    def __init__(self, device: Device | int | None = None, stream: Stream | None = None) -> None:
        if stream is not None:
            if not isinstance(stream, Stream):
                raise TypeError(f"expected a Stream, got {stream!r}")
            if device is not None and as_device(device) is not stream.device:
                raise ValueError("the stream belongs to another device")
            self.device = stream.device
            self._stream = stream
        else:
            self.device = as_device(device)
            self._stream = self.device.create_stream()

    def next_stream(self) -> Stream:
        return self._stream

    @property
    def streams(self) -> tuple[Stream, ...]:
        return (self._stream,)

    def __repr__(self) -> str:
        return f"SingleStream(device={self.device.ordinal})"


set_default_policy_factory(StreamPoolRoundRobin)
