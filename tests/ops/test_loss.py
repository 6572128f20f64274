"""ops.cross_entropy and ops.cross_entropy_grad against numpy (PyTorch's definitions):
reductions, ignore_index, classes along the last axis, half types, out-of-range labels,
the gradient's capture without temporaries, bad input."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import trio_cuda  # before numba.cuda: it chooses the backend
from trio_cuda import api, ops

RNG = np.random.default_rng(350)
BF16 = np.dtype(ml_dtypes.bfloat16)


def ref(x: np.ndarray, labels: np.ndarray, ignore: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(per-row losses, whether each row counts, the gradient of the mean), in float64."""
    x = x.astype(np.float64).reshape(-1, x.shape[-1])
    lab = labels.reshape(-1).astype(np.int64)
    ok = lab != ignore if ignore is not None else np.ones(lab.shape, bool)
    mx = x.max(axis=1, keepdims=True)
    e = np.exp(x - mx)
    lse = (mx + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    safe = np.where(ok, lab, 0)
    rows = np.where(ok, lse - x[np.arange(len(lab)), safe], 0.0)
    g = e / e.sum(axis=1, keepdims=True)
    g[np.arange(len(lab)), safe] -= 1
    g = np.where(ok[:, None], g / ok.sum(), 0.0)
    return rows, ok, g


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12), (np.float16, 3e-3), (BF16, 2e-2)])
@pytest.mark.parametrize("ignore", [None, -100])
async def test_cross_entropy_and_its_gradient_follow_numpy(dtype: Any, tol: float, ignore: int | None) -> None:
    x = (RNG.standard_normal((9, 1500)) * 3).astype(dtype)  # a row past 1024 columns: the unrolled loops
    labels = RNG.integers(0, 1500, 9).astype(np.int32)
    if ignore is not None:
        labels[[1, 4]] = ignore
    rows, ok, grad = ref(x, labels, ignore)
    X, L = await api.from_host(x), await api.from_host(labels)
    mean = await ops.cross_entropy(X, L, ignore_index=ignore).to_host()
    assert mean.shape == () and mean.dtype == np.dtype(dtype)
    np.testing.assert_allclose(float(mean), rows[ok].mean(), rtol=tol)
    total = await ops.cross_entropy(X, L, ignore_index=ignore, reduction="sum").to_host()
    np.testing.assert_allclose(float(total), rows.sum(), rtol=tol)
    each = await ops.cross_entropy(X, L, ignore_index=ignore, reduction="none").to_host()
    assert each.shape == (9,) and each.dtype == np.dtype(dtype)
    np.testing.assert_allclose(each.astype(np.float64), rows, rtol=tol, atol=tol)
    g = await ops.cross_entropy_grad(X, L, ignore_index=ignore).to_host()
    assert g.shape == x.shape and g.dtype == np.dtype(dtype)
    np.testing.assert_allclose(g.astype(np.float64), grad, rtol=tol, atol=tol * np.abs(grad).max())
    if ignore is not None:
        assert (g[[1, 4]].astype(np.float64) == 0).all()
    gs = await ops.cross_entropy_grad(X, L, ignore_index=ignore, reduction="sum").to_host()
    np.testing.assert_allclose(gs.astype(np.float64), grad * ok.sum(), rtol=tol, atol=tol * np.abs(grad).max() * ok.sum())


async def test_classes_are_the_last_axis_of_batched_logits() -> None:
    x = RNG.standard_normal((2, 3, 7)).astype(np.float32)
    labels = RNG.integers(0, 7, (2, 3))
    rows, _, grad = ref(x, labels, None)
    X, L = await api.from_host(x), await api.from_host(labels)
    each = await ops.cross_entropy(X, L, reduction="none").to_host()
    np.testing.assert_allclose(each, rows.reshape(2, 3), rtol=1e-5)
    g = await ops.cross_entropy_grad(X, L).to_host()
    np.testing.assert_allclose(g, grad.reshape(x.shape), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(await ops.cross_entropy(X, L).item(), rows.mean(), rtol=1e-5)


async def test_a_label_out_of_range_makes_its_row_nan_and_all_ignored_is_nan() -> None:
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    X = await api.from_host(x)
    bad = await api.from_host(np.array([1, 5, 0]))
    each = await ops.cross_entropy(X, bad, reduction="none").to_host()
    assert np.isnan(each[1]) and np.isfinite(each[[0, 2]]).all()
    assert np.isnan(await ops.cross_entropy(X, bad).item())
    g = await ops.cross_entropy_grad(X, bad).to_host()
    assert np.isnan(g[1]).all() and np.isfinite(g[[0, 2]]).all()
    ignored = await api.from_host(np.array([-1, -1, -1]))
    assert np.isnan(await ops.cross_entropy(X, ignored, ignore_index=-1).item())  # 0 / 0, as PyTorch's
    assert await ops.cross_entropy(X, ignored, ignore_index=-1, reduction="sum").item() == 0


async def test_the_gradient_and_per_row_losses_capture_into_out() -> None:
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    labels = np.array([0, -100, 5, 2])
    X, L = await api.from_host(x), await api.from_host(labels)
    g, each, loss = await api.zeros((4, 6)), await api.zeros((4,)), await api.zeros(())
    step = ops.cross_entropy_grad(X, L, ignore_index=-100, out=g).then(
        lambda _: ops.sum(ops.cross_entropy(X, L, ignore_index=-100, reduction="none", out=each), out=loss)
    )
    graph = step.graph()
    await graph.launch()
    rows, _, grad = ref(x, labels, -100)
    np.testing.assert_allclose(await g.to_host(), grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(await loss.item(), rows.sum(), rtol=1e-5)
    with pytest.raises(trio_cuda.GraphCaptureError):
        ops.cross_entropy(X, L, out=loss).graph()  # the mean's temporary: allocation in a capture


async def test_a_capture_error_names_the_users_operands_not_a_temporary() -> None:
    """Inside a graph capture the reductions' scratch memory, and the contiguous copies
    of non-contiguous logits and labels, are refused naming the op, its reduction, the
    user's operands and what captures instead (also when the op's recipe was recorded
    by an earlier eager call)."""
    X = await api.from_host(RNG.standard_normal((4, 6)).astype(np.float32))
    L = await api.from_host(np.array([0, 3, 5, 2]))
    loss = await api.zeros(())
    for reduction in ("mean", "sum"):
        op = ops.cross_entropy(X, L, reduction=reduction, out=loss)
        await op  # records the op's recipe
        with pytest.raises(trio_cuda.GraphCaptureError) as info:
            ops.cross_entropy(X, L, reduction=reduction, out=loss).graph()
        msg = str(info.value)
        assert msg.startswith(f"ops.cross_entropy(reduction={reduction!r}) of logits (4, 6): its per-row losses"), msg
        assert "reduction='none' into an out= of shape (4,)" in msg, msg
    each = await api.zeros((4,))
    wide = await api.from_host(RNG.standard_normal((4, 12)).astype(np.float32))
    with pytest.raises(trio_cuda.GraphCaptureError, match=r"ops\.cross_entropy: a contiguous copy of the logits \(4, 6\)"):
        ops.cross_entropy(wide[:, ::2], L, reduction="none", out=each).graph()
    labels2 = await api.from_host(np.array([[0, 1], [3, 1], [5, 1], [2, 1]]))
    with pytest.raises(trio_cuda.GraphCaptureError, match=r"ops\.cross_entropy: a contiguous copy of the labels \(4,\)"):
        ops.cross_entropy(X, labels2[:, 0], reduction="none", out=each).graph()
    # the same calls with contiguous operands and reduction="none" capture
    graph = ops.cross_entropy(X, L, reduction="none", out=each).graph()
    await graph.launch()
    assert (await each.to_host() > 0).all()


async def test_bad_input_is_refused() -> None:
    X = await api.zeros((4, 6))
    L = await api.from_host(np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"need labels of shape \(4,\)"):
        ops.cross_entropy(X, await api.from_host(np.zeros(6, np.int64)))
    with pytest.raises(TypeError, match="labels must be integers, not float32"):
        ops.cross_entropy(X, await api.zeros((4,)))
    with pytest.raises(TypeError, match="logits must be floating"):
        ops.cross_entropy(await api.zeros((4, 6), np.int32), L)
    with pytest.raises(ValueError, match="reduction must be one of 'mean', 'sum'"):
        ops.cross_entropy_grad(X, L, reduction="none")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        ops.cross_entropy(X, L, ignore_index=1.5)
    with pytest.raises(ValueError, match="out= has shape"):
        ops.cross_entropy(X, L, out=await api.zeros((4,)))
