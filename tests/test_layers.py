"""The package's layers import one way: kernel -> launcher -> worker -> channel -> Run ->
sinks/ui. A circle (type-checking imports and imports inside functions included) is a
design smell this test refuses; and the worker side imports no notebook machinery."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "nbtrain"


def import_graph() -> dict[str, set[str]]:
    """module -> the nbtrain modules it imports, wherever the import statement is."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                targets = subs or [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circles():
    graph = import_graph()
    assert "nbtrain.context" in graph and graph["nbtrain.launch"]  # the walk saw the package
    assert circles(graph) == []


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_run_and_launch_know_no_ui():
    graph = import_graph()
    for module in ("nbtrain.run", "nbtrain.launch", "nbtrain.errors", "nbtrain.telemetry.sinks"):
        assert not {m for m in graph[module] if m.startswith("nbtrain.ui")}, module


def test_the_worker_side_loads_no_notebook_machinery():
    code = ("import sys, nbtrain.context, nbtrain.strategies, nbtrain.launch.worker, "
            "nbtrain.launch.torchrun, nbtrain.launch.command, nbtrain.watch; "
            "print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('ipywidgets', 'plotly', 'IPython', 'ipykernel')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
