"""The quick-start program: allocation, a kernel and the read-back, awaited once.

Runs on a GPU, or on the simulated device when there is none.
Exits non-zero if the result is wrong.
"""

import sys

import trio

import trio_cuda
from trio_cuda import api
from trio_cuda.kernels import add


async def main() -> int:
    x = await api.ones((32, 32))
    y = await api.ones((32, 32))
    # One await: the allocation of z, the kernel and the copy back are pipelined.
    z = await add(api.zeros((32, 32)).partition((4, 4)), x, y).first().unpartition().to_host()
    print(f"z = x + y on {trio_cuda.current_device().name}: shape {z.shape}, dtype {z.dtype}")
    print(z[:4, :8])
    ok = bool((z == 2.0).all())
    print("correct" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(trio.run(trio_cuda.trace.traced, main))  # --trace FILE: write a trace of the run
