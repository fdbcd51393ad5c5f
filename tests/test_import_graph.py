"""Imports, read from the source: roles share only fedsynth, benchmarks use public entry points, the shared library's
rooms import only the rooms below them, and nothing is circular."""

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


# The shared library's rooms and top-level modules, and what each may import inside fedsynth (cli: anything).
ROOMS_MAY_IMPORT = {
    "errors": set(),
    "config_schema": {"errors"},
    "v1": set(),
    "config": {"errors", "config_schema"},
    "wire": {"errors", "config_schema", "v1"},
    "process": {"errors", "config_schema", "wire"},
    "learning": {"errors", "config_schema", "config"},
    "allocation": {"errors", "config_schema"},
    "algorithms": {"errors", "config_schema", "config", "learning", "wire"},
    "generation": {"errors", "config_schema", "config", "v1", "wire", "process"},
    "plan": {"errors", "config_schema", "config", "allocation", "learning"},
    "assembly": {"errors", "config_schema", "config", "learning", "algorithms"},
    "secagg": {"errors"},
}


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_each_room_imports_only_the_rooms_below_it() -> None:
    upward = [
        (source, target)
        for source, targets in GRAPH.items()
        if source.startswith("fedsynth.") and _room(source) != "cli"
        for target in targets
        if target.startswith("fedsynth.") and _room(target) != _room(source)
        and _room(target) not in ROOMS_MAY_IMPORT[_room(source)]
    ]
    assert upward == []


def test_the_shared_library_has_at_most_ten_top_level_modules_each_a_known_room() -> None:
    top = sorted(p.stem for p in (ROOT / "fedsynth").glob("*.py") if p.stem != "__init__")
    rooms = sorted(p.name for p in (ROOT / "fedsynth").iterdir() if (p / "__init__.py").is_file())
    assert len(top) <= 10, top
    assert set(top) | set(rooms) == set(ROOMS_MAY_IMPORT) | {"cli"}
    for room in rooms:
        assert ast.get_docstring(ast.parse((ROOT / "fedsynth" / room / "__init__.py").read_text())), room
