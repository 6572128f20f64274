"""The package's shape: imports point only downward; the public faces are small."""

from __future__ import annotations

import ast
import builtins
import pathlib

import trio_cuda

PACKAGE = pathlib.Path(trio_cuda.__file__).resolve().parent


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """Every sibling module ``path`` imports, wherever the import stands: function-local
    imports count, and so do imports under ``if TYPE_CHECKING:`` (a type a module names
    is a dependency of its layer, even if the import never runs)."""
    me = _module(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                for cand in (f"{base}.{alias.name}", base):
                    if cand in known:
                        out.add(cand)
                        break
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
    out.discard(me)
    return out


def test_no_import_cycles() -> None:
    files = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and "kernels" not in p.parts]
    known = {_module(p) for p in files}
    inits = {_module(p) for p in files if p.name == "__init__.py"}
    graph = {_module(p): {m for m in _imports(p, known) if m not in inits} for p in files}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                cycle = [*path[path.index(w) :], w]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if w not in state:
                visit(w)
        path.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            visit(v)
    assert len(graph) > 20


def test_star_import_does_not_shadow_builtins() -> None:
    namespace: dict[str, object] = {}
    exec("from trio_cuda import *", namespace)
    shadowed = sorted(set(namespace) & set(dir(builtins)) - {"__builtins__"})
    assert shadowed == []
    assert trio_cuda.zip is not builtins.zip  # still there, by its qualified name


def test_public_faces() -> None:
    from trio_cuda import lowlevel

    for name in (
        "Stream",
        "Event",
        "SchedulingPolicy",
        "SingleStream",
        "StreamPoolRoundRobin",
        "record",
        "stream_wait",
        "wait",
        "submit",
        "accesses",
    ):
        assert hasattr(lowlevel, name), name
    for name in ("SchedulingPolicy", "SingleStream", "StreamPoolRoundRobin", "DeviceReset", "lowlevel"):
        assert name in trio_cuda.__all__, name
    assert all(not n.startswith("_") for n in trio_cuda.__all__)


def test_the_package_and_its_metadata_agree_on_the_version() -> None:
    import tomllib

    meta = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["version"] == trio_cuda.__version__


def test_ops_namespace_holds_no_planning_helpers() -> None:
    from trio_cuda import ops

    # copy_into(plan, lane, dst, src, name) and contiguous(plan, lane, src) plan steps of
    # other ops; they are not ops themselves
    for name in ("copy_into", "contiguous"):
        assert not hasattr(ops, name), name
    assert callable(ops.copy)  # the public copy stays


def test_every_module_is_about_800_lines_at_most() -> None:
    # One noun per module: a module that outgrows this holds two.
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 40  # the walk found the package's modules
    over = {name: n for name, n in sizes.items() if n > 800}
    assert not over, f"modules over 800 lines: {over}"
