"""``zip`` (one op whose output is the tuple of its branches' outputs, the branches free to
run on other streams of the policy) and ``value`` (an op whose output is known already:
no device work)."""

from __future__ import annotations

from typing import Any, TypeVar, overload

from ._op import DeviceOp, TensorValuedOp, is_tensor_like
from ._plan import Lane, Plan

__all__ = ["value", "zip"]

T = TypeVar("T", covariant=True)
U = TypeVar("U")
A = TypeVar("A")  # (the element types of a zip's tuple)
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")


class _Value(DeviceOp[T]):
    __slots__ = ("_value",)

    def __init__(self, x: T) -> None:
        super().__init__((), len(x) if isinstance(x, tuple) else None)
        self._value = x

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> T:
        return self._value


class _TensorValue(_Value[T], TensorValuedOp[T]):
    __slots__ = ()


def value(x: U) -> DeviceOp[U]:
    """An op whose output is the already-known value ``x`` (no device work); of a
    tensor or a partition, a :class:`TensorValuedOp`."""
    if is_tensor_like(x):
        return _TensorValue(x)
    return _Value(x)


def _join(lane: Lane, forks: list[Lane]) -> None:
    lane.join(forks)


class _Zip(DeviceOp[tuple[Any, ...]]):
    __slots__ = ("_branches",)
    _forks = True

    def __init__(self, ops: tuple[DeviceOp[Any], ...]) -> None:
        super().__init__(ops, len(ops))
        self._branches: list[Lane] = []

    def _lanes(self, lane: Lane, n: int) -> list[Lane]:
        # Independent branches may run on other streams of the policy; joined in _plan.
        forks = [lane.fork(join_at_end=False) for _ in range(n - 1)]
        self._branches = forks
        return [lane, *forks]

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> tuple[Any, ...]:
        if self._branches:
            plan.step(lane, _join, self._branches)
        return tuple(args)


@overload
def zip(a: DeviceOp[A], /) -> DeviceOp[tuple[A]]: ...
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], /) -> DeviceOp[tuple[A, B]]: ...
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], /) -> DeviceOp[tuple[A, B, C]]: ...
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], d: DeviceOp[D], /) -> DeviceOp[tuple[A, B, C, D]]: ...
@overload
def zip(
    a: DeviceOp[Any], b: DeviceOp[Any], c: DeviceOp[Any], d: DeviceOp[Any], e: DeviceOp[Any], /, *ops: DeviceOp[Any]
) -> DeviceOp[tuple[Any, ...]]: ...
def zip(*ops: Any) -> DeviceOp[tuple[Any, ...]]:
    """Fan-in: one op whose output is the tuple of the ops' outputs.

    Independent branches may run on different streams of the policy, joined with
    events; tensors and plain values are accepted as already-known outputs.
    """
    if not ops:
        raise TypeError("zip() needs at least one op")
    return _Zip(tuple(o if isinstance(o, DeviceOp) else _Value(o) for o in ops))
