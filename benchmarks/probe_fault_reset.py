"""Probe: does a device recover from an illegal-address fault through a reset?

Launches a kernel that writes far out of bounds, expects DeviceFault for the waiting
task and for new work, resets the device, and checks that new work runs. Prints one
line per step; exit status 0 if the device recovered.
"""

import sys

import numpy as np
import trio

import trio_cuda
from numba import cuda
from trio_cuda import api


@trio_cuda.kernel
def scribble(z):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    z[i + (1 << 40)] = 1.0


async def main() -> int:
    dev = trio_cuda.current_device()
    ok = await api.ones((4,)).to_host()
    print("before:", ok)
    try:
        await scribble(api.zeros((32,)).partition((32,)))
        print("no fault raised")
        return 1
    except trio_cuda.DeviceFault as e:
        print("fault:", e)
    print("is_faulted:", dev.is_faulted)
    try:
        await api.ones((4,))
        print("new work accepted while faulted")
        return 1
    except trio_cuda.DeviceFault as e:
        print("refused:", e)
    dev.reset()
    print("after reset is_faulted:", dev.is_faulted)
    out = await api.full((4,), 3.0).to_host()
    print("after reset:", out)
    return 0 if np.all(out == 3.0) else 1


if __name__ == "__main__":
    sys.exit(trio.run(main))
