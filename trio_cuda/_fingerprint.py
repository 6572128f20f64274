"""Kernel identity by content: what numba compiles, never ``id()``.

A kernel made at run time (a closure from a factory) gets a new Python object each
time, and Python reuses the ids of dead objects; a cache keyed by ``id`` then runs a
dead kernel's code. A disk cache keyed by file, name and line ignores closure cells and
globals, so the same bug crosses processes. The fingerprint here covers what numba
freezes into the compiled code:

* the function's bytecode, constants (recursively, nested code objects included),
  names and defaults;
* the values of its closure cells;
* the values of the globals it references (numbers, strings, bools, None, tuples,
  numpy scalars, dtypes and arrays by content; modules by name; functions, numba
  device functions and intrinsics recursively by their own fingerprint).

A value that cannot be characterized by content (an arbitrary object) makes the
fingerprint *unstable*: it then includes the object's identity and the caller keeps
the object alive for as long as the fingerprint is used, so the id cannot be reused;
such kernels are not cached on disk.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
import sys
import types
from typing import Any

import numpy as np

__all__ = ["Fingerprint", "fingerprint"]


class Fingerprint:
    """The content key of a kernel function.

    Attributes:
        digest: A hex digest of the content.
        stable: True if the digest depends on content only (safe to cache on disk).
        pins: Objects whose identity went into the digest; hold them while it is used.
    """

    __slots__ = ("digest", "pins", "stable")

    def __init__(self, digest: str, stable: bool, pins: tuple[Any, ...]) -> None:
        self.digest = digest
        self.stable = stable
        self.pins = pins

    def __repr__(self) -> str:
        return f"Fingerprint({self.digest[:16]}..., stable={self.stable})"


class _Hasher:
    def __init__(self) -> None:
        self.names: list[str] = []  # names the code looks up (for module attributes)
        self.h = hashlib.sha256()
        self.stable = True
        self.pins: list[Any] = []
        self.seen: dict[int, int] = {}

    def put(self, tag: str, data: bytes = b"") -> None:
        self.h.update(tag.encode())
        self.h.update(len(data).to_bytes(8, "little"))
        self.h.update(data)

    def unstable(self, obj: Any) -> None:
        self.stable = False
        self.pins.append(obj)
        self.put("id", f"{type(obj).__qualname__}:{id(obj)}".encode())

    def value(self, v: Any, depth: int = 0) -> None:
        if depth > 50:
            self.unstable(v)
            return
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            self.put(type(v).__name__, repr(v).encode())
        elif isinstance(v, (tuple, list, frozenset)):
            items = sorted(v, key=repr) if isinstance(v, frozenset) else v
            self.put(type(v).__name__, str(len(items)).encode())
            for x in items:
                self.value(x, depth + 1)
        elif isinstance(v, np.ndarray):
            self.put("ndarray", f"{v.dtype.str}{v.shape}".encode())
            self.put("data", np.ascontiguousarray(v).tobytes())
        elif isinstance(v, np.generic):
            self.put("npscalar", v.dtype.str.encode() + np.asarray(v).tobytes())
        elif isinstance(v, np.dtype):
            self.put("dtype", v.str.encode())
        elif isinstance(v, types.ModuleType):
            self.put("module", v.__name__.encode())
            # numba freezes the module attributes a kernel reads (mod.CONST) into the code.
            for name in self.names:
                attr = getattr(v, name, None)
                if _plain(attr):
                    self.put("attr", name.encode())
                    self.value(attr, depth + 1)
        elif isinstance(v, types.CodeType):
            self.code(v, depth + 1)
        elif isinstance(v, types.FunctionType):
            self.function(v, depth + 1)
        elif isinstance(v, enum.Enum):
            self.value(type(v), depth + 1)
            self.put("member", v.name.encode())
        elif isinstance(v, type):
            if _importable(v):
                self.put("type", f"{v.__module__}.{v.__qualname__}".encode())
            elif issubclass(v, enum.Enum):  # a local enum: by its members (numba freezes them)
                self.put("enum", v.__qualname__.encode())
                for m in v:
                    self.put("member", m.name.encode())
                    self.value(m.value, depth + 1)
            else:  # a local class: two of them may share a name but not a meaning
                self.unstable(v)
        elif type(v).__module__.startswith("numba.") and hasattr(v, "mangling_args"):
            # numba types (float64, int32[:], ...) are immutable and named by their repr.
            self.put("numbatype", repr(v).encode())
        else:
            py_func = getattr(v, "py_func", None)  # numba dispatchers (device functions)
            if isinstance(py_func, types.FunctionType):
                self.put("dispatcher", type(v).__qualname__.encode())
                self.function(py_func, depth + 1)
                return
            definition = getattr(v, "_definition_func", None)  # numba @intrinsic
            if isinstance(definition, types.FunctionType):
                self.put("intrinsic", type(v).__qualname__.encode())
                self.function(definition, depth + 1)
                return
            if callable(v) and hasattr(v, "__module__") and hasattr(v, "__qualname__"):
                # A builtin or extension function (math.sqrt, cuda.grid): by name.
                self.put("callable", f"{v.__module__}.{v.__qualname__}".encode())
                return
            self.unstable(v)

    def code(self, code: types.CodeType, depth: int) -> None:
        self.put("code", code.co_code)
        self.put("names", repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)).encode())
        self.put("argcount", repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)).encode())
        for c in code.co_consts:
            self.value(c, depth + 1)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        key = id(fn)
        if key in self.seen:  # recursion (a function referring to itself)
            self.put("backref", str(self.seen[key]).encode())
            return
        self.seen[key] = len(self.seen)
        self.pins.append(fn)
        self.put("function", f"{fn.__module__}.{fn.__qualname__}".encode())
        self.code(fn.__code__, depth)
        self.value(fn.__defaults__, depth + 1)
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                self.put("emptycell")
                continue
            self.value(contents, depth + 1)
        g = fn.__globals__
        names = _global_names(fn.__code__)
        self.names = sorted(set(self.names) | set(names))
        for name in names:
            if name in g:
                self.put("global", name.encode())
                self.value(g[name], depth + 1)
            else:
                self.put("builtin" if hasattr(builtins, name) else "unbound", name.encode())


def _importable(cls: type) -> bool:
    """True if ``cls`` is what its module and qualified name find (not a local class)."""
    obj: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


def _plain(v: Any) -> bool:
    """Plain data a module may hold for kernels to read (a constant, not code)."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, np.generic, np.ndarray, np.dtype, enum.Enum)):
        return True
    return isinstance(v, tuple) and all(_plain(x) for x in v)


def _global_names(code: types.CodeType) -> list[str]:
    """Names a code object (and its nested code objects) may look up as globals."""
    names: list[str] = []
    stack = [code]
    while stack:
        c = stack.pop()
        names.extend(c.co_names)
        stack.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
    return sorted(set(names))


def fingerprint(fn: Any) -> Fingerprint:
    """The content fingerprint of kernel function ``fn``."""
    h = _Hasher()
    if isinstance(fn, types.FunctionType):
        h.function(fn, 0)
    else:
        h.value(fn)
    return Fingerprint(h.h.hexdigest(), h.stable, tuple(h.pins))
