import time, trio, numpy as np, trio_cuda
from numba import cuda
from trio_cuda import api
from trio_cuda.kernels import sleep

@trio_cuda.kernel
def scribble(z):
    i = cuda.grid(1)
    z[i + (1 << 40)] = 1.0

async def main():
    t0 = time.perf_counter()
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)
    print("warm", time.perf_counter() - t0)
    t0 = time.perf_counter()
    await sleep(c.partition((1,)), 300_000_000)
    print("sleep 0.3 took", time.perf_counter() - t0)
    outcomes = []
    async def waiter(i):
        s = trio_cuda.current_device().policy.next_stream()
        try:
            await sleep(api.zeros((1,), np.int32).partition((1,)), 3_000_000_000).schedule(trio_cuda.SingleStream(stream=s))
            outcomes.append((i, "completed", time.perf_counter() - t0, id(s)))
        except trio_cuda.DeviceFault as e:
            outcomes.append((i, "fault", time.perf_counter() - t0, id(s), str(e)[:80]))
    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for i in range(3):
            n.start_soon(waiter, i)
        await trio.sleep(0.1)
        s = trio_cuda.current_device().policy.next_stream()
        print("bad on", id(s))
        try:
            await scribble(api.zeros((32,)).partition((32,))).schedule(trio_cuda.SingleStream(stream=s))
        except trio_cuda.DeviceFault as e:
            print("bad fault at", time.perf_counter() - t0, e)
    for o in outcomes: print(o)
trio.run(main)
