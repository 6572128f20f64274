"""Bad input gets a clear builtin error before any GPU work."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import add

from ..helpers.devices import snapshot
from ..helpers.faults import child


def test_full_follows_numpys_fill_rules(dev: trio_cuda.Device) -> None:
    before = snapshot(dev)
    with pytest.raises(TypeError, match="None"):
        api.full((3,), None)
    with pytest.raises(ValueError, match="broadcast"):
        api.full((6,), [1, 2])
    with pytest.raises(ValueError, match="broadcast"):
        api.full((3,), [1, 2])
    with pytest.raises(ValueError, match="broadcast"):
        api.full((2, 3), np.ones((2, 3, 1)))
    with pytest.raises(ValueError, match="out of range"):
        api.full((2,), 300, np.int8)
    with pytest.raises(ValueError, match="cannot fill"):
        api.full((2,), 1 + 2j, np.float32)
    with pytest.raises(ValueError, match="cannot fill"):
        api.full((2,), float("nan"), np.int32)
    with pytest.raises(ValueError, match="cannot fill"):
        api.full((2,), "x")
    with pytest.raises(TypeError, match="memcpy"):
        api.full((2,), api.ones((2,)))
    assert snapshot(dev) == before
    # What numpy accepts works: a row that broadcasts, numpy scalars, unsafe casts.
    np.testing.assert_array_equal(api.full((3, 2), [1, 2]).to_host().sync(), np.full((3, 2), [1, 2], np.float32))
    np.testing.assert_array_equal(api.full((2, 2), np.array([[5], [6]]), np.int64).to_host().sync(), [[5, 5], [6, 6]])
    np.testing.assert_array_equal(api.full((3,), np.float16(1.5), np.float32).to_host().sync(), [1.5] * 3)
    np.testing.assert_array_equal(api.full((3,), 2.7, np.int32).to_host().sync(), np.full(3, 2.7).astype(np.int32))


def test_sizes_and_shapes(dev: trio_cuda.Device) -> None:
    before = snapshot(dev)
    with pytest.raises(ValueError, match="can address"):
        api.zeros((3, 2**62), np.int8)
    with pytest.raises(ValueError, match="can address"):
        api.empty((2**30, 2**30))
    with pytest.raises(TypeError, match="ints"):
        api.zeros((2, 2.0))
    with pytest.raises(TypeError, match="ints"):
        api.zeros((True, 2))
    with pytest.raises(ValueError, match="negative"):
        api.ones((-1,))
    with pytest.raises(TypeError, match="dtype"):
        api.zeros((2,), None)
    with pytest.raises(ValueError, match="finite"):
        api.arange(0, float("inf"))
    with pytest.raises(TypeError, match="real number"):
        api.arange(1j)
    assert snapshot(dev) == before
    # numpy integers are shapes, ordinals and steps too.
    t = api.arange(np.int64(0), np.int32(6), np.int16(2), device=np.int64(0)).sync()
    np.testing.assert_array_equal(t.to_host().sync(), [0, 2, 4])
    assert api.zeros((np.int64(2), np.uint8(3))).sync().shape == (2, 3)


@pytest.mark.parametrize(
    "name,value",
    [
        ("TRIO_CUDA_SIM_DEVICES", "two"),
        ("TRIO_CUDA_SIM_DEVICES", "0"),
        ("TRIO_CUDA_SIM_MEMORY", "lots"),
        ("TRIO_CUDA_BACKEND", "opencl"),
        ("TRIO_CUDA_QUIET", "maybe"),
        ("TRIO_CUDA_STAGING_CAP_MB", "-5"),
        ("TRIO_CUDA_REQUIRE_COMPILED", "sure"),
    ],
)
def test_bad_environment_variables_name_the_variable(name: str, value: str) -> None:
    code = "import trio_cuda; from trio_cuda import api; print(api.ones((2,)).to_host().sync())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_CUDA_")}
    env.update({"TRIO_CUDA_BACKEND": "sim", name: value})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stdout
    assert name in r.stderr and "ValueError" in r.stderr


async def test_tensors_refuse_host_conversion_with_a_pointer_to_to_host() -> None:
    t = await api.ones((3,))
    with pytest.raises(TypeError, match="to_host"):
        np.asarray(t)
    with pytest.raises(TypeError, match="to_host"):
        bool(await api.ones(()))
    assert "shape=(3,)" in repr(t) and "float32" in repr(t) and "device=0" in repr(t)


def _foreign(module: str, name: str, protocol: str) -> object:
    """An array of another library as trio-cuda sees it: a type of that library's module
    with one of the array protocols (their methods are never called here)."""

    def never(*args: object, **kwargs: object) -> object:
        raise AssertionError("a refused argument was used")

    attrs: dict[str, object] = {"__module__": module}
    if protocol == "dlpack":
        attrs.update(__dlpack__=never, __dlpack_device__=never)
    else:
        attrs["__cuda_array_interface__"] = property(never)
    return type(name, (), attrs)()


FOREIGN = [("torch", "Tensor", "dlpack", "torch.Tensor"), ("cupy._core.core", "ndarray", "cai", "cupy.ndarray")]


@pytest.mark.parametrize(("module", "name", "protocol", "shown"), FOREIGN)
async def test_another_librarys_array_is_named_with_the_call_that_adopts_it(
    dev: trio_cuda.Device, module: str, name: str, protocol: str, shown: str
) -> None:
    from trio_cuda import ops

    x = await api.ones((4,))
    y = await api.zeros((4,))
    before = snapshot(dev)
    foreign = _foreign(module, name, protocol)
    hint = rf"{shown} \(another library's array: api\.asarray\(x\), or api\.from_dlpack\(x\), makes it a tensor"
    makers = [
        lambda: add(y.partition((4,)), foreign, x),  # a kernel launch
        lambda: ops.add(x, foreign),
        lambda: ops.matmul(x.reshape(2, 2), x.reshape(2, 2), out=foreign),
        lambda: ops.sum(foreign),
        lambda: ops.concatenate([x, foreign]),
        lambda: api.memcpy(y, foreign),
        lambda: api.memcpy(foreign, x),
        lambda: api.from_host(foreign),
        lambda: api.dup(foreign),
    ]
    for make in makers:
        with pytest.raises(TypeError, match=hint):
            make()
    # an op whose output is one, found when the submission is planned
    with pytest.raises(TypeError, match=hint):
        await add(y.partition((4,)), trio_cuda.value(foreign), x)
    with pytest.raises(TypeError, match=hint):
        await ops.add(x, trio_cuda.value(foreign))
    assert snapshot(dev) == before


async def test_a_numpy_array_as_a_device_argument_points_to_from_host(dev: trio_cuda.Device) -> None:
    from trio_cuda import ops

    x = await api.ones((4,))
    y = await api.zeros((4,))
    before = snapshot(dev)
    host = np.ones(4, np.float32)  # (numpy arrays export DLPack too: still host memory)
    hint = r"numpy\.ndarray \(a numpy array is host memory: upload it with api\.from_host\(array\)\)"
    with pytest.raises(TypeError, match=hint):
        add(y.partition((4,)), host, x)
    with pytest.raises(TypeError, match=hint):
        ops.add(x, host)
    with pytest.raises(TypeError, match=hint):
        api.dup(host)
    with pytest.raises(TypeError, match=hint):
        await add(y.partition((4,)), trio_cuda.value(host), x)
    assert snapshot(dev) == before


# ======================================================================================
# Regressions found by the adversarial reviews (formerly test_adversarial.py)
# ======================================================================================
# -- lazy ops and bad input ------------------------------------------------------------
async def test_arange_is_lazy_and_too_large_fails_at_submission(dev: trio_cuda.Device) -> None:
    # repro_arange_eager_host_alloc: constructing an op allocates nothing. An arange of
    # 2**47 bytes (under the addressable limit) built its whole host array when it was
    # made: the call itself raised numpy's MemoryError, outside any submission.
    before = snapshot(dev)
    op = api.arange(2**45)
    assert snapshot(dev) == before
    with pytest.raises(trio_cuda.DeviceOutOfMemory):
        await api.zeros((2**45,))
    # Run, its device allocation fails first, before its host values or their pinned
    # staging memory are made.
    with pytest.raises(trio_cuda.DeviceOutOfMemory):
        await op
    assert snapshot(dev)[1:4] == before[1:4]  # no launch, allocation or copy
    # The values of small aranges are made when they enqueue, and are right.
    np.testing.assert_array_equal(await api.arange(3, 11, 2).to_host(), [3, 5, 7, 9])
    np.testing.assert_array_equal(await api.arange(0, 1, 0.25).to_host(), [0, 0.25, 0.5, 0.75])
    np.testing.assert_array_equal(await api.arange(5, dtype=np.int64).to_host(), np.arange(5))


@pytest.mark.parametrize("value", ["inf", "1e999"])
def test_an_infinite_poll_budget_is_refused_naming_the_variable(value: str) -> None:
    # repro_env_poll_budget_inf: "inf" passed the >= 0 check, then int(inf * 1000) raised
    # a bare OverflowError that names nothing.
    r = child(
        """
        import numpy as np, trio, trio_cuda
        from trio_cuda import api
        from trio_cuda.kernels import sleep
        async def main():
            c = await api.zeros((1,), np.int32)
            await sleep(c.partition((1,)), 5_000_000)
        trio.run(main)
        """,
        TRIO_CUDA_POLL_BUDGET_US=value,
    )
    last = (r.stderr.strip().splitlines() or [""])[-1]
    assert r.returncode != 0, r.stdout
    assert "ValueError" in last and "TRIO_CUDA_POLL_BUDGET_US" in last, r.stderr[-2000:]


@pytest.mark.parametrize(
    "value,dtype",
    [
        (2**63, np.int64),
        (2**64 - 1, np.int64),
        (-1, np.uint64),
        (-(2**63), np.uint64),
        (300, np.uint8),
        (-1, np.uint32),
        (2**31, np.int32),
    ],
)
def test_full_refuses_integers_out_of_the_dtypes_range(dev: trio_cuda.Device, value: int, dtype: type) -> None:
    # repro_full_int64_wraparound: for 64-bit dtypes the range check round-tripped through
    # the other 64-bit type and wrapped, so the tensor silently held another number.
    before = snapshot(dev)
    with pytest.raises(ValueError, match="out of range"):
        api.full((2,), value, dtype)
    assert snapshot(dev) == before


@pytest.mark.parametrize("value,dtype", [(2**63 - 1, np.int64), (-(2**63), np.int64), (2**64 - 1, np.uint64), (0, np.uint64)])
def test_full_keeps_the_extreme_integers_of_64_bit_dtypes(value: int, dtype: type) -> None:
    # The other half of the range check: the limits themselves are accepted, exactly.
    got = api.full((2,), value, dtype).to_host().sync()
    assert got.dtype == np.dtype(dtype) and [int(v) for v in got] == [value, value]


def test_unzip_accepts_numpy_integers() -> None:
    # repro_numpy_scalar_unzip: numpy scalars are accepted wherever Python ints are;
    # unzip(np.int64(2)) was refused ("needs a positive int").
    for n in (2, np.int64(2), np.int32(2), np.uint8(2)):
        a, b = trio_cuda.value((1, 2)).unzip(n)
        assert (a.sync(), b.sync()) == (1, 2)
    with pytest.raises(ValueError):
        trio_cuda.value((1, 2)).unzip(np.int64(0))


async def test_submit_names_what_it_needs() -> None:
    op = api.ones((2,))
    with pytest.raises(TypeError, match="needs a DeviceOp"):
        await lowlevel.submit(np.ones(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scheduled\.op, scheduled\.stream"):
        await lowlevel.submit(api.ones((2,)).schedule())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="await it first"):
        api.from_host(trio_cuda.value(3))
    with pytest.raises(TypeError, match=r"policy\.next_stream\(\)"):
        await lowlevel.submit(op, trio_cuda.current_device().policy)  # type: ignore[arg-type]
    sub = await lowlevel.submit(op)  # the op was not consumed by the refusals
    np.testing.assert_array_equal(await (await sub.wait()).to_host(), [1, 1])
