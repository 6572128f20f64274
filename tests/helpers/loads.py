"""Kernels nothing has compiled yet, and kernel loads held back until a test lets them go:
for tests of what a submission does while it waits for its first compilation."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest

import trio_cuda  # before numba.cuda: it chooses the backend

from numba import cuda

_tags = itertools.count(1)


def fresh_kernel() -> trio_cuda.Kernel:
    """A kernel ``out = 2 * x`` that nothing in this process has compiled yet (a tag of
    its own makes it one of its own)."""
    tag = next(_tags)

    @trio_cuda.kernel
    def twice(out, x):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = 2 * x[i] + tag * 0

    return twice


def hold_loads(dev: trio_cuda.Device, monkeypatch: pytest.MonkeyPatch, fail: BaseException | None = None) -> Callable[[], None]:
    """Make every kernel load of ``dev`` wait until the returned function is called (or
    10 s pass), then load, or raise ``fail`` (a load that fails, as a bad module does)."""
    drv = dev._driver
    real = drv.load_kernel
    gate = threading.Event()

    def held(source: object, signature: object, args: object) -> object:
        gate.wait(10)
        if fail is not None:
            raise fail
        return real(source, signature, args)

    monkeypatch.setattr(drv, "load_kernel", held)
    return gate.set
