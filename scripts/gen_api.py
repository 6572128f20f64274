"""Generate docs/api.md, the API reference, from the docstrings of the public API.

The public API is what ``trio_cuda`` re-exports in ``__all__`` (plus ``trio_cuda.zip``,
left out of ``__all__`` so that ``from trio_cuda import *`` does not shadow the builtin),
and the public submodules ``trio_cuda.api``, ``trio_cuda.ops``, ``trio_cuda.lowlevel``,
``trio_cuda.kernels`` and, when it exists, ``trio_cuda.collectives``. For a submodule the
names are its ``__all__`` plus the public functions and classes defined in it (so
``ops.sum`` and its siblings, kept out of ``__all__`` for the same reason as ``zip``,
are listed too).

Each entry shows the signature (``inspect.signature``) and the docstring. The output
depends only on the source: the simulated backend is forced, the modules are imported
from their ``.py`` even where compiled ones were built (an extension type shows its
members differently), names are sorted, and memory addresses are scrubbed from default
values.

Usage::

    python3 scripts/gen_api.py           # writes docs/api.md
    python3 scripts/gen_api.py --check   # exits 1 if docs/api.md is not what it would write
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import inspect
import os
import pathlib
import re
import sys
import types
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _import_sources_first() -> None:
    """Have imports prefer a module's ``.py`` to a compiled extension beside it (modules
    with no ``.py``, such as the CUDA fast path, still load as extensions)."""
    m = importlib.machinery
    hook = m.FileFinder.path_hook(
        (m.SourceFileLoader, m.SOURCE_SUFFIXES),
        (m.ExtensionFileLoader, m.EXTENSION_SUFFIXES),
        (m.SourcelessFileLoader, m.BYTECODE_SUFFIXES),
    )
    sys.path_hooks.insert(0, hook)
    sys.path_importer_cache.clear()
OUT = ROOT / "docs" / "api.md"

# Submodules in the order they appear; (name, required). A missing optional module is
# skipped, so the script works before and after it lands.
MODULES = [
    ("trio_cuda", True),
    ("trio_cuda.api", True),
    ("trio_cuda.ops", True),
    ("trio_cuda.lowlevel", True),
    ("trio_cuda.kernels", True),
    ("trio_cuda.collectives", False),
]

def _isfunction(obj: Any) -> bool:
    """A function, also one of a module compiled by Cython (see trio_cuda._compiled),
    whose signature and docstring inspect reads as the source's."""
    return inspect.isfunction(obj) or type(obj).__name__ == "cython_function_or_method"


def _method_doc(cls: type, name: str, attr: Any) -> str | None:
    """``inspect.getdoc`` of method ``name`` of ``cls``, inherited along the MRO where it
    has none, as getdoc does for plain functions (but not for compiled ones)."""
    doc = inspect.getdoc(getattr(cls, name, attr))
    if doc is None:
        for base in cls.__mro__[1:]:
            if name in base.__dict__ and base.__dict__[name].__doc__:
                return inspect.cleandoc(base.__dict__[name].__doc__)
    return doc


# Public names deliberately kept out of a module's __all__.
EXTRA = {"trio_cuda": ["zip"]}

# Google-style section headers, rendered as bold labels with a list of their items.
SECTIONS = {"Args", "Arguments", "Attributes", "Raises", "Returns", "Yields", "Note", "Notes", "Example", "Examples"}

# Special methods worth a line in the reference (operators, protocols); the rest
# (__init__, __repr__, __del__, ...) are not listed.
SKIP_DUNDERS = {
    "__init__",
    "__new__",
    "__repr__",
    "__str__",
    "__del__",
    "__init_subclass__",
    "__class_getitem__",
    "__subclasshook__",
    "__getstate__",
    "__setstate__",
    "__reduce__",
    "__reduce_ex__",
    "__sizeof__",
    "__format__",
    "__dir__",
    "__eq__",
    "__ne__",
    "__hash__",
    "__getattribute__",
    "__setattr__",
    "__delattr__",
    "__weakref__",
    "__dict__",
    "__doc__",
    "__module__",
    "__slots__",
    "__annotations__",
    "__parameters__",
    "__orig_bases__",
    "__abstractmethods__",
    "__array_ufunc__",
    "__static_attributes__",
    "__firstlineno__",
    "__qualname__",
    "__type_params__",
}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
_PYTHON_FENCE = re.compile(r"^```python", re.MULTILINE)


def _import(name: str, required: bool) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if required or err.name != name:
            raise  # a missing dependency of an existing module is an error, not a skip
        return None


def _public_names(mod: types.ModuleType) -> list[str]:
    names = set(getattr(mod, "__all__", ()))
    names.update(EXTRA.get(mod.__name__, ()))
    if mod.__name__ != "trio_cuda":
        for name, obj in vars(mod).items():
            if name.startswith("_") or not (_isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) == mod.__name__:
                names.add(name)
    return sorted(names, key=lambda n: (n.lower(), n))


def _text(doc: str | None) -> str:
    """A docstring as markdown: RST roles and double backticks become code spans,
    Google-style sections become bold labels with lists."""
    if not doc:
        return "*(no docstring)*"
    doc = _ROLE.sub(lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", doc)
    doc = doc.replace("``", "`")
    out: list[str] = []
    section = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and stripped[:-1] in SECTIONS and line == stripped:
            section = True
            out.append("")
            out.append(f"**{stripped[:-1]}:**")
            out.append("")
            continue
        if section:
            if not stripped:
                continue
            if not line.startswith(" "):
                section = False
                out.append("")
                out.append(line)
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= 4:
                name, sep, rest = stripped.partition(":")
                if sep and " " not in name.strip():
                    out.append(f"- `{name.strip()}`:{rest}")
                else:
                    out.append(f"- {stripped}")
            else:
                out[-1] += " " + stripped
            continue
        out.append(line)
    return "\n".join(out).strip()


def _signature(obj: Any, name: str, *, drop_return: bool = False) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if drop_return:
        sig = sig.replace(return_annotation=inspect.Signature.empty)
    params = list(sig.parameters.values())
    if params and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) and sig.return_annotation is sig.empty:
        return None  # a refusing constructor (objects come from factories) says nothing
    sig = sig.replace(
        parameters=[p.replace(annotation=_ann(p.annotation)) for p in params],
        return_annotation=_ann(sig.return_annotation),
    )
    return _ADDRESS.sub("", f"{name}{sig}")


class _Annotation(str):
    """An annotation kept as a string (``from __future__ import annotations``), shown unquoted."""

    def __repr__(self) -> str:
        return str(self)


def _ann(a: Any) -> Any:
    return _Annotation(a) if isinstance(a, str) else a


def _code(text: str) -> list[str]:
    return ["```text", text, "```", ""]


# Objects documented so far in this run: id -> qualified name (see render()).
_documented: dict[int, str] = {}
# Every public class of the reference, filled before rendering.
_public_classes: set[type] = set()


def _members(cls: type) -> list[tuple[str, Any, type]]:
    """Public attributes of ``cls`` and of its non-public bases inside trio_cuda (members of
    a public base are documented there), first definition wins."""
    seen: dict[str, tuple[Any, type]] = {}
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("trio_cuda"):
            continue
        if klass is not cls and klass in _public_classes:
            continue
        for name, attr in vars(klass).items():
            if name in seen or name in SKIP_DUNDERS:
                continue
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                continue
            seen[name] = (attr, klass)
    return [(n, a, k) for n, (a, k) in sorted(seen.items(), key=lambda kv: (kv[0].startswith("__"), kv[0]))]


def _describe_class(qual: str, cls: type) -> list[str]:
    lines = [f"### class `{qual}`", ""]
    bases = [b for b in cls.__bases__ if b.__module__ not in ("builtins", "typing", "abc")]
    init = _signature(cls, qual.rsplit(".", 1)[-1], drop_return=True)
    if init is not None:
        lines += _code(init)
    if bases:
        shown = ", ".join(f"`{b.__name__}`" for b in bases)
        lines += [f"Bases: {shown}", ""]
    inherited = [b.__name__ for b in cls.__mro__[1:] if b in _public_classes]
    if inherited:
        lines += ["Inherits the members of " + ", ".join(f"`{n}`" for n in inherited) + " (documented there).", ""]
    lines += [_text(inspect.getdoc(cls)), ""]
    plain: list[str] = []
    for name, attr, owner in _members(cls):
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if isinstance(attr, property):
            lines += [f"#### `{qual}.{name}` (property)", "", _text(inspect.getdoc(attr)), ""]
        elif _isfunction(attr):
            doc = _method_doc(cls, name, attr)
            if name.startswith("__") and not attr.__doc__:
                plain.append(name)
                continue
            sig = _signature(attr, name)
            lines += [f"#### `{qual}.{name}`", ""]
            if sig is not None:
                lines += _code(sig)
            if owner is not cls:
                lines += [f"(from `{owner.__name__}`)", ""]
            lines += [_text(doc), ""]
    if plain:
        lines += ["Also defines: " + ", ".join(f"`{n}`" for n in plain) + ".", ""]
    return lines


def _describe(qual: str, obj: Any) -> list[str]:
    from trio_cuda import Kernel

    if inspect.ismodule(obj):
        return [f"### module `{qual}`", "", f"Documented in its own section below: `{obj.__name__}`.", ""]
    if (inspect.isclass(obj) or _isfunction(obj)) and id(obj) in _documented:
        return [f"### `{qual}`", "", f"The same object as `{_documented[id(obj)]}` (documented there).", ""]
    if inspect.isclass(obj) or _isfunction(obj):
        _documented[id(obj)] = qual
    if inspect.isclass(obj):
        return _describe_class(qual, obj)
    if isinstance(obj, Kernel):
        lines = [f"### kernel `{qual}`", ""]
        sig = _signature(obj, qual.rsplit(".", 1)[-1], drop_return=True)
        if sig is not None:
            lines += _code(sig)
        lines += [
            "A `trio_cuda.Kernel` launcher: calling it returns a DeviceOp whose output is the tuple of the resolved arguments.",
            "",
            _text(inspect.getdoc(obj)),
            "",
        ]
        return lines
    if callable(obj):
        lines = [f"### `{qual}`", ""]
        sig = _signature(obj, qual.rsplit(".", 1)[-1])
        if sig is not None:
            lines += _code(sig)
        lines += [_text(inspect.getdoc(obj)), ""]
        return lines
    return [f"### `{qual}`", "", "A constant:", "", *_code(f"{qual} = {_ADDRESS.sub('', repr(obj))}")]


def render() -> str:
    """The whole of docs/api.md."""
    os.environ["TRIO_CUDA_BACKEND"] = "sim"  # the reference does not depend on the backend
    os.environ["TRIO_CUDA_QUIET"] = "1"
    os.environ.pop("TRIO_CUDA_REQUIRE_COMPILED", None)  # (the sources are what it reads)
    sys.path.insert(0, str(ROOT))
    _import_sources_first()
    modules = [(name, m) for name, req in MODULES if (m := _import(name, req)) is not None]
    _documented.clear()
    _public_classes.clear()
    for _, mod in modules:
        _public_classes.update(o for n in _public_names(mod) if inspect.isclass(o := getattr(mod, n)))
    lines = [
        "# API reference",
        "",
        "Generated by `python3 scripts/gen_api.py` from the docstrings of the public API; do not",
        "edit by hand (`tests/docs/test_api_reference.py` fails when this file is stale). The guides",
        "explain how the pieces fit: [device operations](device-operations.md),",
        "[intro to async](intro-to-async.md), [runtime](runtime.md), [graphs](graphs.md),",
        "[ops](ops.md), [kernels](kernels.md).",
        "",
        "Modules:",
        "",
    ]
    lines += [f"- [`{name}`](#{name.replace('.', '')})" for name, _ in modules]
    lines.append("")
    for name, mod in modules:
        lines += [f"## {name}", "", _text(inspect.getdoc(mod)), ""]
        for attr in _public_names(mod):
            lines += _describe(f"{name}.{attr}", getattr(mod, attr))
    text = "\n".join(lines).rstrip() + "\n"
    text = re.sub(r"\n{3,}", "\n\n", text)
    if _PYTHON_FENCE.search(text):
        raise SystemExit("gen_api.py: a docstring contains a ```python fence; tests/docs/test_docs.py would run it")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else None
        if current != text:
            what = "missing" if current is None else "stale"
            print(f"{OUT.relative_to(ROOT)} is {what}: run `python3 scripts/gen_api.py`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
