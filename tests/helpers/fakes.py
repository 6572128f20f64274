"""Stand-ins: ctypes callbacks in place of the CUDA driver's entry points (for the compiled
fast path)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest

VP = ctypes.c_void_p
U = ctypes.c_uint
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, VP, U, U, U, U, U, U, U, VP, VP, VP)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP)
QUERY = ctypes.CFUNCTYPE(ctypes.c_int, VP)
GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP)


def address(cb: Any) -> int:
    return int(ctypes.cast(cb, VP).value or 0)


class FakeDriver:
    """ctypes stand-ins for the three entry points: they record their arguments and
    return the result codes a test sets."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.answer = {"launch": 0, "record": 0, "query": 0}
        self._cbs = (
            LAUNCH(lambda *a: self._call("launch", a)),
            RECORD(lambda *a: self._call("record", a)),
            QUERY(lambda *a: self._call("query", a)),
        )
        self.entry_points = tuple(address(cb) for cb in self._cbs)

    def _call(self, name: str, args: tuple[Any, ...]) -> int:
        self.calls.append((name, *args))
        return self.answer[name]


def fake_cuda_driver(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A CUDA backend driver object without a context whose entry points are ``fake``'s
    (only the launch, record and query can run)."""
    from trio_cuda._backends import _cuda

    d = _cuda.CudaDevice.__new__(_cuda.CudaDevice)
    d.ordinal = 0
    d._fault = None
    d._lock = threading.Lock()
    d._token = object()
    monkeypatch.setattr(_cuda._tls, "token", d._token, raising=False)
    d._fast = fake.entry_points
    return d
