"""What a submission waits for before it can enqueue (kernels to compile, staging to pin,
another plan, memory in use, communicators to make), and how it waits: blocking on the
calling thread or, from a trio or asyncio task, in a worker thread (slow host work) or in
the loop (another plan's end, an event's completion)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _loop
from ._notifier import wait_event
from ._staging import pin

if TYPE_CHECKING:
    from ._backends._boundary import KernelSource
    from ._device import Device

__all__ = ["KernelNeed", "Need", "load_kernels"]


class KernelNeed:
    __slots__ = ("args", "device", "loaded", "signature", "source")

    def __init__(self, source: KernelSource, device: Device, signature: tuple[Any, ...], args: list[Any]) -> None:
        self.source = source
        self.device = device
        self.signature = signature
        self.args = args
        self.loaded: Any = None


class Need:
    """What a submission waits for before it can enqueue (see the module docstring)."""

    __slots__ = ("data", "kind")

    def __init__(self, kind: str, data: Any) -> None:
        self.kind = kind  # "kernels" | "staging" | "plan" | "memory" | "communicators"
        self.data = data

    def wait_blocking(self) -> None:
        kind, data = self.kind, self.data
        if kind == "kernels":
            load_kernels(data)
        elif kind == "staging":
            for device, sizes in data:
                pin(device, sizes)
        elif kind == "plan":
            data.done.wait()
        elif kind == "communicators":
            for hold in data:
                hold.make()
        else:  # memory
            for ev in data:
                ev.device.wait_blocking(ev)

    async def wait_async(self) -> None:
        kind, data = self.kind, self.data
        if kind == "memory":
            for ev in data:
                await wait_event(ev)
        elif kind == "plan":
            # Another submission (perhaps of this loop) finishes its own wait first: in
            # the loop, not a worker thread, which that other one may need (for its
            # kernels or staging) when all of them are taken by submissions like this one.
            await data.done.wait_async()
        else:
            await _loop.run_in_thread(self.wait_blocking)


def load_kernels(needs: list[KernelNeed]) -> None:
    """Compile and load kernels (slow: numba and module loading). No runtime lock held."""
    for n in needs:
        dev = n.device
        gen = dev.generation
        with dev._slow_lock:
            if dev.generation != gen:
                continue  # the next plan step re-checks against the reset device
            n.loaded = dev._driver.load_kernel(n.source, n.signature, n.args)
