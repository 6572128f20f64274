"""ops.scaled_dot_product_attention against a float64 numpy reference (causal, masks,
scale, strided inputs, out=, graph captures, concurrent tasks), its refusals of bad
input before any work, and on CUDA against torch's scaled_dot_product_attention.

The same tests run on both backends; float32 runs on the simulated device only (cuDNN
takes half types), and on CUDA the tolerances allow for cuDNN's rounding of the
probabilities to the inputs' dtype before their product with V.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import api, lowlevel, ops

from ..helpers.devices import ON_CUDA

RNG = np.random.default_rng(35)
BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [np.dtype(np.float16), BF16]
DTYPES = HALVES + ([] if ON_CUDA else [np.dtype(np.float32)])
TOL = {np.dtype(np.float16): 4e-3, BF16: 3e-2, np.dtype(np.float32): 1e-5}
sdpa = ops.scaled_dot_product_attention


def data(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.uniform(-1, 1, shape).astype(dtype)


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, causal: bool = False, scale: float | None = None
) -> np.ndarray:
    """Attention in float64, written out as the definition."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(np.float64)
    if causal:
        sq, sk = s.shape[-2:]
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v  # type: ignore[no-any-return]


def close(got: np.ndarray, want: np.ndarray, dtype: np.dtype[Any]) -> None:
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    tol = TOL[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


async def qkv(b: int, h: int, sq: int, sk: int, d: int, dtype: Any, dv: int | None = None) -> tuple[Any, ...]:
    hq, hk, hv = data(b, h, sq, d, dtype=dtype), data(b, h, sk, d, dtype=dtype), data(b, h, sk, dv or d, dtype=dtype)
    return hq, hk, hv, await api.from_host(hq), await api.from_host(hk), await api.from_host(hv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
async def test_matches_numpy(dtype: np.dtype[Any], causal: bool) -> None:
    # seq_q != seq_k: the causal mask is top-left aligned (query i sees keys j <= i)
    hq, hk, hv, q, k, v = await qkv(2, 3, 5, 9, 16, dtype)
    got = await sdpa(q, k, v, is_causal=causal).to_host()
    close(got, reference(hq, hk, hv, causal=causal), dtype)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
async def test_scale_and_a_head_dim_of_v_of_its_own(dtype: np.dtype[Any]) -> None:
    hq, hk, hv, q, k, v = await qkv(1, 2, 8, 8, 32, dtype, dv=16)
    got = await sdpa(q, k, v, scale=0.05).to_host()
    assert got.shape == (1, 2, 8, 16)
    close(got, reference(hq, hk, hv, scale=0.05), dtype)
    # a different scale is a different result (the scale reaches the kernel)
    other = await sdpa(q, k, v, scale=2.0).to_host()
    close(other, reference(hq, hk, hv, scale=2.0), dtype)
    assert not np.allclose(got.astype(np.float64), other.astype(np.float64), atol=TOL[dtype])


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("shape", [(7, 11), (2, 1, 7, 11), (1, 3, 1, 11), (2, 3, 7, 11)], ids=str)
async def test_boolean_masks_broadcast(dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    hq, hk, hv, q, k, v = await qkv(2, 3, 7, 11, 8, dtype)
    m = RNG.uniform(size=shape) < 0.6
    m[..., 0] = True  # every query attends to a key (a fully masked row is NaN)
    got = await sdpa(q, k, v, mask=await api.from_host(m)).to_host()
    want = reference(hq, hk, hv, np.broadcast_to(m, (2, 3, 7, 11)))
    close(got, want, dtype)
    # the mask changes the result
    assert not np.allclose(want, reference(hq, hk, hv), atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 6, 10), (2, 1, 6, 10), (6, 10), (10,)], ids=str)
async def test_additive_masks_broadcast(dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    hq, hk, hv, q, k, v = await qkv(2, 2, 6, 10, 16, dtype)
    m = (RNG.uniform(-3, 3, shape)).astype(dtype)
    got = await sdpa(q, k, v, mask=await api.from_host(m)).to_host()
    close(got, reference(hq, hk, hv, m), dtype)


async def test_strided_inputs_are_read_in_place_or_copied() -> None:
    # (batch, seq, heads, head_dim) seen heads-first, as a transformer's projections give them
    b, s, h, d = 2, 6, 4, 16
    host = [data(b, s, h, d, dtype=np.float16) for _ in range(3)]
    q, k, v = [(await api.from_host(x)).transpose(0, 2, 1, 3) for x in host]
    assert not q.is_contiguous
    want = reference(*(x.transpose(0, 2, 1, 3) for x in host), causal=True)
    close(await sdpa(q, k, v, is_causal=True).to_host(), want, np.dtype(np.float16))
    # a view the library cannot read (head_dim not contiguous) is copied first
    hk = data(b, h, d, s, dtype=np.float16)
    kt = (await api.from_host(hk)).transpose(0, 1, 3, 2)
    qq = await api.from_host(np.ascontiguousarray(host[0].transpose(0, 2, 1, 3)))
    vv = await api.from_host(np.ascontiguousarray(host[2].transpose(0, 2, 1, 3)))
    got = await sdpa(qq, kt, vv).to_host()
    close(
        got,
        reference(host[0].transpose(0, 2, 1, 3), hk.transpose(0, 1, 3, 2), host[2].transpose(0, 2, 1, 3)),
        np.dtype(np.float16),
    )


async def test_out_is_written_and_returned() -> None:
    hq, hk, hv, q, k, v = await qkv(1, 2, 4, 4, 8, BF16)
    o = await api.zeros((1, 2, 4, 8), dtype=BF16)
    got = await sdpa(q, k, v, out=o)
    assert got is o
    close(await o.to_host(), reference(hq, hk, hv), BF16)
    # out= of another float dtype: computed, then cast into it
    o32 = await api.zeros((1, 2, 4, 8), dtype=np.float32)
    await sdpa(q, k, v, out=o32)
    np.testing.assert_allclose(await o32.to_host(), reference(hq, hk, hv), rtol=3e-2, atol=3e-2)
    # out= aliasing q: the inputs are read before the output is written
    await sdpa(q, k, q, out=q)
    close(await q.to_host(), reference(hq, hk, hq), BF16)


async def test_repeated_calls_on_the_same_memory_are_ordered_after_writes_to_it() -> None:
    # from the second call on the same tensors the op is submitted directly (its recipe
    # prepared): it still waits for a copy into its input queued on another stream
    # behind longer work
    _, hk, hv, q, k, v = await qkv(1, 2, 32, 32, 16, np.float16)
    *_, bq, bk, bv = await qkv(2, 4, 384, 384, 64, np.float16)
    o = await api.empty((1, 2, 32, 16), dtype=np.float16)
    other = trio_cuda.current_device().create_stream()
    for _ in range(3):
        new = data(1, 2, 32, 16, dtype=np.float16)
        busy = await lowlevel.submit(sdpa(bq, bk, bv), other)
        copying = await lowlevel.submit(api.memcpy(q, new), other)
        await sdpa(q, k, v, out=o)
        close(await o.to_host(), reference(new, hk, hv), np.dtype(np.float16))
        await busy.wait()
        await copying.wait()


async def test_inputs_may_be_ops_and_tasks_run_it_concurrently() -> None:
    hq, hk, hv, q, k, v = await qkv(2, 2, 8, 8, 16, np.float16)
    want = reference(hq * 2, hk, hv, causal=True)
    results: dict[int, np.ndarray] = {}

    async def task(i: int) -> None:
        results[i] = await sdpa(ops.multiply(q, 2.0), k, v, is_causal=True).to_host()

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(task, i)
    assert sorted(results) == [0, 1, 2, 3]
    for r in results.values():
        close(r, want, np.dtype(np.float16))


async def test_captured_in_a_graph_and_replayed_on_new_inputs() -> None:
    hq, hk, hv, q, k, v = await qkv(1, 2, 16, 16, 16, np.float16)
    causal = np.where(np.tril(np.ones((16, 16), bool)), 0, -np.inf).astype(np.float16)
    m = await api.from_host(causal)  # additive, of q's dtype: the library reads it in place
    o = await api.empty((1, 2, 16, 16), dtype=np.float16)
    graph = sdpa(q, k, v, mask=m, out=o).graph()
    await graph.launch()
    close(await o.to_host(), reference(hq, hk, hv, causal=True), np.dtype(np.float16))
    new = data(1, 2, 16, 16, dtype=np.float16)
    graph.update(api.memcpy(q, new))
    await graph.launch()
    close(await o.to_host(), reference(new, hk, hv, causal=True), np.dtype(np.float16))
    # a boolean mask needs a bias allocated: refused inside a capture, saying so
    with pytest.raises(trio_cuda.GraphCaptureError, match="allocate tensors before capturing"):
        sdpa(q, k, v, mask=await api.from_host(causal == 0), out=o).graph()


async def test_empty_queries_give_an_empty_result() -> None:
    q = await api.zeros((2, 3, 0, 8), dtype=np.float16)
    k = await api.zeros((2, 3, 4, 8), dtype=np.float16)
    got = await sdpa(q, k, k).to_host()
    assert got.shape == (2, 3, 0, 8) and got.dtype == np.float16


def half(*shape: int) -> Any:
    return api.zeros(shape, dtype=np.float16).sync()


BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("3-D q", lambda: sdpa(half(2, 4, 8), half(1, 2, 4, 8), half(1, 2, 4, 8)), ValueError, "(2, 4, 8)"),
    ("heads differ", lambda: sdpa(half(1, 2, 4, 8), half(1, 1, 4, 8), half(1, 1, 4, 8)), ValueError, "grouped-query"),
    ("head_dim differs", lambda: sdpa(half(1, 2, 4, 8), half(1, 2, 4, 16), half(1, 2, 4, 8)), ValueError, "(1, 2, 4, 16)"),
    ("seq of k and v", lambda: sdpa(half(1, 2, 4, 8), half(1, 2, 4, 8), half(1, 2, 5, 8)), ValueError, "(1, 2, 5, 8)"),
    ("head_dim 12", lambda: sdpa(half(1, 1, 4, 12), half(1, 1, 4, 12), half(1, 1, 4, 12)), ValueError, "is 12"),
    ("head_dim 136", lambda: sdpa(half(1, 1, 2, 136), half(1, 1, 2, 136), half(1, 1, 2, 136)), ValueError, "is 136"),
    ("no keys", lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 0, 8), half(1, 1, 0, 8)), ValueError, "no keys"),
    ("a scalar q", lambda: sdpa(1.0, half(1, 1, 2, 8), half(1, 1, 2, 8)), TypeError, "q must be a tensor"),
    ("is_causal", lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 2, 8), half(1, 1, 2, 8), is_causal=1), TypeError, "is_causal"),
    ("scale nan", lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 2, 8), half(1, 1, 2, 8), scale=math.nan), ValueError, "nan"),
    ("scale str", lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 2, 8), half(1, 1, 2, 8), scale="0.1"), TypeError, "'0.1'"),
    (
        "mask and causal",
        lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 2, 8), half(1, 1, 2, 8), mask=half(2, 2), is_causal=True),
        ValueError,
        "not both",
    ),
    (
        "mask shape",
        lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 3, 8), half(1, 1, 3, 8), mask=half(2, 2)),
        ValueError,
        "(2, 2)",
    ),
    (
        "mask dtype",
        lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 2, 8), half(1, 1, 2, 8), mask=api.zeros((2, 2), dtype=np.int32).sync()),
        TypeError,
        "int32",
    ),
    (
        "dtypes differ",
        lambda: sdpa(half(1, 1, 2, 8), api.zeros((1, 1, 2, 8), dtype=BF16).sync(), half(1, 1, 2, 8)),
        TypeError,
        "bfloat16",
    ),
    (
        "float64",
        lambda: sdpa(*(api.zeros((1, 1, 2, 8), dtype=np.float64).sync() for _ in range(3))),
        TypeError,
        "float64",
    ),
    (
        "out shape",
        lambda: sdpa(half(1, 1, 2, 8), half(1, 1, 2, 8), half(1, 1, 2, 8), out=half(1, 1, 2, 16)),
        ValueError,
        "(1, 1, 2, 16)",
    ),
]


@pytest.mark.parametrize("make,error,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_refused_when_the_op_is_made(make: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info:
        make()
    assert words in str(info.value), str(info.value)


async def test_bad_input_of_an_op_is_refused_before_anything_runs() -> None:
    q = await api.zeros((1, 1, 2, 8), dtype=np.float16)
    o = await api.full((1, 1, 2, 8), 7.0, dtype=np.float16)
    # the inputs' shapes are known only when planned: the copy into o never runs either
    bad = trio_cuda.zip(ops.copy(q, out=o), sdpa(q, ops.copy(q).reshape(1, 2, 1, 8), q))
    with pytest.raises(ValueError, match="grouped-query"):
        await bad
    assert (await o.to_host() == 7).all()


@pytest.mark.skipif(not ON_CUDA, reason="float32 attention exists on the simulated device")
def test_float32_is_refused_on_cuda() -> None:
    x = api.zeros((1, 1, 2, 8), dtype=np.float32).sync()
    with pytest.raises(TypeError, match="float16, bfloat16"):
        sdpa(x, x, x)


def test_without_cudnn_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda._backends import _cudnn

    monkeypatch.setattr(_cudnn, "_cudnn", None)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install nvidia-cudnn-frontend"):
        _cudnn.load()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["plain", "causal", "bool mask", "additive mask"])
async def test_matches_torch(case: str) -> None:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    b, h, s, d = 2, 4, 256, 128
    tq, tk, tv = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (api.from_dlpack(t) for t in (tq, tk, tv))
    kw: dict[str, Any] = {}
    tkw: dict[str, Any] = {}
    if case == "causal":
        kw["is_causal"] = tkw["is_causal"] = True
    elif case == "bool mask":
        tm = torch.rand(b, 1, s, s, device="cuda") < 0.7
        tm[..., 0] = True
        tkw["attn_mask"] = tm
        kw["mask"] = api.from_dlpack(tm)
    elif case == "additive mask":
        tm = torch.randn(1, h, s, s, device="cuda", dtype=torch.bfloat16)
        tkw["attn_mask"] = tm
        kw["mask"] = api.from_dlpack(tm)
    torch.cuda.synchronize()
    got = await sdpa(q, k, v, **kw).to_host()
    want = F.scaled_dot_product_attention(tq, tk, tv, **tkw).float().cpu().numpy()
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)
