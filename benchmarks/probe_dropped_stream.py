"""Does new work wait behind a dropped stream's kernel? (the driver's behaviour, CUDA)

A stream with a 2 s kernel pending is dropped (trio-cuda used to destroy its driver
stream at once; it now keeps it until that work is done), then two streams are made and
a tiny independent op submitted on each; the probe busy-polls each op's event for up to
0.5 s and prints when it completed. ``--keep`` keeps the first stream alive instead.
Seen on an H200 (2026-11-30), with the immediate destruction: after a drop, the first
new stream's op ran only when the 2 s kernel ended, the second's at once; with
``--keep`` both ran at once, with completion words on and off. With the stream kept
until its work is done, both ran at once either way (H200, the next session).

    python benchmarks/probe_dropped_stream.py [--keep]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda.kernels import sleep


async def main(keep: bool) -> None:
    t0 = time.perf_counter()
    dev = trio_cuda.current_device()
    xs = [await api.zeros((8,)) for _ in range(3)]
    await ops.add(xs[0], 1.0, out=xs[0])  # loaded now (loading waits for running kernels)
    c = await api.zeros((1,), np.int32)
    await sleep(c.partition((1,)), 1000)  # loaded now
    s1 = dev.create_stream()
    pending = await lowlevel.submit(sleep(c.partition((1,)), 2_000_000_000), s1)
    ev = pending.event
    assert ev is not None
    del pending, c
    if not keep:
        del s1
    gc.collect()
    await ops.add(xs[0], 0.0, out=xs[0])  # a submission: the housekeeping destroys the dropped stream
    streams = [dev.create_stream() for _ in range(2)]
    for i, s2 in enumerate(streams):
        sub = await lowlevel.submit(ops.add(xs[i + 1], 1.0, out=xs[i + 1]), s2)
        e2 = sub.event
        assert e2 is not None
        start = time.perf_counter()
        while not e2.query() and time.perf_counter() - start < 0.5:
            pass
        print(
            f"{time.perf_counter() - t0:7.3f} s  new stream {i}: its op done={e2.query()} after "
            f"{1e3 * (time.perf_counter() - start):.1f} ms of polling; the 2 s kernel done={ev.query()}"
        )
        await sub.wait()
    await trio.to_thread.run_sync(dev.synchronize)
    print(f"{time.perf_counter() - t0:7.3f} s  synchronized")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the first stream alive")
    trio.run(main, ap.parse_args().keep)
