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
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import numpy as np

from ._backends._boundary import KernelSource
from ._execution import Lane
from ._op import DeviceOp
from ._tensor import Partition, Tensor

__all__ = ["Kernel", "kernel"]

_SCALARS = (int, float, bool, complex, np.number, np.bool_)


def _check_dims(dims: Any, what: str) -> tuple[int, ...]:
    if isinstance(dims, int):
        dims = (dims,)
    dims = tuple(dims)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive ints, got {dims!r}")
    return dims


class Kernel(KernelSource):
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
    ) -> None:
        if not callable(fn):
            raise TypeError(f"kernel() needs a function, got {fn!r}")
        params = inspect.signature(fn).parameters.values()
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.default is not p.empty for p in params):
            raise TypeError(f"kernel {fn.__name__}: parameters must be plain positional (no defaults, *args or keywords)")
        self.py_func = fn
        self.name = name or fn.__name__
        self.nparams = len(list(params))
        self.block = _check_dims(block, "block") if block is not None else None
        self.host_impl = sim
        self._validate = validate
        self._plans: dict[tuple[Any, ...], Any] = {}
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"<trio_cuda.Kernel {self.name}>"

    def prepare(self, *args: Any) -> None:
        """Compile and load the kernel for these arguments now, and validate them.

        The first launch of a kernel for a new argument signature compiles it (numba,
        cached on disk) and loads it into the device, synchronously, which can stall the
        trio loop and, on CUDA, wait for work already running on the device. Call this
        at start-up with example tensors to pay that cost up front. ``args`` are what the
        launch will get: tensors, partitions and scalars (not ops); the device is theirs.
        """
        if len(args) != self.nparams:
            raise TypeError(f"kernel {self.name} takes {self.nparams} arguments, got {len(args)}")
        from ._execution import LOCK

        devices = {a.device for a in args if isinstance(a, (Tensor, Partition))}
        if len(devices) != 1:
            raise ValueError(f"kernel {self.name}: prepare() needs tensor arguments on one device")
        (device,) = devices
        with LOCK:
            plan = _Launch._plan(self, tuple(args), device)
            self._plans[_plan_key(tuple(args))] = plan

    def __call__(self, *args: Any) -> DeviceOp[tuple]:
        """A DeviceOp that launches this kernel on ``args``; its output is the tuple of args."""
        if len(args) != self.nparams:
            raise TypeError(f"kernel {self.name} takes {self.nparams} arguments, got {len(args)}")
        ops = []
        for i, a in enumerate(args):
            t = type(a)
            if t is Partition or t is Tensor or t is float or t is int:
                continue
            if isinstance(a, DeviceOp):
                ops.append(a)
            elif not isinstance(a, (Tensor, Partition) + _SCALARS):
                raise TypeError(
                    f"kernel {self.name} argument {i}: expected a DeviceOp, Tensor, Partition or scalar, "
                    f"got {type(a).__name__}"
                )
        return _Launch(self, args, tuple(ops))


def kernel(
    fn: Callable[..., Any] | None = None,
    *,
    block: Any = None,
    sim: Callable[..., Any] | None = None,
    validate: Callable[..., None] | None = None,
    name: str | None = None,
) -> Any:
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


class _Plan:
    """A validated launch of one kernel on one set of arguments, ready to enqueue."""

    __slots__ = ("device", "generation", "prepared", "writes", "reads")

    def __init__(self, device: Any, prepared: Any, writes: tuple[int, ...], reads: tuple[int, ...]) -> None:
        self.device = device
        self.generation = device._generation
        self.prepared = prepared
        self.writes = writes
        self.reads = reads


_PLAN_CACHE_SIZE = 512


def _plan_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    # Tensors contribute their cached ArrayArg objects (a new tensor, even at a recycled
    # address, has new ones), so the key holds no device memory alive.
    key = []
    for a in args:
        t = type(a)
        if t is Partition:
            key.append(a._key())
        elif t is Tensor:
            key.append(a._arg(False))
        else:
            key.append((t, a))
    return tuple(key)


class _Launch(DeviceOp[tuple]):
    __slots__ = ("_kernel", "_args", "_inputs_at")

    def __init__(self, k: Kernel, args: tuple[Any, ...], ops: tuple[DeviceOp[Any], ...]) -> None:
        self._inputs = ops
        self._state = None
        self._arity = len(args)
        self._kernel = k
        self._args = args
        self._inputs_at = tuple(i for i, a in enumerate(args) if isinstance(a, DeviceOp)) if ops else ()

    def _run(self, lane: Lane, values: Sequence[Any]) -> tuple:
        k = self._kernel
        args = self._args
        if values:
            pos = self._inputs_at
            if len(pos) == 1:
                i = pos[0]
                args = args[:i] + (values[0],) + args[i + 1 :]
            else:
                merged = list(args)
                for i, v in zip(pos, values):
                    merged[i] = v
                args = tuple(merged)
        device = lane.device
        try:
            key = _plan_key(args)
            plan = k._plans.get(key)
        except TypeError:  # an unhashable scalar-like value: validated (and refused) below
            key, plan = None, None
        if plan is None or plan.device is not device or plan.generation != device._generation:
            plan = self._plan(k, args, device)
            if key is not None:
                if len(k._plans) >= _PLAN_CACHE_SIZE:
                    k._plans.clear()
                k._plans[key] = plan
        s = lane.stream
        writes = [args[i].tensor._buffer for i in plan.writes]
        reads = [args[i]._buffer for i in plan.reads]
        if lane.capture is None:
            # Inline of Lane.write / Lane.read (the hot path of every launch).
            for b in writes:
                w = b.writer
                if w is not None and w[0] is not s:
                    s.wait_for(w[0], w[1])
                for r, rseq in b.readers.items():
                    if r is not s:
                        s.wait_for(r, rseq)
            for b in reads:
                w = b.writer
                if w is not None and w[0] is not s:
                    s.wait_for(w[0], w[1])
        else:
            for b in writes:
                lane.write(b)
            for b in reads:
                lane.read(b)
        device._driver.launch(plan.prepared, s.handle)
        s.seq += 1
        seq = s.seq
        for b in writes:
            b.writer = (s, seq)
            if b.readers:
                b.readers.clear()
        for b in reads:
            b.readers[s] = seq
        lane.ops.append(k.name)
        if lane.capture is None:
            device._stats.launches += 1
        return args

    @staticmethod
    def _plan(k: Kernel, args: tuple[Any, ...], device: Any) -> _Plan:
        """Validate the arguments against the device and build the launch (no GPU work)."""
        name = k.name
        grid: tuple[int, ...] | None = None
        tile: tuple[int, ...] | None = None
        kargs: list[Any] = []
        writes: list[int] = []
        reads: list[int] = []
        for i, a in enumerate(args):
            if isinstance(a, Partition):
                t = a.tensor
                if grid is None:
                    grid, tile = a.grid, a.tile_shape
                elif a.grid != grid:
                    raise ValueError(f"kernel {name}: partition arguments disagree on the tile grid: {grid} and {a.grid}")
                if t._tracked:
                    writes.append(i)
                kargs.append(t._arg(True))
            elif isinstance(a, Tensor):
                t = a
                if t._tracked:
                    reads.append(i)
                kargs.append(t._arg(False))
            elif isinstance(a, _SCALARS):
                kargs.append(a)
                continue
            else:
                raise TypeError(f"kernel {name} argument {i}: an op produced {type(a).__name__}, not a Tensor, Partition or scalar")
            if t.device is not device:
                raise ValueError(
                    f"kernel {name} argument {i} is on device {t.device.ordinal} but the launch runs on "
                    f"device {device.ordinal}; copy it with api.dup(t, device=...) or use_device()"
                )
            t._check_live()
        if grid is None:
            raise ValueError(f"kernel {name}: no Partition argument to take the launch grid from")
        if len(grid) > 3:
            raise ValueError(f"kernel {name}: a {len(grid)}-D tile grid cannot be launched (CUDA grids have at most 3 dims)")
        block = k.block or tile
        assert block is not None
        if len(block) > 3:
            raise ValueError(f"kernel {name}: a {len(block)}-D tile cannot be a block; pass block= to @kernel")
        if k._validate is not None:
            k._validate(*args)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        block3 = tuple(block) + (1,) * (3 - len(block))
        prepared = device._driver.prepare_launch(k, grid3, block3, kargs)
        return _Plan(device, prepared, tuple(writes), tuple(reads))
