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


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of a module but those under `if TYPE_CHECKING:` (imports for annotations only)."""
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
               for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if id(n) not in skipped]


def import_graph() -> dict[str, set[str]]:
    """module -> the hf_plookup modules it imports at run time (`from . import x` counts as
    importing `x`; imports under `if TYPE_CHECKING:` do not count)."""
    mods = _modules()
    extensions = _extensions()  # compiled modules: leaves
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
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
    assert "hf_plookup.cpu.kernels" in graph["hf_plookup.invariant.attention"]


def test_no_import_circle():
    assert find_cycle(import_graph()) == []


# The layers of docs/architecture.md, top to bottom: a module imports only modules of its own
# layer or of layers below it. A prefix names a package's modules, a full name one module.
LAYERS = [
    ["hf_plookup", "hf_plookup.api"],
    ["hf_plookup.generation", "hf_plookup.outputs", "hf_plookup.embedded"],
    ["hf_plookup.engine"],
    ["hf_plookup.steps"],
    ["hf_plookup.attention"],
    ["hf_plookup.invariant"],
    ["hf_plookup.mixers"],
    ["hf_plookup.cpu", "hf_plookup._cpu_kernels"],
    ["hf_plookup.drafting"],
    ["hf_plookup.stats"],
    ["hf_plookup.base"],
]


PACKAGES = {"hf_plookup.engine", "hf_plookup.attention", "hf_plookup.cpu", "hf_plookup.steps", "hf_plookup.mixers",
            "hf_plookup.drafting", "hf_plookup.invariant", "hf_plookup.base"}  # their __init__ modules import nothing


def layer_of(module: str, layers=LAYERS) -> int:
    """Index of the layer holding `module`: the layer of its longest matching name ("hf_plookup"
    itself matches only the package's own module)."""
    matches = [(len(n), i) for i, names in enumerate(layers) for n in names
               if module == n or (n != "hf_plookup" and module.startswith(n + "."))]
    if not matches:
        raise KeyError(f"{module} is in no layer of LAYERS")
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """(module, what it imports) where the import goes to a layer above the module's."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if layer_of(d, layers) < layer_of(m, layers))


def test_layer_order_literal_cases():
    layers = [["a"], ["a.b", "c"], ["a.b.low"]]
    assert layer_of("a.x", layers) == 0 and layer_of("a.b.y", layers) == 1 and layer_of("a.b.low", layers) == 2
    assert upward_imports({"a.x": {"c"}, "c": {"a.b.low"}}, layers) == []
    assert upward_imports({"a.b.low": {"c"}, "c": set()}, layers) == [("a.b.low", "c")]


def test_no_module_imports_one_above_it():
    """docs/architecture.md's layering, as LAYERS lists it: every module of the package is in a layer,
    and none imports from a layer above its own (the engine's loop holds no device code: how a step
    runs on a device is in steps/ and the layers below it)."""
    graph = {m: deps for m, deps in import_graph().items() if deps or m not in PACKAGES}
    for module in graph:
        layer_of(module)
    assert upward_imports(graph) == []
    assert not [m for m in graph if m.startswith("hf_plookup.engine.") and
                any(w in m for w in ("cpu", "cuda", "graphs", "triton", "huge_pages", "regional"))]


def test_c_kernels_are_built():
    """The package was installed with its C kernels (a C compiler was found): the fast CPU path.
    (Without them CPU steps still run, tests/cpu/test_without_c_kernels.py, slower.)"""
    from hf_plookup.cpu import kernels as cpu_kernels

    assert cpu_kernels.available()
