"""Imports, read from the source: roles share only fedsynth, benchmarks use public entry points, and nothing is circular."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("coordinator", "client_node", "generator_service")
PACKAGES = ("fedsynth", *ROLES, "deploy", "benchmarks")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every module each one imports, wherever the import stands (TYPE_CHECKING blocks and functions included)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


GRAPH = _imports(_modules())


def test_roles_and_the_shared_library_import_no_other_role() -> None:
    crossing = [
        (source, target)
        for source, targets in GRAPH.items()
        for target in targets
        if source.split(".")[0] in ("fedsynth", *ROLES, "deploy")
        and target.split(".")[0] in (*ROLES, "deploy", "benchmarks")
        and target.split(".")[0] != source.split(".")[0]
    ]
    assert crossing == []


def test_benchmarks_reach_a_role_only_through_its_package() -> None:
    internal = [(s, t) for s, targets in GRAPH.items() if s.startswith("benchmarks.") for t in targets if t.split(".")[0] in ROLES and "." in t]
    assert internal == []


def test_no_module_imports_itself_through_a_circle() -> None:
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for target in GRAPH[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    assert sorted(name for name in GRAPH if name in reach(name)) == []
