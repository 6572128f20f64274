"""DeviceOp: lazy descriptions of device work, and the combinators that compose them.

Constructing an op (or combining ops) does nothing: no stream is chosen, nothing is
allocated or submitted. Work starts at an execution entry point: ``await op``,
``op.sync()``, ``op.sync_on(stream)``, or an op bound by ``op.schedule(policy)``.

Ops are single-use, like the work they describe: executing one twice raises
:class:`~trio_cuda.OpAlreadyExecuted`. ``op.shared()`` makes an op that executes once
and hands the same output to every consumer, in any number of submissions.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Generator, Generic, TypeVar, overload

from ._execution import Continue, Lane, Pending, contains_pending, run_async, run_sync
from ._stream import Stream

if TYPE_CHECKING:
    import numpy as np

    from ._scheduling import SchedulingPolicy
    from ._tensor import Partition, Tensor

__all__ = ["DeviceOp", "ScheduledOp", "SharedOp", "value", "zip"]

T = TypeVar("T")
U = TypeVar("U")
A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")


class DeviceOp(Generic[T]):
    """A lazy description of device work with an output value of type ``T``.

    Subclasses set ``_inputs`` (the ops whose outputs they consume) and implement
    ``_run(lane, input_values)``, which enqueues their work on ``lane`` and returns
    the output (or ``Continue(op)`` to continue with another op on the same lane).
    """

    __slots__ = ("_inputs", "_state", "_arity")
    _forks = False  # True if _lanes() may put inputs on other lanes

    def __init__(self, inputs: tuple["DeviceOp[Any]", ...] = (), arity: int | None = None) -> None:
        self._inputs = inputs
        self._state: Any = None
        self._arity = arity

    # -- execution protocol (internal) --------------------------------------------
    def _lanes(self, lane: Lane, n: int) -> list[Lane] | None:
        return None

    def _run(self, lane: Lane, args: Any) -> Any:
        raise NotImplementedError

    def _reuse(self, lane: Lane) -> Any:
        raise AssertionError("only shared ops are reused")

    def __repr__(self) -> str:
        return f"<{type(self).__name__.lstrip('_')} op at {id(self):#x}>"

    # -- combinators ----------------------------------------------------------------
    def then(self, fn: "Callable[[T], DeviceOp[U] | U]") -> "DeviceOp[U]":
        """Serial dependency: ``fn(output)`` returns the next op (or a plain value).

        The next op runs on the same stream, strictly after this one. ``fn`` runs on
        the host during submission, before the device work is done: it sees device
        handles (tensors), not data, and must not execute ops itself.
        """
        if not callable(fn):
            raise TypeError(f"then() needs a callable, got {fn!r}")
        return _Then(self, fn)

    def map(self, fn: "Callable[[T], U]") -> "DeviceOp[U]":
        """Transform the output on the host; no device work.

        Over a host value that device work produces (``to_host``), ``fn`` is applied
        once that value exists, after the work completes.
        """
        if not callable(fn):
            raise TypeError(f"map() needs a callable, got {fn!r}")
        return _Map(self, fn)

    def first(self) -> "DeviceOp[Any]":
        """The first element of a tuple output."""
        return _Select(self, 0, None)

    def last(self) -> "DeviceOp[Any]":
        """The last element of a tuple output."""
        return _Select(self, -1, None)

    def unzip(self, n: int | None = None) -> "tuple[SharedOp[Any], ...]":
        """Fan a tuple output out into ``n`` independent ops; this op executes at most once.

        ``n`` may be omitted when the arity is known (zip, kernel launches, tuple values).
        The returned ops are shared ops: each may have several consumers too.
        """
        arity = self._arity
        if n is None:
            if arity is None:
                raise TypeError(f"unzip() needs n: the number of outputs of {self!r} is not known")
            n = arity
        elif not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"unzip(n) needs a positive int, got {n!r}")
        elif arity is not None and n != arity:
            raise ValueError(f"unzip({n}) of an op with {arity} outputs")
        src = self.shared()
        return tuple(SharedOp(_Select(src, i, n)) for i in range(n))

    def shared(self) -> "SharedOp[T]":
        """An op that executes this one once; every consumer (and re-await) sees the same output."""
        if isinstance(self, SharedOp):
            return self
        return SharedOp(self)

    # tensor conveniences: the whole pipeline reads as one chain
    def partition(self, tile_shape: Any) -> "DeviceOp[Partition]":
        """Partition the output tensor (see :meth:`Tensor.partition`)."""
        from ._tensor import check_shape

        tile = check_shape(tile_shape, "tile_shape")
        return _Map(self, lambda v: _tensor_of(v, "partition()").partition(tile))

    def unpartition(self) -> "DeviceOp[Tensor]":
        """The tensor of the output partition."""
        return _Map(self, _unpartition)

    def reshape(self, *shape: Any) -> "DeviceOp[Tensor]":
        """Reshape the output tensor (a view; see :meth:`Tensor.reshape`)."""
        return _Map(self, lambda v: _tensor_of(v, "reshape()").reshape(*shape))

    def to_host(self) -> "DeviceOp[np.ndarray]":
        """Copy the output tensor (or partition) into a new numpy array."""
        from ._api import _ToHost

        return _ToHost(self)

    # -- entry points -----------------------------------------------------------------
    def __await__(self) -> Generator[Any, None, T]:
        return run_async(self).__await__()

    def sync(self) -> T:
        """Execute from plain (non-trio) code and block until done; returns the output.

        Raises:
            RuntimeError: Called inside a running trio task (it would block the loop).
        """
        return run_sync(self)

    def sync_on(self, stream: Stream) -> T:
        """Like :meth:`sync`, on the given stream."""
        if not isinstance(stream, Stream):
            raise TypeError(f"sync_on() needs a Stream, got {stream!r}")
        return run_sync(self, stream)

    def schedule(self, policy: "SchedulingPolicy | None" = None) -> "ScheduledOp[T]":
        """Bind this op to a stream chosen by ``policy`` now; submit when awaited (or synced)."""
        from ._device import current_device
        from ._scheduling import SchedulingPolicy

        if policy is None:
            policy = current_device().policy
        elif not isinstance(policy, SchedulingPolicy):
            raise TypeError(f"schedule() needs a SchedulingPolicy, got {policy!r}")
        return ScheduledOp(self, policy.next_stream())

    def graph_on(self, stream: Stream) -> "Any":
        """Capture this op's DAG on ``stream`` into a :class:`CudaGraph` (nothing runs yet)."""
        from ._graph import capture_op

        if not isinstance(stream, Stream):
            raise TypeError(f"graph_on() needs a Stream, got {stream!r}")
        return capture_op(self, stream)

    def graph(self) -> "Any":
        """Capture this op's DAG on a stream of the current device's policy."""
        from ._device import current_device

        return self.graph_on(current_device().policy.next_stream())


class ScheduledOp(Generic[T]):
    """An op bound to a stream by :meth:`DeviceOp.schedule`; submitted when awaited or synced.

    Attributes:
        stream: The stream the op will run on.
    """

    __slots__ = ("op", "stream")

    def __init__(self, op: DeviceOp[T], stream: Stream) -> None:
        self.op = op
        self.stream = stream

    def __await__(self) -> Generator[Any, None, T]:
        return run_async(self.op, self.stream).__await__()

    def sync(self) -> T:
        """Submit on the bound stream and block until done (plain code only)."""
        return run_sync(self.op, self.stream)


# -- combinator ops -------------------------------------------------------------------
class _Value(DeviceOp[T]):
    __slots__ = ("_value",)

    def __init__(self, x: T) -> None:
        super().__init__((), len(x) if isinstance(x, tuple) else None)
        self._value = x

    def _run(self, lane: Lane, args: Any) -> T:
        return self._value


class _Then(DeviceOp[U]):
    __slots__ = ("_fn",)

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], Any]) -> None:
        super().__init__((src,))
        self._fn = fn

    def _run(self, lane: Lane, args: Any) -> Any:
        (v,) = args
        if lane.pending and contains_pending(v):
            raise TypeError(
                "then() over a host value from to_host(): the data exists only once the work "
                "completes; await the op first, or use map() to transform it"
            )
        r = self._fn(v)
        if isinstance(r, DeviceOp):
            return Continue(r)
        if inspect.isawaitable(r):
            close = getattr(r, "close", None)
            if close is not None:
                close()
            raise TypeError("then() callbacks must be synchronous and return a DeviceOp or a value, not an awaitable")
        return r


class _Map(DeviceOp[U]):
    __slots__ = ("_fn",)

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], Any]) -> None:
        super().__init__((src,))
        self._fn = fn

    def _run(self, lane: Lane, args: Any) -> Any:
        (v,) = args
        fn = self._fn
        if lane.pending and contains_pending(v):
            from ._execution import resolve

            return Pending(lambda: fn(resolve(v)))
        r = fn(v)
        if isinstance(r, DeviceOp):
            raise TypeError("map() callbacks return values, not ops; use then() to continue with an op")
        return r


def _pick(v: Any, index: int, expect: int | None) -> Any:
    if not isinstance(v, (tuple, list)):
        raise TypeError(f"expected a tuple output to select from, got {type(v).__name__}")
    if expect is not None and len(v) != expect:
        raise ValueError(f"unzip({expect}) of an output with {len(v)} elements")
    if not v:
        raise ValueError("cannot select from an empty tuple")
    return v[index]


class _Select(DeviceOp[Any]):
    __slots__ = ("_index", "_expect")

    def __init__(self, src: DeviceOp[Any], index: int, expect: int | None) -> None:
        super().__init__((src,))
        self._index = index
        self._expect = expect

    def _run(self, lane: Lane, args: Any) -> Any:
        v = args[0]
        if type(v) is tuple and self._expect is None and v:
            return v[self._index]
        if isinstance(v, Pending):
            index, expect = self._index, self._expect
            return Pending(lambda: _pick(v.resolve(), index, expect))
        return _pick(v, self._index, self._expect)


class _Zip(DeviceOp[tuple]):
    __slots__ = ()
    _forks = True

    def __init__(self, ops: tuple[DeviceOp[Any], ...]) -> None:
        super().__init__(ops, len(ops))

    def _lanes(self, lane: Lane, n: int) -> list[Lane]:
        # Independent branches may run on other streams of the policy; joined in _run.
        return [lane] + [lane.fork() for _ in range(n - 1)]

    def _run(self, lane: Lane, args: Any) -> tuple:
        lane.join()
        return tuple(args)


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Done:
    __slots__ = ("value", "stream", "seq", "pending")

    def __init__(self, value: Any, stream: Stream, seq: int, pending: bool) -> None:
        self.value = value
        self.stream = stream
        self.seq = seq
        self.pending = pending


class SharedOp(DeviceOp[T]):
    """An op that executes its upstream once and gives every consumer the same output.

    It may be awaited any number of times and used by any number of ops, in one
    submission or many; consumers on other streams wait for the upstream's work.
    """

    __slots__ = ()

    def __init__(self, src: DeviceOp[T]) -> None:
        super().__init__((src,), src._arity)

    def _run(self, lane: Lane, args: Any) -> T:
        (v,) = args
        s = lane.stream
        self._state = _Done(v, s, max(s.seq, lane.need), contains_pending(v))
        return v

    def _reuse(self, lane: Lane) -> T:
        st = self._state
        if type(st) is _Failed:
            raise st.exc
        lane.depend(st.stream, st.seq)
        if st.pending:
            lane.pending += 1
        return st.value

    def _fail(self, exc: BaseException) -> None:
        if self._state is True:
            self._state = _Failed(exc)

    @property
    def is_executed(self) -> bool:
        """True once the upstream has been submitted."""
        return self._state is not None


def value(x: T) -> DeviceOp[T]:
    """An op whose output is the already-known value ``x`` (no device work)."""
    return _Value(x)


@overload
def zip(a: DeviceOp[A], /) -> DeviceOp[tuple[A]]: ...
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], /) -> DeviceOp[tuple[A, B]]: ...
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], /) -> DeviceOp[tuple[A, B, C]]: ...
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], d: DeviceOp[D], /) -> DeviceOp[tuple[A, B, C, D]]: ...
@overload
def zip(*ops: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]: ...
def zip(*ops: Any) -> DeviceOp[tuple[Any, ...]]:
    """Fan-in: one op whose output is the tuple of the ops' outputs.

    Independent branches may run on different streams of the policy, joined with
    events; tensors and plain values are accepted as already-known outputs.
    """
    if not ops:
        raise TypeError("zip() needs at least one op")
    return _Zip(tuple(o if isinstance(o, DeviceOp) else _Value(o) for o in ops))


def _tensor_of(v: Any, what: str) -> "Tensor":
    from ._tensor import Partition, Tensor

    if isinstance(v, Tensor):
        return v
    if isinstance(v, Partition):
        return v.tensor
    raise TypeError(f"{what} needs an op whose output is a tensor or partition, got {type(v).__name__}")


def _unpartition(v: Any) -> "Tensor":
    from ._tensor import Partition, Tensor

    if isinstance(v, Partition):
        return v.tensor
    if isinstance(v, Tensor):
        return v
    raise TypeError(f"unpartition() needs an op whose output is a partition, got {type(v).__name__}")
