"""Running a test's body under each event loop: trio, asyncio, asyncio on uvloop (anyio.run)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

import trio_cuda
from trio_cuda import lowlevel

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


async def started(
    op: object, policy: trio_cuda.SchedulingPolicy | None = None, *, task_status: Any = anyio.TASK_STATUS_IGNORED
) -> object:
    """For ``await task_group.start(started, op[, policy])`` (anyio): reports started once
    ``op`` is enqueued, then waits for it."""
    stream = policy.next_stream() if policy is not None else None
    sub = await lowlevel.submit(op, stream)  # type: ignore[arg-type]
    task_status.started()
    return await sub.wait()
