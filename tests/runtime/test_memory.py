"""Memory: the staging cap holds, and a submission's own memory never makes it fail
(regressions found by an adversarial review)."""

from __future__ import annotations

import pytest
import trio

import trio_cuda
from trio_cuda import api

from ..helpers.faults import child, child_ok


# -- memory ----------------------------------------------------------------------------------------
@pytest.mark.sim_only
def test_staging_cap_zero_keeps_no_idle_pinned_memory() -> None:
    # repro_staging_cap_zero_keeps_prefill: the prefill and freshly pinned buffers went
    # into the pool without the cap.
    r = child(
        """
        import numpy as np, trio_cuda
        from trio_cuda import api
        from trio_cuda._staging import pool_of
        dev = trio_cuda.device(0)
        for n in (1000, 1 << 20, 8 << 20):
            x = api.from_host(np.ones(n, np.float32)).sync()
            assert (x.to_host().sync() == 1).all()
        for _ in range(2):
            dev.synchronize()
            api.from_host(np.ones(10, np.float32)).sync()      # takes returned buffers back
        assert pool_of(dev).idle_bytes == 0, pool_of(dev).idle_bytes
        print("OK")
        """,
        TRIO_CUDA_STAGING_CAP_MB="0",
    )
    child_ok(r)


@pytest.mark.sim_only
def test_memory_freed_earlier_on_a_stream_serves_its_later_allocations() -> None:
    # repro_unallocate_then_spurious_oom: a copy that waited for memory and then for
    # pinned memory gave its allocation back behind newer work on its stream; the
    # simulated device kept that block reserved until the stream reached the free
    # (CUDA's stream-ordered allocator lets later work of the stream reuse it), and the
    # retry failed with DeviceOutOfMemory. Now the simulated device does what CUDA does.
    r = child(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api, lowlevel
        from trio_cuda.kernels import sleep
        dev = trio_cuda.device(0)
        async def main():
            dev.policy = lowlevel.SingleStream(dev)
            c = await api.zeros((1,), np.int32)
            h = await api.zeros((5 << 20,), np.int32)                   # 20 of 32 MiB
            await lowlevel.submit(sleep(c.partition((1,)), 400_000_000))
            await lowlevel.submit(api.memcpy(h, h))
            del h                                                       # freed behind the sleep
            y = await api.from_host(np.ones(4 << 20, np.float32))        # 16 MiB, same stream
            assert lowlevel.submission_statistics().waited_for_memory == 0
            assert (await y.to_host() == 1).all()
            h = await api.zeros((1 << 20,), np.int32)
            await lowlevel.submit(sleep(c.partition((1,)), 300_000_000))
            await lowlevel.submit(api.memcpy(h, h))
            del y, h
            z = await api.zeros((5 << 20,), np.int32).schedule(lowlevel.SingleStream(dev))
            assert lowlevel.submission_statistics().waited_for_memory == 1
            assert z.shape == (5 << 20,)
            print("OK")
        trio.run(main)
        """,
        TRIO_CUDA_SIM_MEMORY=str(32 << 20),
        TRIO_CUDA_STAGING_CAP_MB="0",
    )
    child_ok(r)


async def test_two_read_backs_of_one_staging_size_in_one_submission_do_not_hang() -> None:
    """One idle staging buffer of a size, two slots of it in one submission: the plan
    gives the taken one back and asks for both; asking only about the missing one made
    it count the returned buffer twice and retry forever."""
    c = await api.ones((3000,))  # 12000 bytes: a 16 KiB staging bucket, not prefilled
    await c.to_host()  # one such buffer pinned, now idle
    with trio.fail_after(20):
        a, b = await trio_cuda.zip(c.to_host(), c.to_host())
    assert a.sum() == 3000 and b.sum() == 3000
