"""benchmarks/gpu_check/: a package whose modules import only from the layers below their own (its ``LAYERS``),
so that it has no import circle; every module is in a layer, and the flat ``benchmarks/gpu_check_*.py`` modules it
replaced are gone."""

from __future__ import annotations

import ast
import sys

from tests.conftest import ROOT

PACKAGE = ROOT / "benchmarks" / "gpu_check"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def modules() -> dict[str, ast.Module]:
    """Each module of the package by its name under it (``sections.probes``), ``__init__`` files left out."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def imports(tree: ast.Module, known: set[str], own: str) -> set[str]:
    """The package's modules that ``tree`` imports anywhere (a function's imports too; ``from gpu_check.sections
    import probes`` names ``sections.probes``; a relative import is resolved from ``own``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = own.split(".")[:-node.level] if node.level <= own.count(".") + 1 else []
                base = ".".join(["gpu_check", *parent, *([base] if base else [])])
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("gpu_check.") and name[len("gpu_check."):] in known:
                out.add(name[len("gpu_check."):])
    return out


def layer_of() -> dict[str, int]:
    return {name.strip(): k for k, layer in enumerate(gpu_check.LAYERS) for name in layer.split("|")}


def test_every_module_imports_only_from_the_layers_below_its_own():
    """Red when a module imports one of its own layer or above (the circle the flat modules had:
    gpu_check_correctness imported gpu_check_preflight, which imported it back)."""
    found = modules()
    layers = layer_of()
    assert set(found) == set(layers), f"modules without a layer, or layers without a module: {set(found) ^ set(layers)}"
    upward = [f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]})"
              for name, tree in found.items() for target in sorted(imports(tree, set(found), name))
              if layers[target] <= layers[name]]
    assert upward == [], upward


def test_the_reader_finds_the_check_in_its_package_only():
    flat = sorted(p.name for p in (ROOT / "benchmarks").glob("gpu_check*.py"))
    assert flat == [], f"the GPU check's modules belong in benchmarks/gpu_check/: {flat}"
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert parts == {"workers", "sections", "page"}, parts


def test_an_import_of_a_higher_layer_is_found(tmp_path):
    """The reader of imports sees a function's import, a ``from package import module`` and a relative one."""
    tree = ast.parse("def f():\n    from gpu_check.sections import probes\n"
                     "from ..state import threads\nimport gpu_check.plan\n")
    assert imports(tree, {"sections.probes", "state", "plan", "sections.timed"}, "sections.timed") == {
        "sections.probes", "state", "plan"}
