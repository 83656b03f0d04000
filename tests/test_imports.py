"""No import circle in the package: no module of rlhf/ imports, through any chain, a module that imports it back.

The rule: nodes are the modules under rlhf/ (a package is its ``__init__.py``); edges are every import statement
anywhere in a file (top level, inside functions, under ``TYPE_CHECKING``); ``from a import b`` points to ``a.b``
when that is a module, else to ``a``; the implicit import of a module's parent packages is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: the package's modules it imports} for every .py file under ``root / package``."""
    files = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # the package relative imports use
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name inside module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path back to itself for every module that can reach itself."""
    found = []
    for start in sorted(graph):
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            for nxt in sorted(graph[path[-1]]):
                if nxt == start:
                    found.append([*path, start])
                    paths = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append([*path, nxt])
    return found


def test_the_package_has_no_import_circle():
    found = circles(import_graph(ROOT, "rlhf"))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(path) for path in found)


def test_the_check_sees_imports_inside_functions_relative_ones_and_from_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.leaf import VALUE\n")
    (package / "sub" / "leaf.py").write_text("VALUE = 1\n")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n")
    (package / "c.py").write_text("import pkg.a\nfrom pkg.sub.leaf import VALUE\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a", "pkg.sub.leaf"}  # the parent package pkg.sub is not an edge
    assert circles(graph)[0] == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (package / "a.py").write_text("X = 1\n")
    assert not circles(import_graph(tmp_path, "pkg"))
