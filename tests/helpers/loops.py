"""Running a test's body under each event loop: trio, asyncio, asyncio on uvloop (anyio.run)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

DEADLINE = float(os.environ.get("TRIO_CUDA_TEST_DEADLINE", "90"))


class Run:
    """``run(fn, *args)``: ``await fn(*args)`` in a new run of one loop, with a deadline."""

    def __init__(self, backend: str, **options: Any) -> None:
        self.backend = backend
        self.options = options

    def __call__(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        async def main() -> Any:
            with anyio.fail_after(DEADLINE):
                return await fn(*args)

        return anyio.run(main, backend=self.backend, backend_options=self.options)

    def __repr__(self) -> str:
        return "uvloop" if self.options.get("use_uvloop") else self.backend


def _uvloop() -> list[Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return [pytest.param(None, id="uvloop", marks=pytest.mark.skip(reason="uvloop is not installed"))]
    return [pytest.param(Run("asyncio", use_uvloop=True), id="uvloop")]


LOOPS = [pytest.param(Run("trio"), id="trio"), pytest.param(Run("asyncio"), id="asyncio"), *_uvloop()]
