"""Static typing checks (mypy, in CI): the combinators keep their output types.

Not a test module: it is type-checked, never run (its functions only build ops).
"""

from __future__ import annotations

from typing import Any, assert_type

import numpy as np
import trio

import trio_cuda
from trio_cuda import api, ops


@trio_cuda.kernel
def add(z: Any, x: Any, y: Any) -> None:
    z[0] = x[0] + y[0]


def _dup(v: trio_cuda.Tensor) -> trio_cuda.TensorValuedOp[trio_cuda.Tensor]:
    return api.dup(v)


def combinators_keep_types(x: trio_cuda.Tensor) -> None:
    t = api.zeros((4,))
    assert_type(t, trio_cuda.TensorValuedOp[trio_cuda.Tensor])
    assert_type(t.then(_dup), trio_cuda.TensorValuedOp[trio_cuda.Tensor])
    # (a lambda returning a subclass of DeviceOp is inferred as TensorValuedOp[Any] by mypy)
    assert_type(t.then(lambda v: trio_cuda.zip(api.dup(v))), trio_cuda.TensorValuedOp[tuple[trio_cuda.Tensor]])
    assert_type(t.then(lambda v: v.shape), trio_cuda.TensorValuedOp[tuple[int, ...]])
    assert_type(t.map(lambda v: v.ndim), trio_cuda.TensorValuedOp[int])
    assert_type(t.partition((2,)), trio_cuda.TensorValuedOp[trio_cuda.Partition])
    assert_type(t.partition((2,)).unpartition(), trio_cuda.TensorValuedOp[trio_cuda.Tensor])
    assert_type(t.reshape(2, 2), trio_cuda.TensorValuedOp[trio_cuda.Tensor])
    assert_type(t.to_host(), trio_cuda.DeviceOp[np.ndarray])
    assert_type(t.shared(), trio_cuda.SharedTensorOp[trio_cuda.Tensor])
    z = trio_cuda.zip(t, api.ones((2,)).to_host(), trio_cuda.value(3))
    assert_type(z, trio_cuda.DeviceOp[tuple[trio_cuda.Tensor, np.ndarray, int]])
    assert_type(z.shared(), trio_cuda.SharedOp[tuple[trio_cuda.Tensor, np.ndarray, int]])
    assert_type(z.first(), trio_cuda.TensorValuedOp[trio_cuda.Tensor])
    assert_type(z.last(), trio_cuda.TensorValuedOp[int])
    assert_type(z.first().to_host(), trio_cuda.DeviceOp[np.ndarray])
    launch = add(t.partition((2,)), x, x)
    assert_type(launch, trio_cuda.DeviceOp[tuple[Any, ...]])
    assert_type(x.to_host(), trio_cuda.DeviceOp[np.ndarray])
    assert_type(x.partition((2,)), trio_cuda.Partition)


def indexing_is_a_view_or_a_gather(x: trio_cuda.Tensor, idx: trio_cuda.Tensor) -> None:
    assert_type(x[0], trio_cuda.Tensor)
    assert_type(x[np.int64(1), 1:3, ..., None], trio_cuda.Tensor)
    assert_type(x[idx], trio_cuda.TensorValuedOp[trio_cuda.Tensor])
    assert_type(x[:, idx], trio_cuda.TensorValuedOp[trio_cuda.Tensor])
    assert_type(x[idx + 1], trio_cuda.TensorValuedOp[trio_cuda.Tensor])


async def awaiting_gives_the_output_type() -> None:
    t = await api.ones((2,))
    assert_type(t, trio_cuda.Tensor)
    host = await t.to_host()
    assert_type(host, np.ndarray)
    a, b = await trio_cuda.zip(api.ones((1,)), trio_cuda.value("x"))
    assert_type(a, trio_cuda.Tensor)
    assert_type(b, str)


def an_op_is_not_an_async_function(nursery: trio.Nursery) -> None:
    # DeviceOp.__call__ exists only to raise a helpful TypeError: a type checker must
    # still refuse an op where trio expects an async function (the ignore must be used).
    nursery.start_soon(api.zeros((4,)))  # type: ignore[arg-type]


def only_tensor_valued_ops_have_tensor_methods(t: trio_cuda.Tensor) -> None:
    # (each ignore is needed: mypy --warn-unused-ignores fails the check if one is not)
    trio_cuda.value(3).softmax()  # type: ignore[attr-defined]
    trio_cuda.zip(api.zeros((2,))).relu()  # type: ignore[attr-defined]
    ops.topk(t, 2) + 1  # type: ignore[operator]
    assert_type(ops.relu(t).softmax(), trio_cuda.TensorValuedOp[Any])
