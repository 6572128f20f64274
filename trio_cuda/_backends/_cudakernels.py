"""The CUDA backend's kernels: numba-cuda Python functions compiled once per (content key,
signature, compute capability) to PTX by numba's compiler, linked to a cubin by the
driver and cached on disk (``TRIO_CUDA_CACHE_DIR``, default ``~/.cache/trio-cuda``; only
kernels whose content key is stable), with their parameters pre-packed in numba's
argument layout so a launch is one driver call (numba's dispatcher is never on the
launch path)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .._errors import LaunchError
from ._boundary import ArrayArg, KernelSource, scalar_dtype

__all__ = ["Launcher", "Linker", "Prepared", "compile_cubin", "param_format", "param_values"]


class Linker(Protocol):
    """The device a kernel is compiled for: its compute capability and its linker."""

    ordinal: int
    compute_capability: tuple[int, int]

    def link(self, ptx: bytes, name: str) -> bytes: ...


_SCALAR_FORMATS = {
    # numba's argument packing: one slot per scalar (complex: real and imaginary slots).
    "b": ("b7x", 1),
    "B": ("B7x", 1),
    "?": ("B7x", 1),
    "h": ("h6x", 1),
    "H": ("H6x", 1),
    "i": ("i4x", 1),
    "I": ("I4x", 1),
    "l": ("q", 1),
    "L": ("Q", 1),
    "q": ("q", 1),
    "Q": ("Q", 1),
    "e": ("e6x", 1),
    "f": ("f4x", 1),
    "d": ("d", 1),
    "F": ("f4xf4x", 2),
    "D": ("dd", 2),
}


class Launcher:
    """One compiled kernel for one signature on one device."""

    __slots__ = ("fmt", "function", "module", "name", "slots")

    def __init__(self, module: Any, function: Any, fmt: str, nslots: int, name: str) -> None:
        self.module = module
        self.function = function
        self.fmt = fmt
        self.slots = nslots
        self.name = name


class Prepared:
    """A launch minus its stream: the function, the geometry and the packed parameters."""

    __slots__ = ("buf", "bx", "by", "bz", "fn", "function", "gx", "gy", "gz", "name", "params", "ptrs")

    def __init__(self, launcher: Launcher, grid: tuple[int, int, int], block: tuple[int, int, int], values: list[Any]) -> None:
        n = max(launcher.slots, 1)
        self.buf = (ctypes.c_uint64 * n)()
        struct.pack_into(launcher.fmt, self.buf, 0, *values)
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.params = ctypes.addressof(self.ptrs)
        self.function = launcher.function
        self.fn = int(launcher.function)  # the handle as an integer, for the fast path
        self.gx, self.gy, self.gz = grid
        self.bx, self.by, self.bz = block
        self.name = launcher.name


def _numba_signature(args: Sequence[Any]) -> tuple[Any, ...]:
    from numba import from_dtype, types

    sig = []
    for a in args:
        if type(a) is ArrayArg:
            layout = "C" if a.contiguous else "A"
            sig.append(types.Array(from_dtype(a.dtype), len(a.shape), layout, readonly=not a.writable))
        else:
            sig.append(from_dtype(scalar_dtype(a)))
    return tuple(sig)


def param_format(args: Sequence[Any]) -> tuple[str, int]:
    fmt = ["<"]
    slots = 0
    for a in args:
        if type(a) is ArrayArg:
            n = 5 + 2 * len(a.shape)
            fmt.append("q" * n)
            slots += n
        else:
            f, n = _SCALAR_FORMATS[scalar_dtype(a).char]
            fmt.append(f)
            slots += n
    return "".join(fmt), slots


def param_values(args: Sequence[Any]) -> list[Any]:
    vals: list[Any] = []
    for a in args:
        if type(a) is ArrayArg:
            vals.extend(a.numba_params())
        elif isinstance(a, (complex, np.complexfloating)):
            vals.extend((a.real, a.imag))
        elif isinstance(a, np.bool_):
            vals.append(bool(a))  # struct packs Python bools, not numpy's
        else:
            vals.append(a)
    return vals


def _cache_dir() -> pathlib.Path | None:
    d = os.environ.get("TRIO_CUDA_CACHE_DIR")
    path = pathlib.Path(d) if d else pathlib.Path.home() / ".cache" / "trio-cuda"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return None


_CACHE_FORMAT = "trio-cuda-kernel-cache-2"


def compile_cubin(device: Linker, source: KernelSource, args: Sequence[Any]) -> tuple[bytes, str]:
    """PTX from numba, linked to a cubin for this device; cached on disk by content."""
    import numba
    from numba.cuda import compile_ptx

    sig = _numba_signature(args)
    cc = device.compute_capability
    key_text = "|".join([_CACHE_FORMAT, numba.__version__, source.key, repr(sig), repr(cc)])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    cache = _cache_dir() if source.cacheable else None
    if cache is not None:
        cubin_path = cache / f"{key}.cubin"
        name_path = cache / f"{key}.name"
        if cubin_path.exists() and name_path.exists():
            return cubin_path.read_bytes(), name_path.read_text()
    try:
        ptx, _ = compile_ptx(source.py_func, sig, cc=cc)
    except Exception as err:  # numba's typing and lowering errors
        raise LaunchError(
            f"numba cannot compile the kernel for {sig}: {err}", op=f"kernel {source.name}", device=device.ordinal
        ) from err
    entry = None
    for line in ptx.splitlines():
        if ".entry" in line:
            entry = line.split(".entry", 1)[1].strip().split("(")[0].strip()
            break
    if entry is None:
        raise LaunchError("numba produced no kernel entry", op=source.name, device=device.ordinal)
    cubin = device.link(ptx.encode(), source.name)
    if cache is not None:
        for path, data in ((cubin_path, cubin), (name_path, entry.encode())):
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
    return cubin, entry
