"""Probe: which driver calls, if any, bring a device back after an illegal address?

Each variant runs in a fresh process: fault the primary context with an out-of-bounds
store, then try to recover and run a small kernel. Prints one line per variant.
Usage: python benchmarks/probes/probe_reset_variants.py            (runs all variants)
"""

import subprocess
import sys

VARIANTS = ["reset_only", "reset_release_retain", "release_all_retain", "ctx_create"]


def child(variant: str) -> None:
    import numpy as np
    from cuda.bindings import driver as cu

    from numba import types
    from numba.cuda import compile_ptx

    def ok(r, what):
        if r[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {cu.cuGetErrorName(r[0])[1].decode()}")
        return r[1] if len(r) == 2 else r[1:]

    def scribble(z):
        z[1 << 40] = 1.0

    def fill(z):
        z[0] = 7.0

    ok(cu.cuInit(0), "init")
    dev = ok(cu.cuDeviceGet(0), "dev")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "setcurrent")
    sig = (types.Array(types.float32, 1, "C"),)

    def load(fn):
        ptx, _ = compile_ptx(fn, sig, cc=(9, 0))
        entry = next(line for line in ptx.splitlines() if ".entry" in line).split(".entry", 1)[1].strip().split("(")[0]
        mod = ok(cu.cuModuleLoadData(ptx.encode()), "load")
        return ok(cu.cuModuleGetFunction(mod, entry.encode()), "getfunction")

    def run(fn):
        buf = ok(cu.cuMemAlloc(1024), "alloc")
        vals = np.array([0, 0, 256, 4, int(buf), 256, 4], dtype=np.uint64)
        ptrs = np.array([vals.ctypes.data + 8 * i for i in range(7)], dtype=np.uint64)
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, ptrs.ctypes.data, 0), "launch")
        ok(cu.cuCtxSynchronize(), "sync")
        out = np.zeros(1, np.float32)
        ok(cu.cuMemcpyDtoH(out.ctypes.data, buf, 4), "dtoh")
        return float(out[0])

    bad = load(scribble)
    try:
        run(bad)
        print(variant, "| no fault?!")
        return
    except RuntimeError as e:
        fault = str(e)
    steps = []
    try:
        if variant == "reset_only":
            ok(cu.cuDevicePrimaryCtxReset(dev), "reset")
            steps.append("reset")
            ok(cu.cuCtxSetCurrent(ctx), "setcurrent")
            steps.append("setcurrent")
        elif variant == "reset_release_retain":
            ok(cu.cuDevicePrimaryCtxReset(dev), "reset")
            steps.append("reset")
            ok(cu.cuDevicePrimaryCtxRelease(dev), "release")
            steps.append("release")
            ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "retain")
            steps.append("retain")
            ok(cu.cuCtxSetCurrent(ctx), "setcurrent")
            steps.append("setcurrent")
        elif variant == "release_all_retain":
            ok(cu.cuDevicePrimaryCtxRelease(dev), "release")
            steps.append("release")
            ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "retain")
            steps.append("retain")
            ok(cu.cuCtxSetCurrent(ctx), "setcurrent")
            steps.append("setcurrent")
        elif variant == "ctx_create":
            ok(cu.cuCtxSetCurrent(0), "unset")
            steps.append("unset")
            ctx = ok(cu.cuCtxCreate(None, 0, dev), "ctxcreate")
            steps.append("ctxcreate")
        good = load(fill)
        steps.append("load")
        val = run(good)
        print(variant, "| fault:", fault, "| steps:", steps, "| RECOVERED, kernel wrote", val)
    except Exception as e:
        print(variant, "| fault:", fault, "| steps ok:", steps, "| then failed:", e)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        for v in VARIANTS:
            r = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True, timeout=120)
            print(r.stdout.strip() or r.stderr.strip()[-400:])
