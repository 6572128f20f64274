"""ops.dropout: the mask is ops.uniform's numbers under the same seed and offset, kept
elements are scaled by 1 / (1 - p); seed and offset may be 0-d tensors (a captured step
draws a new mask when they change); bad input refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, ops

RNG = np.random.default_rng(3535)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ml_dtypes.bfloat16])
async def test_dropout_keeps_where_the_uniforms_reach_p(dtype: type) -> None:
    a = RNG.standard_normal((30, 70)).astype(dtype)
    x = await api.from_host(a)
    got = await ops.dropout(x, 0.3, seed=11, offset=5).to_host()
    u = await ops.uniform((30, 70), seed=11, offset=5).to_host()
    keep = u >= np.float32(0.3)
    want = np.where(keep, a.astype(np.float32) * np.float32(1 / 0.7), 0).astype(dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
    assert 0.6 < keep.mean() < 0.8


async def test_the_backward_is_dropout_with_the_same_seed() -> None:
    a = RNG.standard_normal(500).astype(np.float32)
    g = RNG.standard_normal(500).astype(np.float32)
    y = await ops.dropout(await api.from_host(a), 0.5, seed=2).to_host()
    dg = await ops.dropout(await api.from_host(g), 0.5, seed=2).to_host()
    np.testing.assert_array_equal(dg != 0, y != 0)
    np.testing.assert_array_equal(dg[dg != 0], g[dg != 0] * 2)


async def test_p_zero_is_the_identity_and_p_one_zeroes() -> None:
    a = RNG.standard_normal(64).astype(np.float32)
    x = await api.from_host(a)
    np.testing.assert_array_equal(await ops.dropout(x, 0.0, seed=1).to_host(), a)
    assert (await ops.dropout(x, 1.0, seed=1).to_host() == 0).all()


async def test_a_captured_dropout_reads_its_seed_tensor_at_each_replay() -> None:
    a = np.ones(256, np.float32)
    x, y = await api.from_host(a), await api.zeros(256)
    seed = await api.from_host(np.array(7, np.uint64))
    graph = ops.dropout(x, 0.5, seed, out=y).graph()
    await graph.launch()
    first = await y.to_host()
    u7 = await ops.uniform((256,), seed=7).to_host()
    np.testing.assert_array_equal(first, np.where(u7 >= 0.5, 2.0, 0.0).astype(np.float32))
    await api.memcpy(seed, np.array(8, np.uint64))
    await graph.launch()
    u8 = await ops.uniform((256,), seed=8).to_host()
    np.testing.assert_array_equal(await y.to_host(), np.where(u8 >= 0.5, 2.0, 0.0).astype(np.float32))


async def test_bad_input_is_refused() -> None:
    x = await api.zeros((4,))
    with pytest.raises(ValueError, match=r"p must be a probability in \[0, 1\], not 1.5"):
        ops.dropout(x, 1.5, seed=1)
    with pytest.raises(ValueError, match="seed must be an int in"):
        ops.dropout(x, 0.1, seed=-1)
    with pytest.raises(TypeError, match="seed must be an int or a one-element integer tensor"):
        ops.dropout(x, 0.1, seed=await api.zeros(()))
    with pytest.raises(TypeError, match="needs a floating tensor"):
        ops.dropout(await api.zeros((4,), np.int32), 0.1, seed=1)
    assert isinstance(trio_cuda.ops.dropout(x, 0.1, seed=1), trio_cuda.DeviceOp)
