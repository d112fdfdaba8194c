"""The layering rules: ``sim/`` is the ground floor (it imports nothing from ``policies/``,
``executors/``, ``workloads/`` or ``experiments/``) and no two of the project's modules import
each other, directly or round a loop. Every import counts: module level, inside functions and
under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABOVE = ("policies", "executors", "workloads", "experiments")
PACKAGES = ("sim", *ABOVE)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = ("sim",)) -> dict[str, set[str]]:
    """Each module of ``packages`` -> the project modules it imports (``from a.b import c``
    counts as ``a.b.c`` where that is a module, else ``a.b``)."""
    modules = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names
                           if f"{node.module}.{a.name}" in modules)
        graph[name] = {m for m in out if m.split(".")[0] in PACKAGES} - {name}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    upward = {name: sorted(m for m in deps if m.split(".")[0] in ABOVE)
              for name, deps in graph.items()}
    return {k: v for k, v in upward.items() if v}


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop a depth-first search meets (each as the path round it)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    loops: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue  # a module outside the packages looked at
            if state.get(dep) == 1:
                loops.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return loops


def test_sim_imports_nothing_from_above():
    assert upward_imports(import_graph()) == {}


def test_no_two_modules_import_each_other():
    assert import_loops(import_graph(packages=PACKAGES)) == []


def test_the_checks_see_loops_and_upward_imports_of_every_kind(tmp_path):
    """The checker itself, on a made-up tree: a loop closed by an import inside a function,
    and an upward import under TYPE_CHECKING."""
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "a.py").write_text("from sim.b import x\n")
    (tmp_path / "sim" / "b.py").write_text("def f():\n    import sim.c\n")
    (tmp_path / "sim" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nimport sim.a\nif TYPE_CHECKING:\n"
        "    from policies.fcfs import FCFSPolicy\n")
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == {"sim.c": ["policies.fcfs"]}
    assert import_loops(graph) == [["sim.a", "sim.b", "sim.c", "sim.a"]]
