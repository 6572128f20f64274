"""The kernel launcher: numba-cuda kernel functions as DeviceOp factories.

::

    @trio_cuda.kernel
    def add(z, x, y):
        i, j = cuda.grid(2)
        if i < z.shape[0] and j < z.shape[1]:
            z[i, j] = x[i, j] + y[i, j]

    out = add(api.zeros((32, 32)).partition((4, 4)), x, y)   # a DeviceOp

Arguments may be DeviceOps, tensors, partitions and scalars, interchangeably. The
output of the launch op is the tuple of the (resolved) arguments. Partitions are the
outputs: the launch grid is their tile grid (all partition arguments must share it),
one block per tile, and the block shape is the tile shape unless the kernel fixes
one (``@kernel(block=...)``). Tensor arguments are read-only inputs. Dimension ``i``
of the tile grid maps to CUDA dimension ``x, y, z`` in order, so ``cuda.grid(2)``
gives ``(i, j)`` for element ``[i, j]``.

Kernels are identified by content (see :mod:`trio_cuda._fingerprint`): two kernels
with the same code, constants, closure values and globals share their compiled code,
and a kernel made at run time never runs another kernel's code. The first launch of a
kernel for a new argument signature compiles and loads it; under ``await`` that
happens in a worker thread, with the runtime lock released.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from ._backends._boundary import signature_of
from ._checks import arg_type, as_int, is_scalar
from ._direct import direct_enqueue, direct_ready, note_accesses, order_accesses
from ._errors import LaunchError
from ._fingerprint import fingerprint
from ._forecast import Names
from ._guard import LOCK, _tls, check_blocking_allowed, lock_acquire, lock_release
from ._needs import KernelNeed, load_kernels
from ._op import DeviceOp
from ._pending import EXECUTING
from ._plan import Lane, Plan
from ._stream import Event
from ._tensor import Partition, Tensor
from ._writes import written_params

if TYPE_CHECKING:
    from ._device import Device
    from ._memory import Buffer
    from ._stream import Stream

__all__ = ["Kernel", "kernel"]

_INT64 = (-(1 << 63), (1 << 63) - 1)


def _check_dims(dims: Any, what: str) -> tuple[int, ...]:
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    dims = tuple(dims)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must be 1 to 3 positive ints, got {dims!r}")
    return tuple(as_int(d, what, minimum=1) for d in dims)


class Kernel:
    """A launcher made by :func:`kernel`. Calling it returns a launch DeviceOp.

    Attributes:
        name: The kernel's name (used in errors).
        py_func: The Python kernel function.
        nparams: The number of parameters.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        block: Any = None,
        sim: Callable[..., Any] | None = None,
        validate: Callable[..., None] | None = None,
        name: str | None = None,
        geometry: Callable[..., tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        if not callable(fn) or not hasattr(fn, "__code__"):
            raise TypeError(f"kernel() needs a Python function, got {fn!r}")
        params = inspect.signature(fn).parameters.values()
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.default is not p.empty for p in params):
            raise TypeError(f"kernel {fn.__name__}: parameters must be plain positional (no defaults, *args or keywords)")
        self.py_func = fn
        self.name = name or fn.__name__
        self.nparams = len(list(params))
        self.block = _check_dims(block, "block") if block is not None else None
        self.host_impl = sim
        self._validate = validate
        # Internal (the op library): (grid, block) from the arguments, instead of the tiles.
        self._geometry = geometry
        self._configs: dict[tuple[Any, ...], _Config] = {}
        self._fast: dict[tuple[Any, ...], tuple[Device, int, _Config, Any]] = {}
        self._fp: Any = None
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    # -- KernelSource (what the backends build from) ---------------------------------
    @property
    def key(self) -> str:
        """The content key: equal keys compile to the same code."""
        fp = self._fp
        if fp is None:
            fp = self._fp = fingerprint(self.py_func)  # keeps the objects it depends on alive
        return str(fp.digest)

    @property
    def cacheable(self) -> bool:
        """True if the content key depends on content only (the disk cache may hold it)."""
        self.key  # noqa: B018 - computes the fingerprint
        return bool(self._fp.stable)

    def __repr__(self) -> str:
        return f"<trio_cuda.Kernel {self.name}>"

    def prepare(self, *args: Any) -> None:
        """Compile and load the kernel for these arguments now, and validate them.

        The first launch of a kernel for a new argument signature compiles it (numba,
        cached on disk) and loads it into the device. Under ``await`` that happens in a
        worker thread; call this at start-up (plain code, it blocks) with example tensors
        to pay the cost up front. ``args`` are what the launch will get: tensors,
        partitions and scalars (not ops); the device is theirs.
        """
        check_blocking_allowed("Kernel.prepare()")
        if len(args) != self.nparams:
            raise TypeError(f"kernel {self.name} takes {self.nparams} arguments, got {len(args)}")
        devices = {a.device for a in args if isinstance(a, (Tensor, Partition))}
        if len(devices) != 1:
            raise ValueError(f"kernel {self.name}: prepare() needs tensor arguments on one device")
        (device,) = devices
        with LOCK:
            cfg = _config(self, tuple(args), device)
            need = None if cfg.loaded is not None else KernelNeed(self, device, cfg.signature, cfg.proto)
        if need is not None:
            load_kernels([need])
            with LOCK:
                if cfg.loaded is None:
                    cfg.loaded = need.loaded

    def __call__(self, *args: Any) -> DeviceOp[tuple[Any, ...]]:
        """A DeviceOp that launches this kernel on ``args``; its output is the tuple of args."""
        if len(args) != self.nparams:
            raise TypeError(f"kernel {self.name} takes {self.nparams} arguments, got {len(args)}")
        ops: list[DeviceOp[Any]] | None = None  # (made only when an argument is an op)
        for i, a in enumerate(args):
            t = type(a)
            if t is Partition or t is Tensor or t is float or t is int:
                continue
            if isinstance(a, DeviceOp):
                if ops is None:
                    ops = []
                ops.append(a)
            elif not (isinstance(a, (Tensor, Partition)) or is_scalar(a)):
                raise TypeError(
                    f"kernel {self.name} argument {i}: expected a DeviceOp, Tensor, Partition or scalar, got {arg_type(a)}"
                )
        return _Launch(self, args, () if ops is None else tuple(ops))


@overload
def kernel(fn: Callable[..., Any], /) -> Kernel: ...
@overload
def kernel(
    fn: None = None,
    /,
    *,
    block: Any = None,
    sim: Callable[..., Any] | None = None,
    validate: Callable[..., None] | None = None,
    name: str | None = None,
) -> Callable[[Callable[..., Any]], Kernel]: ...
def kernel(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    block: Any = None,
    sim: Callable[..., Any] | None = None,
    validate: Callable[..., None] | None = None,
    name: str | None = None,
) -> Kernel | Callable[[Callable[..., Any]], Kernel]:
    """Decorate a numba-cuda kernel function into a launcher of DeviceOps.

    Args:
        fn: The kernel, written with ``numba.cuda`` (``cuda.grid``, ``cuda.threadIdx``, ...).
        block: A fixed block shape (1-3 ints) instead of the tile shape.
        sim: On the simulated device, call ``sim(*args)`` (numpy arrays and scalars)
            instead of simulating the kernel thread by thread: for kernels whose
            effect is time (sleeps) or that the simulator would run too slowly.
        validate: Called as ``validate(*args)`` with the resolved arguments before
            launching; raises ValueError/TypeError for bad input.
        name: A name for errors (default: the function's name).
    """

    def wrap(f: Callable[..., Any]) -> Kernel:
        return Kernel(f, block=block, sim=sim, validate=validate, name=name)

    return wrap(fn) if fn is not None else wrap


def _check_launch_config(name: str, grid: tuple[int, ...], block: tuple[int, ...], ordinal: int) -> None:
    """CUDA's limits on a launch, checked when the submission is planned (before any work)."""
    bx, by, bz = block
    gx, gy, gz = grid
    if bx > 1024 or by > 1024 or bz > 64 or bx * by * bz > 1024:
        raise LaunchError(
            f"too many threads per block: block={block} ({bx * by * bz} threads; at most 1024, and at most "
            "1024 x 1024 x 64 per dimension); pass a smaller tile or block= to @kernel",
            device=ordinal,
            op=f"kernel {name}",
        )
    if gx > 2**31 - 1 or gy > 65535 or gz > 65535:
        raise LaunchError(f"grid too large: {grid} (at most 2**31-1 x 65535 x 65535 blocks)", device=ordinal, op=f"kernel {name}")


class _Config:
    """A validated launch of one kernel on one argument geometry and device."""

    __slots__ = ("block", "device", "generation", "grid", "loaded", "name", "names", "proto", "reads", "signature", "writes")

    def __init__(
        self,
        device: Device,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        writes: tuple[int, ...],
        reads: tuple[int, ...],
        proto: list[Any],
        name: str,
    ) -> None:
        self.name = name  # the kernel's (traces label the launch with it)
        self.names = Names([name])  # what a fault of a direct launch names; the wait learns by it
        self.device = device
        self.generation = device.generation
        self.grid = grid
        self.block = block
        self.writes = writes  # positions of partitions (written)
        self.reads = reads  # positions of tensors (read)
        self.proto = proto  # layout-only arguments, for compiling
        self.signature = signature_of(proto)
        self.loaded: Any = None


_CACHE_SIZE = 512


def _scalar_key(a: Any) -> tuple[Any, ...]:
    """A scalar as a cache key: equal keys pass the same bits (-0.0 is not 0.0, 1 is not 1.0)."""
    t = type(a)
    if t is float:
        return (t, a, math.copysign(1.0, a))
    if t is complex:
        return (t, a, math.copysign(1.0, a.real), math.copysign(1.0, a.imag))
    if isinstance(a, np.generic):
        return (t, a.tobytes())
    return (t, a)


def _geometry(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a launch's validity depends on: each argument's layout, device, and value (scalars)."""
    key: list[Any] = []
    for a in args:
        t = type(a)
        if t is Partition:
            x = a.tensor
            key.append(("P", x.shape, x._strides, x.dtype.str, x._tracked, x._buffer.device.ordinal, a.tile_shape))
        elif t is Tensor:
            key.append(("T", a.shape, a._strides, a.dtype.str, a._tracked, a._buffer.device.ordinal))
        else:
            key.append(_scalar_key(a))
    return tuple(key)


def _config(k: Kernel, args: tuple[Any, ...], device: Device) -> _Config:
    """The validated launch config for ``args`` on ``device`` (cached by geometry)."""
    try:
        key = (device.ordinal, device.generation, _geometry(args))
        cfg = k._configs.get(key)
    except TypeError:  # an unhashable scalar-like value: validated (and refused) below
        key, cfg = None, None
    if cfg is None:
        cfg = _validate(k, args, device)
        if key is not None:
            if len(k._configs) >= _CACHE_SIZE:
                k._configs.clear()
            k._configs[key] = cfg
    if cfg.loaded is None:
        cfg.loaded = device._driver.loaded_kernel(k, cfg.signature)
    return cfg


def _validate(k: Kernel, args: tuple[Any, ...], device: Device) -> _Config:
    """Check the arguments against the device and build the launch config (no GPU work)."""
    name = k.name
    grid: tuple[int, ...] | None = None
    tile: tuple[int, ...] | None = None
    proto: list[Any] = []
    writes: list[int] = []
    reads: list[int] = []
    complex_arrays = False
    scalars: list[tuple[int, Any]] = []
    for i, a in enumerate(args):
        if isinstance(a, Partition):
            t = a.tensor
            if grid is None:
                grid, tile = a.grid, a.tile_shape
            elif a.grid != grid:
                raise ValueError(f"kernel {name}: partition arguments disagree on the tile grid: {grid} and {a.grid}")
            writes.append(i)
            proto.append(t._proto_arg(True))
        elif isinstance(a, Tensor):
            t = a
            reads.append(i)
            proto.append(t._proto_arg(False))
        elif is_scalar(a):
            scalars.append((i, a))
            proto.append(a)
            continue
        else:
            raise TypeError(f"kernel {name} argument {i}: an op produced {arg_type(a)}, not a Tensor, Partition or scalar")
        complex_arrays = complex_arrays or t.dtype.kind == "c"
        if t.device is not device:
            raise ValueError(
                f"kernel {name} argument {i} is on device {t.device.ordinal} but the launch runs on "
                f"device {device.ordinal}; copy it with api.dup(t, device=...) or use_device()"
            )
    for i, a in scalars:
        if isinstance(a, (complex, np.complexfloating)) and not complex_arrays:
            raise TypeError(
                f"kernel {name} argument {i}: a complex scalar ({a!r}) for a kernel whose arrays are all real; "
                "its imaginary part would be lost"
            )
        if isinstance(a, int) and not isinstance(a, bool) and not _INT64[0] <= a <= _INT64[1]:
            raise OverflowError(f"kernel {name} argument {i}: {a} does not fit a 64-bit integer")
    if grid is None:
        raise ValueError(f"kernel {name}: no Partition argument to take the launch grid from")
    written = written_params(k.py_func)
    for i in reads:
        if i in written:
            raise ValueError(
                f"kernel {name} stores into its argument {i} ({k.py_func.__code__.co_varnames[i]!r}), which got a "
                "Tensor: tensor arguments are read-only inputs; pass a Partition (tensor.partition(tile)) for an output"
            )
    if k._geometry is not None:
        grid, block = k._geometry(*args)
    elif k.block is not None:
        block = k.block
    else:
        assert tile is not None
        grid, block = _blocks_for(name, args[writes[0]].tensor.shape, grid, tile)
    if len(grid) > 3:
        raise ValueError(f"kernel {name}: a {len(grid)}-D tile grid cannot be launched (CUDA grids have at most 3 dims)")
    if len(block) > 3:
        raise ValueError(f"kernel {name}: a {len(block)}-D tile cannot be a block; pass block= to @kernel")
    if k._validate is not None:
        k._validate(*args)
    grid3 = ((*tuple(grid), 1, 1, 1))[:3]
    block3 = ((*tuple(block), 1, 1, 1))[:3]
    _check_launch_config(name, grid3, block3, device.ordinal)
    return _Config(device, grid3, block3, tuple(writes), tuple(reads), proto, name)  # type: ignore[arg-type]


def _blocks_for(
    name: str, shape: tuple[int, ...], grid: tuple[int, ...], tile: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grid, block) for a kernel without a fixed block: one block per tile when the tile
    fits in a block, else blocks that divide the tile (so ``cuda.grid`` still gives
    element indices) over the whole shape."""
    if math.prod(tile) <= 1024 or len(tile) > 3:
        return grid, tile
    block = list(tile)
    while math.prod(block) > 1024:
        i = max(range(len(block)), key=lambda d: block[d])
        t = tile[i]
        block[i] = max((d for d in range(1, block[i] // 2 + 1) if t % d == 0), default=1)
    return tuple(-(-n // b) for n, b in zip(shape, block, strict=False)), tuple(block)


def _prepared_key(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The identity of a launch's exact arguments, or None if some memory is not allocated
    yet (or an argument is not a tensor, partition or scalar).

    Tensors contribute their cached descriptors (a new buffer, even at a recycled
    address, has new ones), so the key holds no device memory alive.
    """
    key: list[Any] = []
    for a in args:
        kind = type(a)
        if kind is Partition:
            p: Partition = a
            k = p._k
            if k is None:
                if p.tensor._buffer.ptr is None:
                    return None
                k = p._key()
            key.append(k)
        elif kind is Tensor:
            t: Tensor = a
            d = t._args
            if d is None:
                if t._buffer.ptr is None:
                    return None
                key.append(t._arg(False))
            else:
                key.append(d[0])
        elif is_scalar(a):
            key.append(_scalar_key(a))
        else:
            return None  # (an op's output that a launch does not take: _config says why)
    return tuple(key)


def _prepare(k: Kernel, cfg: _Config, args: tuple[Any, ...], device: Device) -> Any:
    """The prepared launch (packed parameters) of these exact arguments (memory allocated)."""
    kargs = [a.tensor._arg(True) if type(a) is Partition else a._arg(False) if type(a) is Tensor else a for a in args]
    prepared = device._driver.prepare_launch(cfg.loaded, cfg.grid, cfg.block, kargs)
    key = _prepared_key(args)
    if key is not None:
        fast = k._fast
        if len(fast) >= _CACHE_SIZE:
            fast.clear()
        fast[key] = (device, device.generation, cfg, prepared)
    return prepared


def _launch_step(lane: Lane, arg: tuple[Kernel, _Config, tuple[Any, ...], KernelNeed | None, Any]) -> None:
    k, cfg, args, need, prepared = arg
    device = lane.device
    if prepared is None:
        if cfg.loaded is None:
            assert need is not None and need.loaded is not None
            cfg.loaded = need.loaded
        prepared = _prepare(k, cfg, args, device)
    if lane.plan.capture is None:
        _enqueue_launch(lane.stream, device, cfg, args, prepared)
        return
    s = lane.stream
    for i in cfg.writes:
        t = args[i].tensor
        lane.write(t._buffer, t._tracked)
    for i in cfg.reads:
        t = args[i]
        lane.read(t._buffer, t._tracked)
    if 0 not in cfg.grid:
        device._driver.launch(prepared, s.handle)
    seq = s.mark()
    for i in cfg.writes:
        t = args[i].tensor
        lane.wrote(t._buffer, seq, t._tracked)
    for i in cfg.reads:
        t = args[i]
        lane.was_read(t._buffer, seq, t._tracked)


def _prepared_step(lane: Lane, arg: tuple[_Config, tuple[Any, ...], Any]) -> None:
    cfg, args, prepared = arg
    _enqueue_launch(lane.stream, lane.device, cfg, args, prepared)


def _direct_launch_step(s: Stream, arg: tuple[Device, _Config, tuple[Any, ...], Any]) -> None:
    """A prepared launch as a direct submission's one step (see _direct.direct_enqueue)."""
    device, cfg, args, prepared = arg  # (unpacked: compiled, the call below is then a C call)
    _enqueue_launch(s, device, cfg, args, prepared)


def _enqueue_launch(s: Stream, device: Device, cfg: _Config, args: tuple[Any, ...], prepared: Any) -> None:
    """Enqueue a prepared launch on ``s`` (not capturing), ordered after the pending accesses
    of the buffers it uses on other streams, and registered as their writer or reader.
    The hot path of every launch: order_accesses / note_accesses inlined. Under LOCK."""
    wpos, rpos = cfg.writes, cfg.reads
    for i in wpos:
        p: Partition = args[i]
        t: Tensor = p.tensor
        if t._tracked:
            b: Buffer = t._buffer
            w = b.writer
            if w is not None and w[0] is not s:
                s.wait_for(w[0], w[1])
            if b.readers:
                for r, rseq in b.readers.items():
                    if r is not s:
                        s.wait_for(r, rseq)
    for i in rpos:
        t = args[i]
        if t._tracked:
            w = t._buffer.writer
            if w is not None and w[0] is not s:
                s.wait_for(w[0], w[1])
    if 0 not in cfg.grid:  # a launch over an empty tensor has nothing to run
        device._driver.launch(prepared, s.handle)
    s.seq += 1
    seq = s.seq
    for i in wpos:
        p = args[i]
        t = p.tensor
        b = t._buffer
        if t._tracked:
            b.writer = (s, seq)
            if b.readers:
                b.readers.clear()
        else:
            b.lifetime[s] = seq
    for i in rpos:
        t = args[i]
        b = t._buffer
        if t._tracked:
            b.readers[s] = seq
        else:
            b.lifetime[s] = seq
    device._stats.launches += 1


def enqueue_prepared(s: Stream, arg: tuple[_Config, Any, list[tuple[Any, bool]], list[tuple[Any, bool]]]) -> None:
    """_enqueue_launch of ``arg = (cfg, prepared, writes, reads)``, given the (buffer,
    tracked) pairs the launch writes and reads (a direct_enqueue step)."""
    cfg, prepared, writes, reads = arg
    order_accesses(s, writes, reads)
    device = s.device
    if 0 not in cfg.grid:  # a launch over an empty tensor has nothing to run
        device._driver.launch(prepared, s.handle)
    s.seq += 1
    note_accesses(s, s.seq, writes, reads)
    device._stats.launches += 1


def _launch_now(op: _Launch, s: Stream) -> tuple[Any, Event | None, list[str]] | None:
    """_Launch._submit_now, as a function (compiled, its objects are typed: see _kernel.pxd)."""
    if op._inputs or _tls.submitting:
        return None
    args = op._args
    k = op._kernel
    device = s.device
    key = _prepared_key(args)
    if key is None:
        return None
    hit = k._fast.get(key)
    if hit is None or hit[0] is not device:
        return None
    _, generation, cfg, prepared = hit
    # (acquire / release rather than `with`: half the cost, on every await)
    lock_acquire()
    try:
        if op._state is not None:
            return None
        for i in cfg.writes:
            p: Partition = args[i]
            if p.tensor._buffer.capture is not None:
                return None
        for i in cfg.reads:
            t: Tensor = args[i]
            if t._buffer.capture is not None:
                return None
        if not direct_ready(s, generation):
            return None
        op._state = EXECUTING
        ev = direct_enqueue(s, _direct_launch_step, (device, cfg, args, prepared))
    finally:
        lock_release()
    names = cfg.names
    if names[0] is not k.name:  # (a kernel renamed since: faults name it by its new name)
        names[0] = k.name
    return args, ev, names


class _Launch(DeviceOp[tuple[Any, ...]]):
    __slots__ = ("_args", "_inputs_at", "_kernel")

    def __init__(self, k: Kernel, args: tuple[Any, ...], ops: tuple[DeviceOp[Any], ...]) -> None:
        self._inputs = ops
        self._state = None
        self._arity = len(args)
        self._kernel = k
        self._args = args
        self._inputs_at = tuple(i for i, a in enumerate(args) if isinstance(a, DeviceOp)) if ops else ()

    def _submit_now(self, s: Stream) -> tuple[Any, Event | None, list[str]] | None:
        """Plan and enqueue this launch in one step when nothing about it is new: no op
        inputs, launched before with these exact arguments on this device, memory
        allocated, nothing to wait for, nothing to tidy up first. The same checks and the
        same effects as the general path, without building a plan (the common
        ``await kernel(tensors...)``). None: take the general path."""
        return _launch_now(self, s)

    def _plan(self, plan: Plan, lane: Lane, values: Sequence[Any]) -> tuple[Any, ...]:
        k = self._kernel
        args = self._args
        if values:
            pos = self._inputs_at
            if len(pos) == 1:
                i = pos[0]
                args = (*args[:i], values[0], *args[i + 1 :])
            else:
                merged = list(args)
                for i, v in zip(pos, values, strict=False):
                    merged[i] = v
                args = tuple(merged)
        device = lane.device
        # The hot path: these exact arguments were launched before on this device.
        key = _prepared_key(args)
        hit = k._fast.get(key) if key is not None else None
        if hit is not None and hit[0] is device and hit[1] == device.generation:
            cfg, prepared = hit[2], hit[3]
        else:
            cfg, prepared = _config(k, args, device), None
        for i in cfg.writes:
            t = args[i].tensor
            b = t._buffer
            if b.ptr is None or b.capture is not None or b.generation != b.device.generation:
                plan.use(b, t)
        for i in cfg.reads:
            t = args[i]
            b = t._buffer
            if b.ptr is None or b.capture is not None or b.generation != b.device.generation:
                plan.use(b, t)
        if prepared is not None and plan.capture is None:
            plan.steps.append((_prepared_step, lane, (cfg, args, prepared)))  # the hot path
        else:
            need = None
            if prepared is None and cfg.loaded is None:
                need = plan.need_kernel(k, device, cfg.signature, cfg.proto)
            plan.steps.append((_launch_step, lane, (k, cfg, args, need, prepared)))
        plan.ops.append(k.name)
        return args


def enqueue_direct(
    s: Stream, cfg: _Config, prepared: Any, writes: list[tuple[Any, bool]], reads: list[tuple[Any, bool]]
) -> Event | None:
    """The direct submission of a replayed op whose recipe is one prepared launch
    (_ops._core._Recipe.submit_now; under LOCK, checked): its one step, enqueued."""
    return direct_enqueue(s, enqueue_prepared, (cfg, prepared, writes, reads))
