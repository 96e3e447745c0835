"""The package's shape: no import cycles (function-local imports count) and no function over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashdraft"
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative levels resolved against `current`)."""
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports anywhere in its body (module level or inside functions)."""
    mods = modules()
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(name, name in packages, node)
                # `from . import x` imports the submodule x; `from .m import f` imports m
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(module:function, lines) for every function or method longer than `limit` lines."""
    out = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append((f"{name}:{node.name}", n))
    return sorted(out, key=lambda x: -x[1])


def test_graph_sees_function_local_imports():
    graph = import_graph()
    assert graph, "no modules found"
    assert "flashdraft.errors" in graph["flashdraft.cli"] or any("flashdraft." in m for m in graph["flashdraft.cli"])


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles among flashdraft modules: {found}"


def test_no_function_longer_than_80_lines():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


EXEMPT_NAMES = {"log", "__all__"}  # a module's own logger, and its export list


def top_level_names(tree: ast.Module) -> set[str]:
    """Public names a module defines at top level: functions, classes and assigned names (imports are not
    definitions; names under `if TYPE_CHECKING:` or `try:` at top level count)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return {n for n in names if not n.startswith("_") and n not in EXEMPT_NAMES}


def defined_twice() -> dict[str, list[str]]:
    """Public top-level name → the modules defining it, for names defined in more than one flashdraft module."""
    where: dict[str, list[str]] = {}
    for name, tree in modules().items():
        for n in top_level_names(tree):
            where.setdefault(n, []).append(name)
    return {n: sorted(ms) for n, ms in sorted(where.items()) if len(ms) > 1}


def test_finder_sees_functions_classes_and_constants():
    tree = ast.parse("import os\nfrom x import y\nA = 1\nB: int = 2\n_c = 3\nlog = 4\n"
                     "def f(): pass\nclass K: pass\nif True:\n    G = 5\n")
    assert top_level_names(tree) == {"A", "B", "f", "K", "G"}


def test_every_public_name_is_defined_once():
    """A name means one thing across the package: a second definition is shared or renamed to say what it is."""
    found = defined_twice()
    assert not found, f"public names defined in more than one module: {found}"
