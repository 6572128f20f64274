"""Faulting a device on purpose, and running code in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import trio

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api
from trio_cuda.kernels import sleep

from numba import cuda


@trio_cuda.kernel
def scribble(z):  # type: ignore[no-untyped-def]
    # Far out of bounds: an IndexError on the simulated device, an illegal address on a GPU.
    i = cuda.grid(1)
    z[i + (1 << 40)] = 1.0


async def ready_to_fault(device: int) -> tuple[trio_cuda.Tensor, trio_cuda.Tensor]:
    """A counter and a scribble target on ``device``, both kernels loaded: the next
    launches start at once (a fault is not held back by a compilation)."""
    with trio_cuda.use_device(device):
        c = await api.zeros((4,), np.int32)
        z = await api.zeros((32,))
        await sleep(c.partition((4,)), 1000)
        await trio.to_thread.run_sync(scribble.prepare, z.partition((32,)))
    return c, z


def child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, TRIO_CUDA_QUIET="1", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=300)


def child_ok(r: object) -> None:
    """``child``'s process exited 0 and printed OK."""
    out = getattr(r, "stdout", "") + getattr(r, "stderr", "")
    assert getattr(r, "returncode", 1) == 0, out[-4000:]
    assert "OK" in getattr(r, "stdout", ""), out[-4000:]
