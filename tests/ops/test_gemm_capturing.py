"""GEMMs are told by the runtime whether their stream records a graph
(``_gemm_step`` -> ``driver.matmul(..., capturing)``), and ``GemmDesc`` caches its hash.

The promises: ``capturing`` is True exactly when the stream records a graph (None on
another library's stream); equal descs hash equal (regressions found by an adversarial review)."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import trio_cuda
from trio_cuda import api, lowlevel, ops
from trio_cuda._backends._boundary import GemmDesc, GemmOperand

from ..helpers.data import f32
from ..helpers.devices import needs_devices


# ======================================================================================
# helpers
# ======================================================================================
def spy_matmul(monkeypatch: pytest.MonkeyPatch, dev: trio_cuda.Device) -> list[tuple[bool | None, bool]]:
    """Record (capturing as the runtime says, whether the simulated stream captures)."""
    calls: list[tuple[bool | None, bool]] = []
    drv = dev._driver
    orig = drv.matmul

    def matmul(
        desc: Any,
        a: int,
        b: int,
        d: int,
        bias: int,
        stream: Any,
        capturing: bool | None = None,
        foreign: bool = False,
        reuse: bool = False,
    ) -> None:
        calls.append((capturing, stream.capture is not None))
        orig(desc, a, b, d, bias, stream, capturing, foreign, reuse)

    monkeypatch.setattr(drv, "matmul", matmul)
    return calls


def assert_truthful(calls: list[tuple[bool | None, bool]], n: int) -> None:
    assert len(calls) >= n, calls
    for said, truth in calls:
        assert said is not None, "a stream of trio-cuda's own: the runtime knows whether it captures"
        assert said == truth, f"the backend was told capturing={said} on a stream that captures={truth}"


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ======================================================================================
# 1. GEMMs: capturing, GemmDesc's hash
# ======================================================================================
@pytest.mark.sim_only
async def test_gemms_outside_any_capture_are_told_not_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    calls = spy_matmul(monkeypatch, dev)
    hx, hw, hb = f32(8, 16), f32(12, 16), f32(12)
    x, w, b = await api.from_host(hx), await api.from_host(hw), await api.from_host(hb)
    for _ in range(3):  # the first builds, the others replay the cached recipe
        close(await ops.matmul(x, w.T).to_host(), hx @ hw.T)
        close(await ops.linear(x, w, b, activation="relu").to_host(), np.maximum(hx @ hw.T + hb, 0))
    # forked lanes: zip puts the branches on other streams of the policy
    o1, o2 = await api.zeros((8, 12)), await api.zeros((8, 12))
    await trio_cuda.zip(ops.matmul(x, w.T, out=o1), ops.linear(x, w, b, out=o2))
    close(await o1.to_host(), hx @ hw.T)
    close(await o2.to_host(), hx @ hw.T + hb)
    assert_truthful(calls, 8)
    assert all(said is False for said, _ in calls)


@pytest.mark.sim_only
async def test_gemms_in_graph_captures_forks_and_scopes_are_told_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = trio_cuda.current_device()
    hx, hw, hb = f32(8, 16), f32(12, 16), f32(12)
    x, w, b = await api.from_host(hx), await api.from_host(hw), await api.from_host(hb)
    o1, o2, o3 = await api.zeros((8, 12)), await api.zeros((8, 12)), await api.zeros((8, 12))
    # cached outside first: the capture replays the recipe
    await ops.matmul(x, w.T, out=o1)
    await ops.linear(x, w, b, out=o2)
    calls = spy_matmul(monkeypatch, dev)
    g1 = ops.matmul(x, w.T, out=o1).graph()
    g2 = trio_cuda.zip(ops.matmul(x, w.T, out=o1), ops.linear(x, w, b, out=o2), ops.linear(x, w, out=o3)).graph()
    with trio_cuda.capture_graph() as scope:
        scope.record(ops.linear(x, w, b, activation="gelu", out=o3))
        scope.record(trio_cuda.zip(ops.matmul(x, w.T, out=o1), ops.linear(x, w, b, out=o2)))
    assert_truthful(calls, 7)
    assert all(said is True for said, _ in calls)
    # after the captures, the same ops outside are told "not capturing" again
    calls.clear()
    await ops.matmul(x, w.T, out=o1)
    await trio_cuda.zip(ops.linear(x, w, b, out=o2), ops.linear(x, w, out=o3))
    assert_truthful(calls, 3)
    assert all(said is False for said, _ in calls)
    for g in (g1, g2, scope.graph):
        assert g is not None
        await g.launch()
    close(await o1.to_host(), hx @ hw.T)
    close(await o2.to_host(), hx @ hw.T + hb)


@pytest.mark.sim_only
@needs_devices(2)
async def test_gemm_on_another_device_while_a_scope_captures_is_not_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    d0, d1 = trio_cuda.device(0), trio_cuda.device(1)
    hx, hw = f32(8, 16), f32(16, 4)
    x0, w0, o0 = await api.from_host(hx), await api.from_host(hw), await api.zeros((8, 4))
    with trio_cuda.use_device(1):
        x1, w1 = await api.from_host(hx), await api.from_host(hw)
    calls0, calls1 = spy_matmul(monkeypatch, d0), spy_matmul(monkeypatch, d1)
    with trio_cuda.capture_graph() as scope:
        scope.record(ops.matmul(x0, w0, out=o0))
        # the scope is open on device 0: GEMMs on device 1 (also from device 0's
        # context, on a forked lane of device 1) run now and are not captured
        close(await ops.matmul(x1, w1).to_host(), hx @ hw)
        with trio_cuda.use_device(1):
            close(await ops.matmul(x1, w1).to_host(), hx @ hw)
        with pytest.raises(trio_cuda.GraphCaptureError):
            scope.record(ops.matmul(x1, w1))  # one device per graph
    assert_truthful(calls0, 1)
    assert_truthful(calls1, 2)
    assert [s for s, _ in calls1] == [False, False]
    assert scope.graph is not None
    await scope.graph.launch()
    close(await o0.to_host(), hx @ hw)


@pytest.mark.sim_only
async def test_gemm_on_another_librarys_stream_lets_the_backend_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulated device has no external streams: a stream of ours marked foreign
    # stands in for one (the runtime must not claim to know whether it captures).
    dev = trio_cuda.current_device()
    s = dev.create_stream()
    s._foreign = True
    monkeypatch.setattr(dev, "_foreign_streams", True)  # as lowlevel.external_stream sets it
    hx, hw = f32(8, 16), f32(16, 4)
    x, w, o = await api.from_host(hx), await api.from_host(hw), await api.zeros((8, 4))
    calls = spy_matmul(monkeypatch, dev)
    for _ in range(2):
        await (await lowlevel.submit(ops.matmul(x, w, out=o), s)).wait()
    assert [said for said, _ in calls] == [None, None]
    # and once another library's stream exists, ours are asked about too: one of ours
    # that waited for work of a stream that library captures joins its capture
    calls.clear()
    await ops.matmul(x, w, out=o)
    assert [said for said, _ in calls] == [None]
    close(await o.to_host(), hx @ hw)
    s._foreign = False  # destroyed like ours at the end


def _desc(**kw: Any) -> GemmDesc:
    base: dict[str, Any] = {
        "m": 8,
        "n": 4,
        "k": 16,
        "batch": 1,
        "a": GemmOperand(8, 16, 16, False, 0),
        "b": GemmOperand(16, 4, 4, False, 0),
        "dtype": "float32",
    }
    base.update(kw)
    return GemmDesc(**base)


def test_gemm_desc_hash_is_consistent_with_equality_through_replace_and_copies() -> None:
    d = _desc()
    h = hash(d)
    assert hash(d) == h  # cached
    fresh = _desc()
    assert fresh == d and hash(fresh) == h
    # replace: a new desc; its hash follows its fields, not the cached one of the original
    r = dataclasses.replace(d, align=16)
    assert r != d and "_hash" not in r.__dict__
    assert hash(r) == hash(_desc(align=16))
    assert dataclasses.replace(r, align=256) == d and hash(dataclasses.replace(r, align=256)) == h
    # the cached hash is no field: equality, repr, astuple and fields ignore it
    assert "_hash" not in repr(d)
    assert dataclasses.astuple(d) == dataclasses.astuple(fresh)
    assert [f.name for f in dataclasses.fields(d)][-1] == "align"
    for c in (copy.copy(d), copy.deepcopy(d), pickle.loads(pickle.dumps(d))):
        assert c == d and hash(c) == h
    # a dict keyed by descs finds equal ones, whichever was hashed first
    table = {d: 1}
    assert table[_desc()] == 1 and table[pickle.loads(pickle.dumps(fresh))] == 1
    # equal values of other types (bool/int) hash alike, as the dataclass compares them
    assert _desc(has_bias=1) == _desc(has_bias=True) and hash(_desc(has_bias=1)) == hash(_desc(has_bias=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.m = 3  # type: ignore[misc]


def test_gemm_desc_unpickled_in_another_process_hashes_like_an_equal_fresh_one() -> None:
    # A desc's hash covers its dtype and activation names (strings, hashed with the
    # process's seed): a cached hash pickled along with the fields is stale elsewhere.
    code = textwrap.dedent(
        """
        import pickle, sys
        from trio_cuda._backends._boundary import GemmDesc, GemmOperand
        def make():
            return GemmDesc(8, 4, 16, 1, GemmOperand(8, 16, 16, False, 0), GemmOperand(16, 4, 4, False, 0), "float32")
        if sys.argv[1] == "dump":
            d = make()
            hash(d)
            sys.stdout.write(pickle.dumps(d).hex())
        else:
            d = pickle.loads(bytes.fromhex(sys.stdin.read()))
            f = make()
            print(d == f, hash(d) == hash(f), f in {d})
        """
    )

    def run(arg: str, seed: str, stdin: str = "") -> str:
        env = dict(os.environ, PYTHONHASHSEED=seed, TRIO_CUDA_QUIET="1")
        r = subprocess.run([sys.executable, "-c", code, arg], input=stdin, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    out = run("load", "2", run("dump", "1"))
    assert out == "True True True", f"equal descs (==, hash ==, found in a set): {out}"
