"""Probe: after an illegal address on one stream, what do calls about other streams return?

Three streams run ~2 s sleep kernels; a fourth runs an out-of-bounds store. We then
poll, over time, the sleeps' events (cuEventQuery) and a few other cheap calls, to see
which of them report the sticky error and when. Prints a timeline.
"""

import time

import numpy as np
from cuda.bindings import driver as cu

from llvmlite import ir
from numba import cuda, types
from numba.core.extending import intrinsic
from numba.cuda import compile_ptx


@intrinsic
def globaltimer(typingctx):
    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %globaltimer;", "=l", side_effect=True)
        return builder.call(asm, [])

    return types.uint64(), codegen


def sleeper(z):
    start = globaltimer()
    while globaltimer() - start < 2_000_000_000:
        cuda.nanosleep(1000)
    z[0] = 1.0


def scribble(z):
    z[1 << 40] = 1.0


def name(r):
    return cu.cuGetErrorName(r)[1].decode()


def main():
    cu.cuInit(0)
    _, dev = cu.cuDeviceGet(0)
    _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
    cu.cuCtxSetCurrent(ctx)
    sig = (types.Array(types.float32, 1, "C"),)

    def load(fn):
        ptx, _ = compile_ptx(fn, sig, cc=(9, 0))
        entry = next(line for line in ptx.splitlines() if ".entry" in line).split(".entry", 1)[1].strip().split("(")[0]
        _, mod = cu.cuModuleLoadData(ptx.encode())
        return cu.cuModuleGetFunction(mod, entry.encode())[1]

    sl, bad = load(sleeper), load(scribble)
    keep = []

    def launch(fn, stream):
        _, buf = cu.cuMemAlloc(1024)
        vals = np.array([0, 0, 256, 4, int(buf), 256, 4], dtype=np.uint64)
        ptrs = np.array([vals.ctypes.data + 8 * i for i in range(7)], dtype=np.uint64)
        keep.extend([vals, ptrs])
        return cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, ptrs.ctypes.data, 0)[0]

    streams = [cu.cuStreamCreate(1)[1] for _ in range(5)]
    events = [cu.cuEventCreate(2)[1] for _ in range(5)]
    for i in range(3):
        launch(sl, streams[i])
        cu.cuEventRecord(events[i], streams[i])
    time.sleep(0.2)
    print("before fault: sleeps", [name(cu.cuEventQuery(e)[0]) for e in events[:3]])
    t0 = time.perf_counter()
    print("launch bad:", name(launch(bad, streams[3])))
    cu.cuEventRecord(events[3], streams[3])
    for _ in range(12):
        t = time.perf_counter() - t0
        row = {
            "sleeps": [name(cu.cuEventQuery(e)[0]) for e in events[:3]],
            "bad": name(cu.cuEventQuery(events[3])[0]),
            "streamQuery0": name(cu.cuStreamQuery(streams[0])[0]),
            "record": name(cu.cuEventRecord(events[4], streams[4])[0]),
            "memGetInfo": name(cu.cuMemGetInfo()[0]),
        }
        print(f"t={t:.3f}s", row)
        time.sleep(0.25)


if __name__ == "__main__":
    main()
