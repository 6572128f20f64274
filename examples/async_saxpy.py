"""y = a*x + y with a = 2 and x = y = arange(32) as a 4x8 matrix in 2x4 tiles.

Expects y == 3 * arange(32). Exits non-zero if the result is wrong.
"""

import sys

import numpy as np
import trio

import trio_cuda
from trio_cuda import api
from trio_cuda.kernels import saxpy


async def main() -> int:
    a = np.float32(2.0)
    x = await api.arange(32).reshape(4, 8)
    y = api.arange(32).reshape(4, 8).partition((2, 4))
    result = await saxpy(a, x, y).last().unpartition().to_host()
    expected = 3 * np.arange(32, dtype=np.float32).reshape(4, 8)
    print("y = 2x + y:")
    print(result)
    ok = bool(np.array_equal(result, expected))
    print("correct" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
