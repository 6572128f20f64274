"""Where a last-axis sum's time goes: the same 128 MiB of float32 summed over rows of
different lengths, trio_cuda.ops.sum against torch.sum (GB/s), and the registers per
thread of the generated reduction kernel. Needs CUDA and PyTorch."""

from __future__ import annotations

import time
from typing import Any

import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops


async def main() -> None:
    import torch
    from cuda.bindings import driver as cu

    stream = trio_cuda.device(0).create_stream()
    reps = 100
    print("| rows x cols | trio GB/s | torch GB/s | ratio |\n|---|---|---|---|")
    for m, k in ((65536, 512), (16384, 2048), (4096, 8192), (1024, 32768), (256, 131072)):
        a = torch.randn(m, k, device="cuda")
        s = torch.empty(m, device="cuda")
        for _ in range(3):
            torch.sum(a, dim=-1, out=s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.sum(a, dim=-1, out=s)
        torch.cuda.synchronize()
        t_torch = (time.perf_counter() - t0) / reps
        x = await api.from_host(a.cpu().numpy())
        st = await api.empty((m,))
        for _ in range(3):
            await (await lowlevel.submit(ops.sum(x, -1, out=st), stream)).wait()
        t0 = time.perf_counter()
        last: Any = None
        for _ in range(reps):
            last = await lowlevel.submit(ops.sum(x, -1, out=st), stream)
        await last.wait()
        t_trio = (time.perf_counter() - t0) / reps
        gb = 4 * m * k / 1e9
        print(f"| {m} x {k} | {gb / t_trio:.0f} | {gb / t_torch:.0f} | {t_torch / t_trio:.3f} |", flush=True)
    # registers per thread of the loaded reduction kernel(s)
    drv = trio_cuda.device(0)._driver
    for launcher in list(drv._launchers.values()):
        r = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, launcher.function)
        print("kernel", launcher.name, "registers per thread", r[1])


if __name__ == "__main__":
    trio.run(main)
