"""No import circle inside hf_plookup/: every module's hf_plookup imports (module level or inside
functions) form a graph without cycles, so each module can be read after the ones it uses."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hf_plookup"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _extensions() -> set[str]:
    """The compiled extension modules pyproject.toml declares."""
    text = (ROOT.parent / "pyproject.toml").read_text()
    return set(re.findall(r'\[\[tool\.setuptools\.ext-modules\]\]\s*name\s*=\s*"([^"]+)"', text))


def import_graph() -> dict[str, set[str]]:
    """module -> the hf_plookup modules it imports (`from . import x` counts as importing `x`)."""
    mods = _modules()
    extensions = _extensions()  # compiled modules: leaves
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in mods:
                        deps.add(full)
                    elif source in mods and full not in extensions:
                        deps.add(source)  # a name defined in `source`
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in mods)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_find_cycle_literal_cases():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": set(), "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]


def test_graph_sees_relative_and_function_level_imports():
    assert _extensions() == {"hf_plookup._cpu_kernels"}
    graph = import_graph()
    assert "hf_plookup.attention.pages" in graph["hf_plookup.attention.sdpa"]
    assert "hf_plookup.engine.cpu_kernels" in graph["hf_plookup.attention.invariant"]


def test_no_import_circle():
    assert find_cycle(import_graph()) == []


def test_c_kernels_are_built():
    """The package was installed with its C kernels (a C compiler was found): the fast CPU path.
    (Without them CPU steps still run, tests/engine/test_without_c_kernels.py, slower.)"""
    from hf_plookup.engine import cpu_kernels

    assert cpu_kernels.available()
