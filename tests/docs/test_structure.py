"""The layering the code keeps: no two packages of mlxr_core import each other, and the engine
imports neither the HTTP server nor the command line (imports under ``if TYPE_CHECKING:`` are
annotations only and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "mlxr_core").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    annotations_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name in known}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def test_no_two_core_packages_import_each_other() -> None:
    edges = {(_package(a), _package(b)) for a, targets in import_graph().items() for b in targets}
    edges = {(a, b) for a, b in edges if a != b}
    assert sorted((a, b) for a, b in edges if (b, a) in edges and a < b) == []


def test_the_engine_imports_neither_http_nor_cli() -> None:
    reaching = sorted(
        (a, b)
        for a, targets in import_graph().items()
        if a.startswith("mlxr_core.engine.")
        for b in targets
        if b.startswith(("mlxr_core.http", "mlxr_core.cli"))
    )
    assert reaching == []
