"""Kernels whose effect is time: for overlap tests, cancellation tests and benchmarks."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import trio_cuda

from numba import cuda

from ._intrinsics import globaltimer


def _sleep_on_host(counter: Any, ns: Any) -> None:
    # The simulated device sleeps without the GIL, so streams visibly overlap.
    time.sleep(int(ns) / 1e9)
    counter[0] += 1


def _check_sleep(counter: Any, ns: Any) -> None:
    if not isinstance(counter, trio_cuda.Partition) or counter.ndim != 1 or counter.shape[0] < 1:
        raise ValueError("sleep: the counter must be a 1-D partition with at least one element")
    if counter.dtype.kind not in "iu":
        raise TypeError(f"sleep: the counter must be an integer tensor, got {counter.dtype}")
    if not isinstance(ns, (int, np.integer)) or isinstance(ns, bool) or ns < 0:
        raise ValueError(f"sleep: ns must be a non-negative int, got {ns!r}")


@trio_cuda.kernel(sim=_sleep_on_host, validate=_check_sleep)
def sleep(counter: Any, ns: Any) -> None:
    """Keep one block busy for ``ns`` nanoseconds (by the GPU's timer), then add 1 to ``counter[0]``.

    Launch it on a 1-D integer partition with one tile (``api.zeros((1,), np.int32)
    .partition((1,))``): the grid is one block of one thread. ``counter`` counts the
    sleeps that ran, which makes ordering visible.
    """
    if cuda.grid(1) == 0:
        start = globaltimer()
        while globaltimer() - start < ns:
            cuda.nanosleep(1000)
        counter[0] += 1
