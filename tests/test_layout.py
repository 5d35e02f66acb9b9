"""The package's layout stays as docs/architectures.md describes it: no import circle between its
files, no module past 600 lines.

An import circle is found from the source text (ast), not from what happens to be imported at run
time: every `import` counts, at module level and inside functions. Importing `tpshard.a.b` from
outside the package `tpshard.a` also runs `tpshard/a/__init__.py`, so that counts as an import of
the package's `__init__` too; from inside `tpshard.a` it does not (the package is already being
imported when one of its modules runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tpshard"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The tpshard modules `path` (module `name`) imports, each resolved to a file."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        """`target` and, where it is imported from outside them, the packages above it."""
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            inside = name == mod or name.startswith(mod + ".")
            if mod in modules and (i == len(parts) or not inside):
                found.add(mod)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tpshard":
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tpshard":
                continue
            add(target)
            for alias in node.names:  # `from tpshard.a import b` where b is a module
                if f"{target}.{alias.name}" in modules:
                    add(f"{target}.{alias.name}")
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, name, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    """Every file's imports, inside functions too: no group of files imports itself round."""
    graph = import_graph()
    found = circles(graph)
    described = []
    for component in found:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        described.append(f"circle of {len(component)}: " + "; ".join(edges))
    assert not found, "\n".join(described)


def test_no_module_past_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_circle_finder_finds_circles():
    """The test above can fail: a two-file circle, one through a package's __init__, and a chain
    with no circle."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"p": {"p.x"}, "p.x": {"q"}, "q": {"p"}}) == [["p", "p.x", "q"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_resolved_to_files(tmp_path):
    """Imports inside functions count, `from pkg import module` names the module, and importing a
    package's module from outside it also counts as importing the package's __init__."""
    global PACKAGE
    root = tmp_path / "tpshard"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("from tpshard.a.low import x\n")
    (root / "a" / "low.py").write_text("x = 1\n")
    (root / "a" / "top.py").write_text("def f():\n    from tpshard.b import y\n")
    (root / "b.py").write_text("from tpshard.a.low import x\ny = x\n")
    saved, PACKAGE = PACKAGE, root
    try:
        graph = import_graph()
    finally:
        PACKAGE = saved
    assert graph["tpshard.a"] == {"tpshard.a.low"}  # its own package is not counted
    assert graph["tpshard.a.top"] == {"tpshard.b"}
    assert graph["tpshard.b"] == {"tpshard.a", "tpshard.a.low"}
