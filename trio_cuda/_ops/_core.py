"""What every op of the library shares: operands, dtypes, broadcasting, outputs, launches.

An op (:class:`TensorOp`) is a DeviceOp whose arguments may be tensors, partitions,
scalars or other ops. Arguments known when the op is made are checked at once; the rest
when the submission is planned, before anything of it runs. Its ``_build`` allocates the
output (or takes ``out=``) and appends the launches of its kernels to the plan.

Repeated calls are cheap: what an op's checks and ``_build`` derive from its arguments
depends only on their layouts, dtypes, devices and scalar values, so the first build
for some arguments is recorded as a :class:`_Recipe` (allocations, kernel launches and
GEMMs over views of the operands), cached under the arguments' identity, and the next
op on the same arguments skips the checks and replays the recipe into the plan. See
:func:`_op_key` for the key and :meth:`_Recipe.replay` for what a replay re-checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _kernel
from .._checks import arg_type, check_dtype, is_scalar, nbytes_of
from .._device import Device
from .._direct import direct_enqueue, direct_ready, lane_step
from .._forecast import Names
from .._guard import LOCK, _tls
from .._kernel import Kernel, _Launch, _launch_step, _prepared_step, _scalar_key
from .._op import DeviceOp, TensorValuedOp
from .._pending import EXECUTING
from .._plan import Lane, Plan
from .._tensor import Partition, Tensor, c_strides
from ._layout import half_proxy

if TYPE_CHECKING:
    from .._stream import Event, Stream

__all__ = [
    "CacheStatistics",
    "LibraryOp",
    "TensorOp",
    "alloc",
    "cache_statistics",
    "check_out",
    "device_of",
    "launch",
    "operand",
    "tensor_arg",
]

THREADS = 256  # threads per block of the elementwise and row kernels
MAX_ROW_BLOCKS = 1 << 20  # row kernels loop over rows past this many blocks


# -- operands ---------------------------------------------------------------------------
def operand(x: Any, name: str, what: str = "argument") -> Any:
    """``x`` as an op operand: a Tensor, a DeviceOp, or a real scalar; else TypeError."""
    if type(x) is Tensor:  # the common case, first
        return x
    if isinstance(x, Partition):
        return x.tensor
    if isinstance(x, (Tensor, DeviceOp)):
        return x
    if is_scalar(x):
        if isinstance(x, (complex, np.complexfloating)):
            raise TypeError(f"{name}: complex {what}s are not supported by trio_cuda.ops ({x!r})")
        return x
    raise TypeError(f"{name}: the {what} must be a Tensor, a DeviceOp or a scalar, not {arg_type(x)}")


def tensor_arg(x: Any, name: str, what: str = "argument") -> Tensor:
    """A resolved operand that must be a tensor."""
    if isinstance(x, Partition):
        return x.tensor
    if isinstance(x, Tensor):
        return x
    if isinstance(x, tuple):
        raise TypeError(f"{name}: the {what} is a tuple (the output of a kernel launch?); pick the tensor with .first()")
    raise TypeError(f"{name}: the {what} must be a tensor, not {arg_type(x)}")


def resolved(v: Any, name: str) -> Any:
    """The output of an input op, as an operand (tensors of partitions; tuples refused)."""
    as_tensor = getattr(v, "_as_tensor", None)
    if as_tensor is not None:
        return as_tensor()
    if is_scalar(v):
        return v
    if isinstance(v, tuple):
        raise TypeError(f"{name}: an input op's output is a tuple (a kernel launch?); pick the tensor with .first()")
    raise TypeError(f"{name}: an input op's output must be a tensor or a scalar, not {arg_type(v)}")


class LibraryOp(DeviceOp[Any]):
    """An op of the library (:class:`TensorOp`: one whose output is a tensor). Subclasses
    implement ``_check(*args)`` (argument checks that need no plan: run by the
    constructor when no argument is an op, else at planning once the inputs' values are
    known) and ``_build(plan, lane, *args)`` (allocate and launch on checked arguments;
    returns the op's output).

    A subclass whose ``_check`` and ``_build`` depend on nothing but its class, its
    ``name`` and its arguments (their layouts, dtypes, devices, scalar values) sets
    ``_cacheable``: its builds are recorded and replayed (see the module doc)."""

    __slots__ = ("_args", "_at", "_hit", "_key")
    name = "op"
    _cacheable = False

    def __init__(self, args: tuple[Any, ...]) -> None:
        self._state = None
        self._arity = None
        self._args = args
        self._hit: _Recipe | None = None
        self._key: tuple[Any, ...] | None = None
        if self._cacheable:
            # The common call first: a key means no op inputs (_op_key keys none).
            key = self._key = _op_key(self, args)
            if key is not None:
                self._inputs = ()
                self._at: tuple[int, ...] = ()
                hit = _cache.get(key)
                if hit is not None and hit.generation == hit.device.generation:
                    self._hit = hit  # these arguments passed the checks before
                    return
                self._check(*args)
                return
        ops: list[DeviceOp[Any]] = []
        at: list[int] = []
        for i, a in enumerate(args):
            if isinstance(a, DeviceOp):
                ops.append(a)
                at.append(i)
        self._inputs = tuple(ops)
        self._at = tuple(at)
        if not ops:
            self._check(*args)

    def _check(self, *args: Any) -> None:
        """Checks that need no plan (shapes, dtypes, devices); the build repeats them."""

    def _build(self, plan: Plan, lane: Lane, *args: Any) -> Tensor:
        raise NotImplementedError

    def _plan(self, plan: Plan, lane: Lane, values: Any) -> Tensor:
        args = self._args
        hit = self._hit
        key = self._key
        if values:
            merged = list(args)
            for i, v in zip(self._at, values, strict=True):
                merged[i] = resolved(v, self.name)
            args = tuple(merged)
            if self._cacheable:
                key = _op_key(self, args)
                hit = _cache.get(key) if key is not None else None
        if hit is not None:
            dev = lane.device
            if hit.device is dev and hit.generation == dev.generation:
                return hit.replay(plan, lane, args)
        if values or hit is not None:
            self._check(*args)  # without op inputs, the constructor checked them (or found a recipe)
        if key is not None:
            return _record(self, plan, lane, args, key)
        return self._build(plan, lane, *args)

    def _submit_now(self, s: Stream) -> tuple[Any, Event | None, list[str]] | None:
        """A lone op whose recipe is one prepared launch on operands only: planned and
        enqueued in one step by the launch's own fast path (see _Launch._submit_now)."""
        hit = self._hit
        if hit is None or hit.direct is None:
            return None
        return hit.submit_now(self, s)

    def __repr__(self) -> str:
        return f"<trio_cuda op {self.name} at {id(self):#x}>"


# -- the recipe cache -----------------------------------------------------------------------
_CACHE_SIZE = 1024  # recipes kept (the oldest is dropped first)
_cache: dict[tuple[Any, ...], _Recipe] = {}
_counts = {"hits": 0, "misses": 0}
_recording: _Recording | None = None  # the build being recorded (under the runtime lock)
_replayable: set[Callable[[Lane, Any], None]] = set()


class TensorOp(LibraryOp, TensorValuedOp[Tensor]):
    r"""A library op whose output is a tensor: it has the tensor methods and operators
    (a collective, an ``external`` call or a ``topk``, whose outputs are tuples, are
    plain :class:`LibraryOp`\ s)."""

    __slots__ = ()


# What a preparer returns for a step's argument: the function direct_enqueue runs,
# ``fn(stream, (static, writes, reads))``; its fixed argument; and which entries of the
# step's argument it writes and reads (their (buffer, tracked) pairs are made per call).
Prepared = tuple[Callable[[Any, Any], None], Any, tuple[int, ...], tuple[int, ...]]
# Replayable steps that can also be prepared for direct submissions (see prepared_step);
# prepare_steps=False runs them on a lane each time (for A/B measurements).
prepare_steps = True
_preparers: dict[Callable[[Lane, Any], None], Callable[[Any], Prepared | None]] = {}


@dataclass(frozen=True)
class CacheStatistics:
    """What the ops' recipe cache did so far, process-wide (see
    :func:`trio_cuda.ops.cache_statistics`).

    Attributes:
        hits: Ops planned (or submitted directly) by replaying a recipe: no checks, no
            build.
        misses: Ops built, and recorded where the build can be replayed, on arguments
            without a valid recipe (a first call, new operands, or a recipe a reset or
            an eviction dropped).
        entries: Recipes cached now.
        max_entries: The bound on ``entries`` (the oldest recipe is dropped first).
    """

    hits: int
    misses: int
    entries: int
    max_entries: int


def cache_statistics() -> CacheStatistics:
    """A frozen snapshot of the ops' recipe cache counters: how many op calls replayed a
    recipe (``hits``) and how many were built (``misses``), and how many recipes are kept.

    A repeated call on the same operands (the same tensors or views, scalars, dtypes and
    ``out=``) should be a hit; a call that keeps missing is checked and built each time
    (see docs/ops.md, "How they run")."""
    with LOCK:
        return CacheStatistics(_counts["hits"], _counts["misses"], len(_cache), _CACHE_SIZE)


def replayable_step(fn: Callable[[Lane, Any], None]) -> Callable[[Lane, Any], None]:
    """Declare a plan step function whose argument is a tuple of tensors and immutable
    values (recipes replay it on the new call's views)."""
    _replayable.add(fn)
    return fn


def prepared_step(fn: Callable[[Lane, Any], None], prepare: Callable[[Any], Prepared | None]) -> None:
    """Declare how to prepare replayable step ``fn`` for direct submissions: at the first
    direct submission of a recipe whose one step it is, ``prepare(arg)`` (the step's
    argument, made on that call's operands) returns what later direct submissions of
    the recipe run instead (or None: run ``fn`` on a lane each time). The operands are
    then the same memory each time (the recipe's key says so), so what depends only on
    their addresses may be computed once, as a kernel's prepared launch is."""
    assert fn in _replayable
    _preparers[fn] = prepare


def _all_ints(a: tuple[Any, ...]) -> bool:
    # (a loop rather than all() over a generator: compiled, _op_key is a C-level function
    # of _core.pxd, and Cython compiles no closure inside one)
    for v in a:
        if type(v) is not int:
            return False
    return True


def _op_key(op: LibraryOp, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The identity of an op on ``args``, or None if some of them cannot be keyed.

    Tensors contribute their cached kernel descriptor (one per buffer and view layout:
    a new buffer, even at a recycled address, has a new one), so equal keys mean the
    same memory seen the same way, and the key holds no device memory alive. Scalars
    contribute their type and bits (see _kernel._scalar_key)."""
    key: list[Any] = [type(op), op.name]
    for a in args:
        t = type(a)
        if t is Tensor:
            x: Tensor = a
            d = x._args
            if d is None:
                if x._buffer.ptr is None:
                    return None  # allocated by a submission not enqueued yet
                x._arg(False)
                d = x._args
                assert d is not None
            key.append(d[0])
        elif a is None or t is bool or t is int or t is str:
            key.append((t, a))
        elif t is float or isinstance(a, np.generic):
            key.append(_scalar_key(a))
        elif t is tuple and _all_ints(a):
            key.append((t, a))
        elif t is np.dtype or isinstance(a, np.dtype):
            key.append((np.dtype, a.str, a))
        else:
            return None
    return tuple(key)


class _Recording:
    """What a build allocated (alloc) and launched (launch), in order."""

    __slots__ = ("allocs", "launches")

    def __init__(self) -> None:
        self.allocs: list[tuple[Any, Lane, int, str]] = []
        self.launches: list[tuple[Kernel, tuple[Any, ...]]] = []


# Argument specs of a recipe: how to make a step's argument from the new call's operands.
_OPERAND, _OPERAND_VIEW, _ALLOC_VIEW, _PARTITION, _CONST = range(5)


def _buffers(args: tuple[Any, ...], sources: tuple[tuple[int, bool | None], ...]) -> list[tuple[Any, bool]]:
    """The (buffer, tracked) pairs of a launch's accesses (see _Step.set_prepared) on ``args``."""
    out = []
    for i, tracked in sources:
        x: Tensor = args[i]
        out.append((x._buffer, x._tracked if tracked is None else tracked))
    return out


def _make(spec: tuple[int, Any], args: tuple[Any, ...], bufs: Sequence[Any]) -> Any:
    kind, p = spec
    if kind == _OPERAND:
        return args[p]
    if kind == _CONST:
        return p
    if kind == _PARTITION:
        tensor_spec, tile, grid = p
        part = Partition.__new__(Partition)  # checked when recorded
        part.tensor = _make(tensor_spec, args, bufs)
        part.tile_shape = tile
        part.grid = grid
        part._k = None
        return part
    i, offset, shape, strides, dtype, tracked = p
    buf = args[i]._buffer if kind == _OPERAND_VIEW else bufs[i]
    return Tensor._new(buf, shape, dtype, offset, strides, tracked)


class _Step:
    """A kernel launch (``kernel`` set) or another replayable step (``fn``) of a recipe."""

    __slots__ = ("cfg", "fn", "kernel", "prepared", "pure", "reads", "ready", "specs", "writes")

    def __init__(self, kernel: Kernel | None, fn: Any, specs: list[tuple[int, Any]], pure: bool) -> None:
        self.kernel = kernel
        self.fn = fn
        self.specs = specs
        self.pure = pure  # only operands' memory: the prepared launch of one call fits the next
        self.cfg: Any = None
        self.prepared: Any = None
        # A pure launch's accesses as (operand position, tracked or None: the operand's own),
        # set with its prepared launch (see _Recipe.submit_now).
        self.writes: tuple[tuple[int, bool | None], ...] = ()
        self.reads: tuple[tuple[int, bool | None], ...] = ()
        # A pure step of another kind, prepared (see prepared_step): (fn, its fixed
        # argument); None: not prepared yet; False: it cannot be.
        self.ready: tuple[Callable[[Stream, Any], None], Any] | bool | None = None

    def _sources(self, positions: Sequence[int]) -> tuple[tuple[int, bool | None], ...]:
        """Where the buffers of these entries of a pure step's argument come from."""

        def source(spec: tuple[int, Any]) -> tuple[int, bool | None]:
            kind, p = spec
            if kind == _PARTITION:
                kind, p = p[0]
            if kind == _OPERAND:
                return p, None
            assert kind == _OPERAND_VIEW
            return p[0], p[5]

        return tuple(source(self.specs[i]) for i in positions)

    def set_prepared(self, cfg: Any, prepared: Any) -> None:
        """Keep the prepared launch of a pure launch step, and where its buffers come from."""
        self.writes = self._sources(cfg.writes)
        self.reads = self._sources(cfg.reads)
        self.cfg, self.prepared = cfg, prepared

    def prepare(self, made: Any) -> None:
        """Prepare this pure step of another kind on ``made``, its argument as made on
        an operand's call (see prepared_step)."""
        prepare = _preparers.get(self.fn) if prepare_steps else None
        got = prepare(made) if prepare is not None else None
        if got is None:
            self.ready = False
            return
        fn, static, writes, reads = got
        self.writes = self._sources(writes)
        self.reads = self._sources(reads)
        self.ready = (fn, static)


class _Recipe:
    """An op's build on some arguments, to replay on the same arguments."""

    __slots__ = ("allocs", "device", "direct", "generation", "ops", "result", "steps", "uses")

    def __init__(
        self,
        device: Device,
        uses: tuple[int, ...],
        allocs: list[tuple[int, str]],
        steps: list[_Step],
        ops: list[str],
        result: tuple[int, Any],
    ) -> None:
        self.device = device
        self.generation = device.generation  # a reset invalidates the recipe
        self.uses = uses
        self.allocs = allocs
        self.steps = steps
        self.ops = ops
        self.result = result
        # The one step, when it uses operands only (no allocation): submitted directly by
        # TensorOp._submit_now (a launch once its prepared launch is known).
        self.direct = steps[0] if len(steps) == 1 and not allocs and steps[0].pure else None

    def submit_now(self, op: LibraryOp, s: Stream) -> tuple[Any, Event | None, list[str]] | None:
        """Enqueue the one step of this recipe on ``op``'s operands without a plan, as
        replay() and the general path would (see _direct.direct_ready); None: take the
        general path."""
        st = self.direct
        assert st is not None
        device = s.device
        k = st.kernel
        if self.device is not device or (k is not None and st.prepared is None) or _tls.submitting:
            return None
        args = op._args
        gen = self.generation
        with LOCK:
            if op._state is not None or not direct_ready(s, gen):
                return None
            for i in self.uses:
                x: Tensor = args[i]
                b = x._buffer
                if b.ptr is None or b.capture is not None or b.generation != b.device.generation:
                    return None  # the general path says why
            op._state = EXECUTING
            _counts["hits"] += 1
            if k is not None:
                accesses = (_buffers(args, st.writes), _buffers(args, st.reads))
                ev = _kernel.enqueue_direct(s, st.cfg, st.prepared, *accesses)
            elif st.ready:
                fn, static = st.ready  # type: ignore[misc]
                ev = direct_enqueue(s, fn, (static, _buffers(args, st.writes), _buffers(args, st.reads)))
            else:
                made = tuple([_make(sp, args, ()) for sp in st.specs])
                ev = direct_enqueue(s, lane_step, (st.fn, made))
                if st.ready is None:  # the first direct submission: prepare the next ones
                    st.prepare(made)
        return _make(self.result, args, ()), ev, self.ops

    def replay(self, plan: Plan, lane: Lane, args: tuple[Any, ...]) -> Tensor:
        """Append the recorded allocations and steps to ``plan`` on the views of ``args``:
        the same plan the build would make. Re-checked: that the operands' memory may be
        used by this plan (as the build's plan.use); the launches as _Launch._plan checks
        them, except a launch on operands only that this recipe saw prepared (it reuses
        the prepared launch, as the kernel's own cache would)."""
        _counts["hits"] += 1
        for i in self.uses:
            t = args[i]
            b = t._buffer
            if b.ptr is None or b.capture is not None or b.generation != b.device.generation:
                plan.use(b, t)
        bufs = [plan.new_buffer(lane, nbytes, what) for nbytes, what in self.allocs] if self.allocs else ()
        steps = plan.steps
        ops = plan.ops
        nops = len(ops)
        capture = plan.capture
        for st in self.steps:
            k = st.kernel
            if k is None:
                steps.append((st.fn, lane, tuple([_make(s, args, bufs) for s in st.specs])))
                continue
            largs = tuple([_make(s, args, bufs) for s in st.specs])
            if st.prepared is not None and capture is None:
                steps.append((_prepared_step, lane, (st.cfg, largs, st.prepared)))
                continue
            _Launch(k, largs, ())._plan(plan, lane, ())
            if st.pure and capture is None:
                last = steps[-1]
                if last[0] is _prepared_step:  # launched before: keep its prepared launch
                    st.set_prepared(last[2][0], last[2][2])
        del ops[nops:]
        ops.extend(self.ops)
        return _make(self.result, args, bufs)  # type: ignore[no-any-return]


def _record(op: LibraryOp, plan: Plan, lane: Lane, args: tuple[Any, ...], key: tuple[Any, ...]) -> Tensor:
    """Build ``op`` on ``args`` and cache the build as a recipe when it can be replayed."""
    global _recording
    nsteps, nlanes, nops = len(plan.steps), len(plan.lanes), len(plan.ops)
    outer = _recording
    rec = _recording = _Recording()
    try:
        result = op._build(plan, lane, *args)
    finally:
        _recording = outer
    _counts["misses"] += 1
    recipe = _recipe(rec, plan, lane, args, result, nsteps, nlanes, nops)
    if recipe is not None:
        while len(_cache) >= _CACHE_SIZE:
            del _cache[next(iter(_cache))]
        _cache[key] = recipe
    return result


def _recipe(
    rec: _Recording, plan: Plan, lane: Lane, args: tuple[Any, ...], result: Any, nsteps: int, nlanes: int, nops: int
) -> _Recipe | None:
    """The recipe of the build just made (its steps are plan.steps[nsteps:]), or None if
    it did something a recipe cannot replay (another lane, a step of an unknown kind, a
    tensor of memory that is neither an operand's nor allocated by the build)."""
    if len(plan.lanes) != nlanes:
        return None
    sources: dict[int, tuple[int, int]] = {}
    for i, a in enumerate(args):
        if type(a) is Tensor:
            sources.setdefault(id(a._buffer), (_OPERAND_VIEW, i))
    for j, (buf, ln, _, _) in enumerate(rec.allocs):
        if ln is not lane:
            return None
        sources[id(buf)] = (_ALLOC_VIEW, j)

    def tensor_spec(t: Any) -> tuple[int, Any] | None:
        for i, a in enumerate(args):
            if a is t:
                return (_OPERAND, i)
        src = sources.get(id(t._buffer))
        if src is None:
            return None
        kind, i = src
        a = args[i] if kind == _OPERAND_VIEW else None
        if (
            a is not None
            and a._offset == t._offset
            and a.shape == t.shape
            and a._strides == t._strides
            and a.dtype == t.dtype
            and a._tracked == t._tracked
        ):
            return (_OPERAND, i)  # the operand itself serves (its descriptors are cached)
        return (kind, (i, t._offset, t.shape, t._strides, t.dtype, t._tracked))

    def arg_spec(a: Any) -> tuple[int, Any] | None:
        t = type(a)
        if t is Tensor:
            return tensor_spec(a)
        if t is Partition:
            ts = tensor_spec(a.tensor)
            return None if ts is None else (_PARTITION, (ts, a.tile_shape, a.grid))
        if isinstance(a, (Tensor, Partition, DeviceOp, list, dict, set)):
            return None
        return (_CONST, a)

    steps: list[_Step] = []
    launches = iter(rec.launches)
    for fn, ln, arg in plan.steps[nsteps:]:
        if ln is not lane:
            return None
        if fn is _prepared_step or fn is _launch_step:
            k, largs = next(launches, (None, ()))
            if k is None or (arg[1] if fn is _prepared_step else arg[2]) is not largs:
                return None
        elif fn in _replayable:
            k, largs = None, arg
        else:
            return None
        maybe = [arg_spec(a) for a in largs]
        specs = [s for s in maybe if s is not None]
        if len(specs) != len(maybe):
            return None
        pure = all(s[0] in (_OPERAND, _OPERAND_VIEW, _CONST) or (s[0] == _PARTITION and s[1][0][0] != _ALLOC_VIEW) for s in specs)
        st = _Step(k, fn, specs, pure)
        if fn is _prepared_step and pure and plan.capture is None:
            st.set_prepared(arg[0], arg[2])
        steps.append(st)
    if next(launches, None) is not None:
        return None
    if type(result) is not Tensor:
        return None
    res: tuple[int, Any] | None = next(((_OPERAND, i) for i, a in enumerate(args) if a is result), None)
    if res is None:
        src = sources.get(id(result._buffer))
        if src is None:
            return None
        kind, i = src
        res = (kind, (i, result._offset, result.shape, result._strides, result.dtype, result._tracked))
    uses = tuple(i for i, a in enumerate(args) if type(a) is Tensor)
    allocs = [(nbytes, what) for _, _, nbytes, what in rec.allocs]
    return _Recipe(lane.device, uses, allocs, steps, Names(plan.ops[nops:]), res)


# -- devices, outputs, launches ---------------------------------------------------------------
def device_of(name: str, tensors: Sequence[Tensor], lane: Lane | None = None) -> Device:
    """The one device of ``tensors`` (the lane's when there are none)."""
    dev: Device | None = None
    for t in tensors:
        if dev is None:
            dev = t.device
        elif t.device is not dev:
            raise ValueError(
                f"{name}: tensors on devices {dev.ordinal} and {t.device.ordinal}; copy one with api.dup(t, device=...)"
            )
    if dev is None:
        if lane is None:
            raise ValueError(f"{name}: needs at least one tensor")
        lane_device: Device = lane.device
        return lane_device
    return dev


def alloc(plan: Plan, lane: Lane, shape: tuple[int, ...], dtype: np.dtype[Any], name: str) -> Tensor:
    """A new C-contiguous tensor the submission allocates on ``lane``'s device."""
    nbytes = nbytes_of(shape, dtype)
    what = f"{name}: a {dtype} result of shape {shape}"
    buf = plan.new_buffer(lane, nbytes, what)
    if _recording is not None:
        _recording.allocs.append((buf, lane, nbytes, what))
    return Tensor._new(buf, shape, dtype)


def check_out(name: str, out: Any, shape: tuple[int, ...], dtype: np.dtype[Any], device: Device | None) -> Tensor:
    """``out=``: a tensor of exactly ``shape``, on ``device``, that ``dtype`` casts to
    (numpy's same_kind rule)."""
    t = tensor_arg(out, name, "out= tensor")
    if t.shape != shape:
        raise ValueError(f"{name}: out= has shape {t.shape}, the result has shape {shape}")
    if t.dtype != dtype and not np.can_cast(half_proxy(dtype), half_proxy(t.dtype), "same_kind"):
        raise TypeError(f"{name}: cannot cast the {dtype} result to out= of dtype {t.dtype} (same_kind rule)")
    if device is not None and t.device is not device:
        raise ValueError(f"{name}: out= is on device {t.device.ordinal}, the inputs on device {device.ordinal}")
    return t


def _span(t: Tensor) -> tuple[int, int]:
    """The byte range [lo, hi) of the buffer that view ``t`` touches (empty: lo == hi)."""
    if 0 in t.shape:
        return t._offset, t._offset
    lo = hi = t._offset
    for n, s in zip(t.shape, t.strides, strict=True):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + t.dtype.itemsize


def overlaps(a: Tensor, b: Tensor) -> bool:
    """True if views ``a`` and ``b`` may share memory (same buffer, intersecting spans)."""
    if a._buffer is not b._buffer:
        return False
    (alo, ahi), (blo, bhi) = _span(a), _span(b)
    return alo < bhi and blo < ahi


def same_view(a: Tensor, b: Tensor) -> bool:
    return a._buffer is b._buffer and a._offset == b._offset and a.shape == b.shape and a.strides == b.strides


class Out:
    """Where an op computes: ``t`` is ``out=`` itself, a new tensor, or (when ``out=``
    shares memory with an input in a way the kernels cannot handle) a temporary that
    ``_elementwise.finish`` copies into ``back`` (``out=``) at the end, as numpy does for
    overlapping operands."""

    __slots__ = ("back", "t")

    def __init__(self, t: Tensor, back: Tensor | None) -> None:
        self.t = t
        self.back = back


def output(
    plan: Plan,
    lane: Lane,
    name: str,
    out: Any,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    device: Device,
    reads: Sequence[Tensor | None] = (),
    inplace_ok: bool = False,
    casts: bool = False,
) -> Out:
    """``out=`` checked, or a new tensor. ``reads``: the op's tensor inputs; with
    ``inplace_ok`` an input that is exactly ``out=`` (same view) is fine (elementwise).
    An ``out=`` of another dtype than the result gets a temporary of the result's dtype,
    cast into it at the end, unless the op's kernel casts as it stores (``casts``)."""
    if out is None:
        return Out(alloc(plan, lane, shape, dtype, name), None)
    t = check_out(name, out, shape, dtype, device)
    plan.use(t._buffer, t)
    if t.dtype != dtype and not casts:
        return Out(alloc(plan, lane, shape, dtype, name), t)
    for r in reads:
        if r is not None and overlaps(r, t) and not (inplace_ok and same_view(r, t)):
            return Out(alloc(plan, lane, shape, dtype, name), t)
    return Out(t, None)


def launch(plan: Plan, lane: Lane, kernel: Kernel, args: tuple[Any, ...]) -> None:
    """Plan a launch of ``kernel`` on ``lane`` (inside the op's own planning)."""
    if _recording is not None:
        _recording.launches.append((kernel, args))
    _Launch(kernel, args, ())._plan(plan, lane, ())


def out_partition(t: Tensor) -> Partition:
    """``t`` as a launch output (the op's kernel sets the geometry, not the tiles)."""
    return Partition._new(t, t.shape)


def flat_geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One thread per element of the first (output) argument, 256 per block."""
    n = math.prod(args[0].shape)
    return (max(1, -(-n // THREADS)),), (THREADS,)


def unrolled_geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Four elements of the first (output) argument per thread, 256 threads per block."""
    n = math.prod(args[0].shape)
    return (max(1, -(-n // (4 * THREADS))),), (THREADS,)


def rows_geometry(*args: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One block of 256 threads per row: the number of rows is the last argument."""
    return (min(max(1, int(args[-1])), MAX_ROW_BLOCKS),), (THREADS,)


def as_dtype(dtype: Any) -> np.dtype[Any]:
    return check_dtype(dtype)


def contiguous_strides(t: Tensor) -> tuple[int, ...]:
    return c_strides(t.shape, t.dtype.itemsize)
