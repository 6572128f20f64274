"""CUDA-backend specifics (marked gpu: skipped on the simulated device)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import trio_cuda
from trio_cuda import api

pytestmark = pytest.mark.gpu


def _cu():  # type: ignore[no-untyped-def]
    from cuda.bindings import driver

    return driver


async def test_launches_never_touch_numbas_runtime() -> None:
    from trio_cuda.kernels import add

    out = await add(api.zeros((64,)).partition((32,)), api.ones((64,)), api.ones((64,))).first().to_host()
    np.testing.assert_array_equal(out, np.full(64, 2.0))
    # numba compiles the kernels to PTX; its dispatcher and its driver wrapper are unused.
    from numba.cuda.cudadrv import driver as numba_driver

    assert not numba_driver.driver.is_initialized


def test_memory_pool_keeps_memory_and_adds_no_hidden_waits(dev: trio_cuda.Device) -> None:
    cu = _cu()
    drv = dev._driver
    attr = cu.CUmemPool_attribute
    err, threshold = cu.cuMemPoolGetAttribute(drv.pool, attr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
    assert err == cu.CUresult.CUDA_SUCCESS and int(threshold) == 2**64 - 1
    err, internal = cu.cuMemPoolGetAttribute(drv.pool, attr.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES)
    assert err == cu.CUresult.CUDA_SUCCESS and int(internal) == 0


def test_staging_memory_is_pinned(dev: trio_cuda.Device) -> None:
    cu = _cu()
    from trio_cuda._staging import pool_of

    api.ones((16,)).to_host().sync()  # makes the device's staging set
    bufs = [b for pool in pool_of(dev)._free.values() for b in pool]
    assert bufs
    for b in bufs[:4]:
        err, _ = cu.cuMemHostGetFlags(b.ctypes.data)
        assert err == cu.CUresult.CUDA_SUCCESS, "not page-locked memory"


def test_events_have_timing_disabled(dev: trio_cuda.Device) -> None:
    cu = _cu()
    from trio_cuda import lowlevel

    s = dev.create_stream()
    api.ones((4,)).sync_on(s)
    a = lowlevel.record(s)
    api.ones((4,)).sync_on(s)
    b = lowlevel.record(s)
    s.synchronize()
    err, _ = cu.cuEventElapsedTime(a.handle, b.handle)
    assert err == cu.CUresult.CUDA_ERROR_INVALID_HANDLE


def test_kernels_are_cached_on_disk(tmp_path: os.PathLike[str]) -> None:
    # A child process compiles a kernel into an empty cache; a second child must load it
    # from the cache without calling numba's compiler.
    prog = textwrap.dedent(
        """
        import sys
        import numpy as np
        import trio_cuda
        from numba import cuda
        from trio_cuda import api
        if sys.argv[1] == "forbid":
            import numba.cuda
            def refuse(*a, **k):
                raise AssertionError("compiled again despite the disk cache")
            numba.cuda.compile_ptx = refuse
        @trio_cuda.kernel
        def triple(y, x):
            i = cuda.grid(1)
            if i < y.shape[0]:
                y[i] = 3 * x[i]
        out = triple(api.zeros((8,)).partition((8,)), api.arange(8)).first().to_host().sync()
        assert np.array_equal(out, 3 * np.arange(8)), out
        print("ok")
        """
    )
    script = os.path.join(str(tmp_path), "triple.py")
    with open(script, "w") as f:
        f.write(prog)
    env = dict(os.environ, TRIO_CUDA_CACHE_DIR=str(tmp_path / "cache"), TRIO_CUDA_QUIET="1")
    first = subprocess.run([sys.executable, script, "compile"], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    cached = sorted(p.suffix for p in (tmp_path / "cache").iterdir())
    assert cached == [".cubin", ".name"]
    second = subprocess.run([sys.executable, script, "forbid"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr


async def test_a_kernel_writing_an_input_tensor_is_refused_before_it_runs(dev: trio_cuda.Device) -> None:
    from numba import cuda

    @cuda.jit(device=True)
    def put(a, i):  # type: ignore[no-untyped-def]
        a[i] = 1.0  # a write behind a call: not seen before the build

    @trio_cuda.kernel
    def writes_input(out, x):  # type: ignore[no-untyped-def]
        i = cuda.grid(1)
        put(x, i)  # x is a tensor argument: read-only
        out[i] = 2.0

    x = await api.zeros((4,))
    launches = dev.statistics().launches
    with pytest.raises(trio_cuda.LaunchError, match="writes_input"):
        await writes_input(api.zeros((4,)).partition((4,)), x)
    assert dev.statistics().launches == launches and not dev.is_faulted
    np.testing.assert_array_equal(await x.to_host(), np.zeros(4))


def test_the_disk_cache_is_keyed_by_content(tmp_path: os.PathLike[str]) -> None:
    # Factory kernels share file, name and line but differ in a closure value; each
    # process must run its own kernel's code, cached or not.
    prog = textwrap.dedent(
        """
        import sys
        import numpy as np
        import trio_cuda
        from numba import cuda
        from trio_cuda import api
        def make(k):
            @trio_cuda.kernel
            def scale(y, x):
                i = cuda.grid(1)
                if i < y.shape[0]:
                    y[i] = k * x[i]
            return scale
        k = float(sys.argv[1])
        out = make(k)(api.zeros((8,)).partition((8,)), api.arange(8)).first().to_host().sync()
        assert np.array_equal(out, k * np.arange(8)), (k, out)
        print("ok")
        """
    )
    script = os.path.join(str(tmp_path), "scale.py")
    with open(script, "w") as f:
        f.write(prog)
    env = dict(os.environ, TRIO_CUDA_CACHE_DIR=str(tmp_path / "cache"), TRIO_CUDA_QUIET="1")
    for k in ("2", "3", "2"):
        r = subprocess.run([sys.executable, script, k], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 2
