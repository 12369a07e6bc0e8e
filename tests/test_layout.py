"""The package layout is the architecture: the solver is torch-free, no modules import in a cycle
(imports inside functions count: they only hide a cycle), and the top level stays small."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).parents[1] / "hetcc"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in _imports(path) & set(modules):
            if target != name and not name.startswith(target + "."):  # a package's own __init__
                graph.add_edge(name, target)
    return graph


def test_no_module_imports_in_a_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not cycles, cycles


def test_the_solver_imports_nothing_from_torch():
    for path in (PACKAGE / "solver").glob("*.py"):
        for module in _imports(path):
            top = module.split(".")[0]
            assert top != "torch", f"{path.name} imports {module}"
            if top == "hetcc":
                allowed = module.startswith(("hetcc.solver", "hetcc.errors", "hetcc.config"))
                assert allowed or module == "hetcc", f"{path.name} imports {module}"


def test_the_top_level_holds_at_most_ten_modules():
    assert len(list(PACKAGE.glob("*.py"))) <= 10
