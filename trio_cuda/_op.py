"""DeviceOp: lazy descriptions of device work, and the combinators that compose them.

Constructing an op (or combining ops) does nothing: no stream is chosen, nothing is
allocated or submitted. Work starts at an execution entry point: ``await op``,
``op.sync()``, ``op.sync_on(stream)``, or an op bound by ``op.schedule(policy)``.

Ops are single-use, like the work they describe: executing one twice raises
:class:`~trio_cuda.OpAlreadyExecuted`. ``op.shared()`` makes an op that executes once
and hands the same output to every consumer, in any number of submissions.

The op protocol (for op families above this module): an op has ``_inputs`` (the ops
whose outputs it consumes) and implements ``_plan(plan, lane, input_values)``, which
validates, appends the steps it will enqueue to the plan, and returns its output
(or ``Continue(op)`` to continue with another op on the same lane). Tensor-flavoured
methods (``to_host``, ``partition``, ...) work on any output that provides the
tensor protocol (``_as_tensor()``), so this module does not depend on the tensor
types. Methods implemented by higher layers (graph capture, arithmetic operators)
are looked up in :data:`extensions`, which those layers fill when they are imported
(as numpy's ndarray operators dispatch to the ufuncs).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar, TypeVarTuple, overload

import numpy as np

from ._checks import arg_type, as_int, check_shape
from ._errors import fresh
from ._pending import Claimed, Continue, Done, Failed, Pending, contains_pending, resolve
from ._plan import Lane, Plan
from ._stream import Stream
from ._submission import await_op, run_sync

__all__ = [
    "DeviceOp",
    "ScheduledOp",
    "SharedOp",
    "SharedTensorOp",
    "TensorMath",
    "TensorValuedOp",
    "is_device_value",
    "is_tensor_like",
    "array_index",
    "extensions",
    "is_function",
    "item_of",
    "one_item",
]

T = TypeVar("T", covariant=True)
U = TypeVar("U")
A = TypeVar("A")
Ts = TypeVarTuple("Ts")
# The tensor conveniences are typed by what the output can do, not by naming Tensor and
# Partition: those live a layer above (their to_host() makes one of these ops).
V = TypeVar("V")
P_co = TypeVar("P_co", covariant=True)


class _Partitions(Protocol[P_co]):
    def partition(self, tile_shape: Any) -> P_co: ...


class _Unpartitions(Protocol[P_co]):
    def unpartition(self) -> P_co: ...


# Filled by higher layers: "capture" (op, stream) -> CudaGraph; the math ops later.
extensions: dict[str, Callable[..., Any]] = {}


def _ext(name: str) -> Callable[..., Any]:
    try:
        return extensions[name]
    except KeyError:
        raise RuntimeError(f"trio_cuda is not fully imported ({name} is missing); import trio_cuda") from None


def not_a_function(op: object) -> TypeError:
    """The error for calling an op (``nursery.start_soon(op)``, ``trio.run(op)``)."""
    return TypeError(
        f"{op!r} is an op to await, not a function (nor an async function): 'await op' runs it; "
        "to run it in a nursery, wrap it in an async function: nursery.start_soon(run, op) "
        "with 'async def run(op): return await op'"
    )


def is_function(fn: object) -> bool:
    """True if ``fn`` can be called for a result: callable, and not an op (whose
    ``__call__`` only raises, to explain how to run it)."""
    return callable(fn) and not isinstance(fn, DeviceOp)


_SCALAR_HINT = "{}() of a device tensor or op: its value is on the device; 'await t.item()' gives a Python scalar"


def one_item(a: np.ndarray) -> Any:
    """The one element of a host array as a Python scalar (``item``'s last step)."""
    if a.size != 1:
        raise ValueError(f"item(): the tensor has {a.size} elements (shape {a.shape}); only one element converts to a scalar")
    return a.item()


def _comparable(x: Any) -> bool:
    # (arrays and lists too: the op refuses them with the way to upload them; any op,
    # not only a tensor-valued one: one of a scalar compares, another fails when planned
    # saying what its output is, where NotImplemented would make ``==`` an identity test)
    return isinstance(x, (TensorMath, DeviceOp, int, float, np.generic, np.ndarray, list, tuple))


def _compare(name: str, x: Any, y: Any) -> TensorValuedOp[Any]:
    """``ops.<name>(x, y)``, or NotImplemented for an operand no op takes (Python then
    falls back to identity for ``==`` and ``!=``)."""
    if not _comparable(y):
        return NotImplemented  # type: ignore[no-any-return]
    return _ext(name)(x, y)  # type: ignore[no-any-return]


def is_device_value(x: object) -> bool:
    """A tensor or an op: any op, so that one whose output is no tensor fails where it is
    used (as a gather's index, say), saying what its output is."""
    return isinstance(x, (TensorMath, DeviceOp))


def array_index(key: Any) -> bool:
    """True if indexing ``key`` holds a tensor or an op (a gather, not a view)."""
    if is_device_value(key):
        return True
    if type(key) is tuple:
        for k in key:
            if is_device_value(k):
                return True
    return False


class TensorMath:
    """Operators and math methods of tensors and tensor-producing ops: each returns the
    :mod:`trio_cuda.ops` op (looked up in :data:`extensions`, filled by ``trio_cuda.ops``)."""

    __slots__ = ()

    __array_ufunc__ = None  # numpy scalars and arrays defer to the reflected operators

    def __add__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("add")(self, other)  # type: ignore[no-any-return]

    def __radd__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("add")(other, self)  # type: ignore[no-any-return]

    def __sub__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("subtract")(self, other)  # type: ignore[no-any-return]

    def __rsub__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("subtract")(other, self)  # type: ignore[no-any-return]

    def __mul__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("multiply")(self, other)  # type: ignore[no-any-return]

    def __rmul__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("multiply")(other, self)  # type: ignore[no-any-return]

    def __truediv__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("divide")(self, other)  # type: ignore[no-any-return]

    def __rtruediv__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("divide")(other, self)  # type: ignore[no-any-return]

    def __matmul__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("matmul")(self, other)  # type: ignore[no-any-return]

    def __rmatmul__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("matmul")(other, self)  # type: ignore[no-any-return]

    # Comparisons are elementwise ops, as numpy's: ``a == b`` is an op giving a bool
    # tensor, so equality is not identity; hashing stays identity (ops and tensors are
    # dict keys and set members by what they are). Operands of other kinds get
    # NotImplemented (``t == None`` is False, ``tuple.index`` works).
    def __hash__(self) -> int:
        return object.__hash__(self)

    def __eq__(self, other: Any) -> TensorValuedOp[Any]:  # type: ignore[override]
        return _compare("equal", self, other)

    def __ne__(self, other: Any) -> TensorValuedOp[Any]:  # type: ignore[override]
        return _compare("not_equal", self, other)

    def __lt__(self, other: Any) -> TensorValuedOp[Any]:
        return _compare("less", self, other)

    def __le__(self, other: Any) -> TensorValuedOp[Any]:
        return _compare("less_equal", self, other)

    def __gt__(self, other: Any) -> TensorValuedOp[Any]:
        return _compare("greater", self, other)

    def __ge__(self, other: Any) -> TensorValuedOp[Any]:
        return _compare("greater_equal", self, other)

    def __and__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("bitwise_and")(self, other)  # type: ignore[no-any-return]

    def __rand__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("bitwise_and")(other, self)  # type: ignore[no-any-return]

    def __or__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("bitwise_or")(self, other)  # type: ignore[no-any-return]

    def __ror__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("bitwise_or")(other, self)  # type: ignore[no-any-return]

    def __xor__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("bitwise_xor")(self, other)  # type: ignore[no-any-return]

    def __rxor__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("bitwise_xor")(other, self)  # type: ignore[no-any-return]

    def __invert__(self) -> TensorValuedOp[Any]:
        return _ext("invert")(self)  # type: ignore[no-any-return]

    def __bool__(self) -> bool:
        raise TypeError(
            "the truth value of a device tensor or op is unknown on the host (and of more than one "
            "element, ambiguous, as numpy says): read it back first, e.g. "
            "'if (await (a == b).to_host()).all():'"
        )

    def __float__(self) -> float:
        raise TypeError(_SCALAR_HINT.format("float"))

    def __int__(self) -> int:
        raise TypeError(_SCALAR_HINT.format("int"))

    def __pow__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("pow")(self, other)  # type: ignore[no-any-return]

    def __rpow__(self, other: Any) -> TensorValuedOp[Any]:
        return _ext("power")(other, self)  # type: ignore[no-any-return]

    def __neg__(self) -> TensorValuedOp[Any]:
        return _ext("negative")(self)  # type: ignore[no-any-return]

    def __abs__(self) -> TensorValuedOp[Any]:
        return _ext("abs")(self)  # type: ignore[no-any-return]

    def astype(self, dtype: Any, *, copy: bool = True) -> TensorValuedOp[Any]:
        """The output tensor converted to ``dtype`` (see :func:`trio_cuda.ops.astype`)."""
        return _ext("astype")(self, dtype, copy=copy)  # type: ignore[no-any-return]

    def copy(self) -> TensorValuedOp[Any]:
        """A C-contiguous copy of the output tensor."""
        return _ext("copy")(self)  # type: ignore[no-any-return]

    def relu(self) -> TensorValuedOp[Any]:
        return _ext("relu")(self)  # type: ignore[no-any-return]

    def gelu(self, approximate: str = "tanh") -> TensorValuedOp[Any]:
        return _ext("gelu")(self, approximate=approximate)  # type: ignore[no-any-return]

    def silu(self) -> TensorValuedOp[Any]:
        return _ext("silu")(self)  # type: ignore[no-any-return]

    def sigmoid(self) -> TensorValuedOp[Any]:
        return _ext("sigmoid")(self)  # type: ignore[no-any-return]

    def exp(self) -> TensorValuedOp[Any]:
        return _ext("exp")(self)  # type: ignore[no-any-return]

    def log(self) -> TensorValuedOp[Any]:
        return _ext("log")(self)  # type: ignore[no-any-return]

    def sqrt(self) -> TensorValuedOp[Any]:
        return _ext("sqrt")(self)  # type: ignore[no-any-return]

    def tanh(self) -> TensorValuedOp[Any]:
        return _ext("tanh")(self)  # type: ignore[no-any-return]

    def sum(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("sum")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def mean(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("mean")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def max(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("max")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def min(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("min")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def argmax(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("argmax")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def argmin(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("argmin")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def prod(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("prod")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def any(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("any")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def all(self, axis: Any = None, *, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("all")(self, axis, keepdims=keepdims)  # type: ignore[no-any-return]

    def var(self, axis: Any = None, *, ddof: float = 0, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("var")(self, axis, ddof=ddof, keepdims=keepdims)  # type: ignore[no-any-return]

    def std(self, axis: Any = None, *, ddof: float = 0, keepdims: bool = False) -> TensorValuedOp[Any]:
        return _ext("std")(self, axis, ddof=ddof, keepdims=keepdims)  # type: ignore[no-any-return]

    def cumsum(self, axis: Any = None) -> TensorValuedOp[Any]:
        return _ext("cumsum")(self, axis)  # type: ignore[no-any-return]

    def softmax(self, axis: int = -1) -> TensorValuedOp[Any]:
        return _ext("softmax")(self, axis)  # type: ignore[no-any-return]

    def log_softmax(self, axis: int = -1) -> TensorValuedOp[Any]:
        return _ext("log_softmax")(self, axis)  # type: ignore[no-any-return]


class DeviceOp(Generic[T]):
    r"""A lazy description of device work with an output value of type ``T``.

    Ops whose output is a tensor (or not known until planned: ``then``, ``map``,
    ``first``, a shared op) are :class:`TensorValuedOp`\ s, with the tensor methods and
    operators; a tuple, a host array or a plain value has none."""

    __slots__ = ("_arity", "_inputs", "_state")
    _forks = False  # True if _lanes() may put inputs on other lanes
    # An op may offer to plan and enqueue itself in one step when it stands alone
    # (stream) -> (output, event, names of its ops for errors) | None; None means the
    # general path (see _direct.direct_ready).
    _submit_now: Callable[[Stream], tuple[Any, Any, list[str]] | None] | None = None

    def __init__(self, inputs: tuple[DeviceOp[Any], ...] = (), arity: int | None = None) -> None:
        self._inputs = inputs
        self._state: Any = None
        self._arity = arity

    # -- the op protocol (internal) -------------------------------------------------
    def _lanes(self, lane: Lane, n: int) -> list[Lane]:
        return [lane] * n

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Any:
        raise NotImplementedError

    def _reuse(self, plan: Plan, lane: Lane) -> Any:
        raise AssertionError("only shared ops are reused")

    def __repr__(self) -> str:
        return f"<{type(self).__name__.lstrip('_')} op at {id(self):#x}>"

    # -- combinators ----------------------------------------------------------------
    @overload
    def then(self, fn: Callable[[T], DeviceOp[U]]) -> TensorValuedOp[U]: ...
    @overload
    def then(self, fn: Callable[[T], U]) -> TensorValuedOp[U]: ...
    def then(self, fn: Callable[[T], Any]) -> TensorValuedOp[Any]:
        """Serial dependency: ``fn(output)`` returns the next op (or a plain value).

        The next op runs on the same stream, strictly after this one. ``fn`` runs on
        the host when the DAG is planned, before any of its device work is enqueued:
        it sees device handles (tensors), not data, and must not execute ops itself.
        """
        if not is_function(fn):
            raise TypeError(f"then() needs a callable, got {fn!r}")
        return _Then(self, fn)

    def map(self, fn: Callable[[T], U]) -> TensorValuedOp[U]:
        """Transform the output on the host; no device work.

        Over a host value that device work produces (``to_host``), ``fn`` is applied
        once that value exists, after the work completes.
        """
        if not is_function(fn):
            raise TypeError(f"map() needs a callable, got {fn!r}")
        return _Map(self, fn)

    @overload
    def first(self: DeviceOp[tuple[A, *Ts]]) -> TensorValuedOp[A]: ...
    @overload
    def first(self: DeviceOp[tuple[A, ...]]) -> TensorValuedOp[A]: ...
    @overload
    def first(self) -> TensorValuedOp[Any]: ...
    def first(self) -> TensorValuedOp[Any]:
        """The first element of a tuple output."""
        return _Select(self, 0, None)

    @overload
    def last(self: DeviceOp[tuple[*Ts, A]]) -> TensorValuedOp[A]: ...
    @overload
    def last(self: DeviceOp[tuple[A, ...]]) -> TensorValuedOp[A]: ...
    @overload
    def last(self) -> TensorValuedOp[Any]: ...
    def last(self) -> TensorValuedOp[Any]:
        """The last element of a tuple output."""
        return _Select(self, -1, None)

    def unzip(self, n: int | None = None) -> tuple[SharedTensorOp[Any], ...]:
        """Fan a tuple output out into ``n`` independent ops; this op executes at most once.

        ``n`` may be omitted when the arity is known (zip, kernel launches, tuple values).
        The returned ops are shared ops: each may have several consumers too; their
        outputs are not known until planned, so they have the tensor's methods.
        """
        arity = self._arity
        if n is None:
            if arity is None:
                raise TypeError(f"unzip() needs n: the number of outputs of {self!r} is not known")
            n = arity
        else:
            n = as_int(n, "unzip(n)", minimum=1)
        if arity is not None and n != arity:
            raise ValueError(f"unzip({n}) of an op with {arity} outputs")
        src = self.shared()
        return tuple(SharedTensorOp(_Select(src, i, n)) for i in range(n))

    def shared(self) -> SharedOp[T]:
        """An op that executes this one once; every consumer (and re-await) sees the same output."""
        if isinstance(self, SharedOp):
            return self
        return SharedOp(self)

    def to_host(self) -> DeviceOp[np.ndarray]:
        """Copy the output tensor (or partition) into a new numpy array."""
        return _ToHost(self)

    def item(self) -> DeviceOp[Any]:
        """The output tensor's one element as a Python scalar: ``await loss.item()``
        (a tensor of more elements fails the op with ``ValueError``)."""
        return item_of(self)

    def __iter__(self) -> Any:
        raise TypeError("a DeviceOp is not iterable: await it first (or unzip() an op with a tuple output)")

    # trio calls what start_soon() / trio.run() are given: without this an op reached
    # there fails with "'_Alloc' object is not callable", which says nothing of the fix.
    # Annotated None, not NoReturn: NoReturn would match the awaitable that a type
    # checker expects there, and hide the mistake from it.
    def __call__(self, *args: object, **kwargs: object) -> None:
        raise not_a_function(self)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a DeviceOp is lazy device work: 'await op.to_host()' gives a numpy array")

    # -- entry points -----------------------------------------------------------------
    def __await__(self) -> Generator[Any, None, T]:
        return await_op(self)

    def sync(self) -> T:
        """Execute from plain (non-trio) code and block until done; returns the output.

        Raises:
            RuntimeError: Called inside a running trio task (it would block the loop).
        """
        return run_sync(self)  # type: ignore[no-any-return]

    def sync_on(self, stream: Stream) -> T:
        """Like :meth:`sync`, on the given stream."""
        if not isinstance(stream, Stream):
            raise TypeError(f"sync_on() needs a Stream, got {stream!r}")
        return run_sync(self, stream, "op.sync_on()")  # type: ignore[no-any-return]

    def schedule(self, policy: Any = None) -> ScheduledOp[T]:
        """Bind this op to a stream chosen by ``policy`` (a SchedulingPolicy; default: the
        current device's) now; submit when awaited (or synced)."""
        from ._registry import current_device

        if policy is None:
            policy = current_device().policy
        elif not callable(getattr(policy, "next_stream", None)):
            raise TypeError(f"schedule() needs a SchedulingPolicy, got {policy!r}")
        return ScheduledOp(self, policy.next_stream())

    def graph_on(self, stream: Stream) -> Any:
        """Capture this op's DAG on ``stream`` into a :class:`CudaGraph` (nothing runs yet)."""
        if not isinstance(stream, Stream):
            raise TypeError(f"graph_on() needs a Stream, got {stream!r}")
        return _ext("capture")(self, stream)

    def graph(self) -> Any:
        """Capture this op's DAG on a private stream of the current device."""
        return _ext("capture")(self, None)


class TensorValuedOp(DeviceOp[T], TensorMath):
    """A :class:`DeviceOp` whose output is a tensor, or not known until the op is planned
    (``then``, ``map``, ``first``, a shared op): the tensor's operators, math methods
    and views, each itself an op (a wrong output type fails the op when it is planned).
    What ``trio_cuda.ops``, the constructors of ``trio_cuda.api`` and the combinators
    return."""

    __slots__ = ()

    def shared(self) -> SharedTensorOp[T]:
        """An op that executes this one once; every consumer (and re-await) sees the same
        output (see :meth:`DeviceOp.shared`)."""
        if isinstance(self, SharedTensorOp):
            return self
        return SharedTensorOp(self)

    # tensor conveniences: the whole pipeline reads as one chain
    def partition(self: TensorValuedOp[_Partitions[U]], tile_shape: Any) -> TensorValuedOp[U]:
        """Partition the output tensor (see :meth:`Tensor.partition`)."""
        tile = check_shape(tile_shape, "tile_shape")
        return _Map(self, lambda v: _tensor_of(v, "partition()").partition(tile))

    def unpartition(self: TensorValuedOp[_Unpartitions[U]]) -> TensorValuedOp[U]:
        """The tensor of the output partition."""
        return _Map(self, lambda v: _tensor_of(v, "unpartition()"))

    def reshape(self: TensorValuedOp[V], *shape: Any) -> TensorValuedOp[V]:
        """Reshape the output tensor (a view; see :meth:`Tensor.reshape`)."""
        return _Map(self, lambda v: _tensor_of(v, "reshape()").reshape(*shape))

    # views of the output tensor (free: no device work)
    def __getitem__(self: TensorValuedOp[V], key: Any) -> TensorValuedOp[V]:
        """A view of the output tensor by basic indexing (see :meth:`Tensor.__getitem__`),
        or, with an integer tensor in ``key``, a gather (see :func:`trio_cuda.ops.take`)."""
        if array_index(key):
            return _ext("index")(self, key)  # type: ignore[no-any-return]
        return _Map(self, lambda v: _tensor_of(v, "indexing")[key])

    def transpose(self: TensorValuedOp[V], *axes: Any) -> TensorValuedOp[V]:
        """The output tensor with its axes permuted (a view)."""
        return _Map(self, lambda v: _tensor_of(v, "transpose()").transpose(*axes))

    # Last in the class: the name T would shadow the type variable in later annotations.
    @property
    def T(self: TensorValuedOp[V]) -> TensorValuedOp[V]:
        """The output tensor with its axes reversed (a view)."""
        return _Map(self, lambda v: _tensor_of(v, ".T").T)


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
        return await_op(self.op, self.stream)

    def __call__(self, *args: object, **kwargs: object) -> None:  # (see DeviceOp.__call__)
        raise not_a_function(self)

    def sync(self) -> T:
        """Submit on the bound stream and block until done (plain code only)."""
        return run_sync(self.op, self.stream)  # type: ignore[no-any-return]


# -- combinator ops -------------------------------------------------------------------
class _Then(TensorValuedOp[U]):
    __slots__ = ("_fn",)

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], Any]) -> None:
        super().__init__((src,))
        self._fn = fn

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Any:
        (v,) = args
        if plan.pending and contains_pending(v):
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


class _MapValue(DeviceOp[U]):
    """map(): the host function over the output; this class itself, for a map known to
    give no tensor (``item()``), has no tensor methods (see :class:`_Map`)."""

    __slots__ = ("_fn",)

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], Any]) -> None:
        super().__init__((src,))
        self._fn = fn

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Any:
        (v,) = args
        fn = self._fn
        if plan.pending and contains_pending(v):
            return Pending(lambda: fn(resolve(v)))
        r = fn(v)
        if isinstance(r, DeviceOp):
            raise TypeError("map() callbacks return values, not ops; use then() to continue with an op")
        return r


class _Map(_MapValue[U], TensorValuedOp[U]):
    __slots__ = ()


def _pick(v: Any, index: int, expect: int | None) -> Any:
    if not isinstance(v, (tuple, list)):
        raise TypeError(f"expected a tuple output to select from, got {type(v).__name__}")
    if expect is not None and len(v) != expect:
        raise ValueError(f"unzip({expect}) of an output with {len(v)} elements")
    if not v:
        raise ValueError("cannot select from an empty tuple")
    return v[index]


class _Select(TensorValuedOp[Any]):
    __slots__ = ("_expect", "_index")

    def __init__(self, src: DeviceOp[Any], index: int, expect: int | None) -> None:
        super().__init__((src,))
        self._index = index
        self._expect = expect

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Any:
        v = args[0]
        if type(v) is tuple and self._expect is None and v:
            return v[self._index]
        if isinstance(v, Pending):
            index, expect = self._index, self._expect
            return Pending(lambda: _pick(v.resolve(), index, expect))
        return _pick(v, self._index, self._expect)


def _mark_done(lane: Lane, op: SharedOp[Any]) -> None:
    st = op._state
    s = lane.stream
    op._state = Done(st.value, s, max(s.seq, lane.need), st.pending)


def _depend_shared(lane: Lane, op: SharedOp[Any]) -> None:
    st = op._state
    if st.__class__ is Done:
        if st.seq:
            lane.depend(st.stream, st.seq)
    elif st.__class__ is Failed:
        raise fresh(st.exc)
    else:  # cannot happen: the producing steps come first in every plan
        raise AssertionError(f"shared op in state {st!r} at enqueue")


class SharedOp(DeviceOp[T]):
    """An op that executes its upstream once and gives every consumer the same output.

    It may be awaited any number of times and used by any number of ops, in one
    submission or many; consumers on other streams wait for the upstream's work.
    Shared from a :class:`TensorValuedOp` it is a :class:`SharedTensorOp` (the tensor's
    methods); from a zip, a collective or ``value()``, a plain shared op.
    """

    __slots__ = ()

    def __init__(self, src: DeviceOp[T]) -> None:
        super().__init__((src,), src._arity)

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> T:
        (v,) = args
        self._state = Claimed(plan, v, contains_pending(v))
        if not plan.shared:
            plan.shared = []
        plan.shared.append(self)
        if plan.capture is not None:
            plan.capture.shared.append(self)
        plan.step(lane, _mark_done, self)
        return v  # type: ignore[no-any-return]

    def _reuse(self, plan: Plan, lane: Lane) -> T:
        st = self._state
        cls = st.__class__
        if cls is Failed:
            raise fresh(st.exc)
        if cls is Claimed:
            if st.plan is not plan:
                plan.wait_for_plan(st.plan)
                plan.reuse(self)
            plan.step(lane, _depend_shared, self)
        elif st.seq:
            plan.step(lane, _depend_shared, self)
        if st.pending:
            plan.pending += 1
        return st.value  # type: ignore[no-any-return]

    def _captured(self, err: BaseException) -> None:
        # Called when the graph capture that executed it ends (see Capture.restore).
        self._state = Failed(err)

    @property
    def is_executed(self) -> bool:
        """True once the upstream has been submitted (or is being submitted)."""
        return self._state is not None


class SharedTensorOp(SharedOp[T], TensorValuedOp[T]):
    """A shared :class:`TensorValuedOp` (what its ``shared()`` returns): the shared op with
    the tensor's methods."""

    __slots__ = ()


class _ToHost(DeviceOp["np.ndarray"]):
    __slots__ = ()

    def __init__(self, src: DeviceOp[Any]) -> None:
        super().__init__((src,))

    def _plan(self, plan: Plan, lane: Lane, args: Any) -> Any:
        return _tensor_of(args[0], "to_host()")._plan_to_host(plan, lane)


def item_of(op: DeviceOp[Any]) -> DeviceOp[Any]:
    """``item()`` of ``op``'s output tensor: a Python scalar, so an op without the
    tensor methods (its value exists only once the work completes)."""
    return _MapValue(_ToHost(op), one_item)


def is_tensor_like(x: object) -> bool:
    """A tensor or a partition (what has the tensor views; _tensor stands above this
    module): the output that makes an op whose output is known a TensorValuedOp."""
    return isinstance(x, TensorMath) or hasattr(type(x), "unpartition")


def _tensor_of(v: Any, what: str) -> Any:
    as_tensor = getattr(v, "_as_tensor", None)
    if as_tensor is None:
        raise TypeError(f"{what} needs an op whose output is a tensor or partition, got {arg_type(v)}")
    return as_tensor()
