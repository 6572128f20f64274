"""What numpy and PyTorch habits do with a tensor: item() as an op; float()/int(),
pickling, in-place operators and item assignment refused with the way to do it (never
a silent no-op); from_host taking what np.asarray takes."""

from __future__ import annotations

import copy
import pickle
import re

import numpy as np
import pytest

import trio_cuda
from trio_cuda import api, ops


def test_item_of_a_tensor_and_of_an_op() -> None:
    t = api.from_host(np.array([[2.5]], np.float32)).sync()
    got = t.item().sync()
    assert got == 2.5 and type(got) is float
    loss = ops.mean(t * 4)
    assert loss.item().sync() == 10.0
    n = ops.argmax(api.from_host(np.array([1, 9, 3], np.int32)))
    got_n = n.item().sync()
    assert got_n == 1 and type(got_n) is int


def test_item_refuses_more_than_one_element() -> None:
    t = api.from_host(np.arange(3, dtype=np.float32)).sync()
    with pytest.raises(ValueError, match=r"item\(\): the tensor has 3 elements"):
        t.item()  # a tensor's shape is known: refused before any work
    with pytest.raises(ValueError, match=r"item\(\): the tensor has 3 elements"):
        (t + 1).item().sync()  # an op's shape is known once planned


@pytest.mark.parametrize("conv", [float, int])
def test_float_and_int_name_item(conv: type) -> None:
    t = api.from_host(np.array([1.0], np.float32)).sync()
    for thing in (t, t + 1):
        with pytest.raises(TypeError, match=r"await t\.item\(\)"):
            conv(thing)


def test_a_tensor_does_not_pickle_and_says_how_to_save_it() -> None:
    t = api.from_host(np.ones(4, np.float32)).sync()
    with pytest.raises(TypeError, match=r"to_host\(\)"):
        pickle.dumps(t)
    with pytest.raises(TypeError, match="device memory"):
        copy.copy(t)
    # its data does
    assert pickle.loads(pickle.dumps(t.to_host().sync())).tolist() == [1.0] * 4


def test_from_host_takes_what_asarray_takes() -> None:
    assert api.from_host([1.0, 2.0]).to_host().sync().tolist() == [1.0, 2.0]
    assert api.from_host([1.0, 2.0]).sync().dtype == np.float64  # numpy's dtypes
    assert api.from_host([[1, 2], [3, 4]]).to_host().sync().tolist() == [[1, 2], [3, 4]]
    assert api.from_host(3.5).to_host().sync().shape == ()
    assert api.from_host((True, False)).sync().dtype == np.bool_
    src = [1, 2, 3]
    op = api.from_host(src)
    src[0] = 100  # converted when the op is made
    assert op.to_host().sync().tolist() == [1, 2, 3]


def test_from_host_refuses_device_data_and_odd_objects() -> None:
    t = api.from_host(np.ones(2, np.float32)).sync()
    for thing in (t, t + 1, t.partition((1,))):
        with pytest.raises(TypeError, match="takes host data"):
            api.from_host(thing)
    with pytest.raises(TypeError):
        api.from_host([t])  # a list holding a device tensor
    with pytest.raises(TypeError):
        api.from_host([[1, 2], [3]])  # ragged
    with pytest.raises(TypeError):
        api.from_host(["a", "b"])
    with pytest.raises(TypeError):
        api.from_host(object())
    assert isinstance(t, trio_cuda.Tensor)


IN_PLACE = [("+=", "add"), ("-=", "subtract"), ("*=", "multiply"), ("/=", "divide"), ("**=", "power")]
IN_PLACE += [("&=", "bitwise_and"), ("|=", "bitwise_or"), ("^=", "bitwise_xor")]


@pytest.mark.parametrize(("oper", "name"), IN_PLACE)
def test_in_place_operators_on_a_tensor_refuse_and_name_the_op(oper: str, name: str) -> None:
    t = api.from_host(np.full(3, 3, np.int32 if name.startswith("bitwise") else np.float32)).sync()
    scope = {"t": t}
    with pytest.raises(TypeError, match=rf"ops\.{name}\(t, v, out=t\).*t = t {re.escape(oper[:-1])} v"):
        exec(f"t {oper} 2", scope)
    assert scope["t"] is t  # not rebound
    # the named way works: the tensor itself is written
    getattr(ops, name)(t, 2, out=t).sync()
    want = {"add": 5, "subtract": 1, "multiply": 6, "divide": 1.5, "power": 9, "bitwise_and": 2, "bitwise_or": 3}
    assert t.to_host().sync().tolist() == [want.get(name, 1)] * 3


def test_in_place_matmul_refuses() -> None:
    t = api.from_host(np.eye(2, dtype=np.float32)).sync()
    with pytest.raises(TypeError, match=r"ops\.matmul\(t, v, out=t\)"):
        t @= t


def test_an_op_in_place_operator_stays_lazy() -> None:
    t = api.from_host(np.ones(2, np.float32)).sync()
    op = t + 1
    op += 1  # an op is a description: rebinding to a longer one is what it means
    assert op.to_host().sync().tolist() == [3.0, 3.0]
    assert t.to_host().sync().tolist() == [1.0, 1.0]


def test_item_assignment_refuses_and_both_named_ways_work() -> None:
    t = api.from_host(np.zeros(4, np.float32)).sync()
    with pytest.raises(TypeError, match=r"ops\.copy\(v, out=t\[key\]\)"):
        t[1:3] = 5.0
    v = api.from_host(np.array([7.0, 8.0], np.float32)).sync()
    ops.copy(v, out=t[1:3]).sync()
    ops.copy(ops.full_like(t[3:], 9.0), out=t[3:]).sync()
    assert t.to_host().sync().tolist() == [0.0, 7.0, 8.0, 9.0]
