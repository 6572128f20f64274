"""An in-memory key-value store with torch.distributed.Store's methods, for joining
ProcessGroups through ``from_store`` in tests (several ranks in one process, each on a
simulated device of its own)."""

from __future__ import annotations

import threading
from collections.abc import Sequence


class MemoryStore:
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes | str) -> None:
        with self._lock:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def check(self, keys: Sequence[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            n = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(n).encode()
            return n

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)
