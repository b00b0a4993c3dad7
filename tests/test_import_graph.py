"""No import circles between our modules (issue #16).

The graph is read from the sources: an edge a -> b for every import of b that
runs when a is imported (module-level statements, ``if``/``try`` blocks
included; imports inside functions run later and do not count). Packages
count as their ``__init__``; ``from pkg import x`` is an edge to the submodule
pkg.x where x is one, else to pkg. A circle means a module can see a half-initialised
other one depending on which is imported first.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"spec_plugins": ROOT / "spec_plugins", "spec_tree_kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package,) + parts)] = path
    return out


def import_statements(tree: ast.Module, lazy: bool):
    """Import statements executed on import (the module body and the bodies
    of its top-level if / try / with blocks), and with ``lazy`` also those
    inside functions (they run on first call)."""
    if lazy:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    todo.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
        elif isinstance(node, ast.ClassDef):
            todo.extend(n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def imported_modules(name: str, path: Path, known: set[str], lazy: bool = False) -> set[str]:
    is_package = path.name == "__init__.py"
    out = set()
    for node in import_statements(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from base import x``: the submodule base.x where x is one, else a name of base
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            # the deepest of our modules the import names (a package's __init__ runs too)
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def build_graph(lazy: bool = False) -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known, lazy) for name, path in files.items()}


def test_no_import_circles():
    cycle = find_cycle(build_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_circles_through_imports_inside_functions():
    """A lazy import that closes a circle hides a dependency the other way
    (the SGLang engine_patches <-> worker pair of issue #16)."""
    cycle = find_cycle(build_graph(lazy=True))
    assert cycle is None, "import circle (with imports inside functions): " + " -> ".join(cycle)


def test_the_check_finds_a_circle():
    """The checker itself: a two-module circle and a package/child circle are found."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"p": {"p.x"}, "p.x": {"p.y"}, "p.y": {"p.x"}}) == ["p.x", "p.y", "p.x"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_reads_relative_and_conditional_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\ntry:\n    from .c import thing\nexcept ImportError:\n    pass\n"
                              "def later():\n    from . import d\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    assert imported_modules("pkg.a", pkg / "a.py", known) == {"pkg.b", "pkg.c"}
    assert imported_modules("pkg.a", pkg / "a.py", known, lazy=True) == {"pkg.b", "pkg.c", "pkg.d"}
    (pkg / "e.py").write_text("from pkg import a, VALUE\nimport pkg.d.x\n")
    assert imported_modules("pkg.e", pkg / "e.py", known) == {"pkg.a", "pkg", "pkg.d"}
