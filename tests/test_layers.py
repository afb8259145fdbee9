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


# Per room, the rooms its modules may not import (every module of the room is checked,
# its package's __init__ too). The notebook's UI is reached only through the Run's view
# registry; a rank's code knows nothing of the kernel's side; the wire imports nothing.
FORBIDDEN = {
    "nbtrain.wire": ("nbtrain",),
    "nbtrain.display_record": ("nbtrain",),
    "nbtrain.deviceplan": ("nbtrain",),
    "nbtrain.rank": ("nbtrain.launch", "nbtrain.run", "nbtrain.scaleout",
                     "nbtrain.ui", "nbtrain.magics", "nbtrain.cells"),
    "nbtrain.launch": ("nbtrain.ui", "nbtrain.magics"),
    "nbtrain.run": ("nbtrain.ui", "nbtrain.launch", "nbtrain.rank"),
    "nbtrain.errors": ("nbtrain.ui", "nbtrain.launch", "nbtrain.rank"),
    "nbtrain.telemetry": ("nbtrain.ui", "nbtrain.launch", "nbtrain.rank", "nbtrain.run"),
    "nbtrain.strategies": ("nbtrain.ui", "nbtrain.launch", "nbtrain.rank", "nbtrain.run"),
    "nbtrain.context": ("nbtrain.ui", "nbtrain.launch", "nbtrain.rank", "nbtrain.run"),
}
# (none: the device plan, which strategies check, is plain data in nbtrain/deviceplan.py)
ALLOWED: set[tuple[str, str]] = set()


def test_each_module_imports_only_what_its_room_may():
    graph = import_graph()
    checked = 0
    for module, imports in graph.items():
        for room, forbidden in FORBIDDEN.items():
            if module != room and not module.startswith(room + "."):
                continue
            checked += 1
            bad = {m for m in imports if m.startswith(forbidden) and (room, m) not in ALLOWED}
            assert not bad, f"{module} imports {sorted(bad)}, which {room} may not"
    assert checked >= 35  # every module of those rooms, not one node per package


def test_a_launch_module_that_imported_the_ui_would_be_caught():
    graph = import_graph()
    graph["nbtrain.launch.pool.ranks"] = graph["nbtrain.launch.pool.ranks"] | {"nbtrain.ui.dashboard"}
    forbidden = FORBIDDEN["nbtrain.launch"]
    assert any(m.startswith(forbidden) for m in graph["nbtrain.launch.pool.ranks"])


def test_the_worker_side_loads_no_notebook_machinery():
    code = ("import sys, nbtrain.context, nbtrain.strategies, nbtrain.rank.worker, "
            "nbtrain.scaleout.torchrun, nbtrain.scaleout.command, nbtrain.scaleout.listen; "
            "print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('ipywidgets', 'plotly', 'IPython', 'ipykernel')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


TELLTALES = ("is_engine", "EngineOptimizer", "strategies.deepspeed", "setup_engine",
             "strategies.fsdp", "strategies.zero", "zero_optimization")
STRATEGY_CLASSES = ("DDP", "FSDP", "Zero1", "DeepSpeed")


def strategy_branches(source: str) -> list[str]:
    """What in ``source`` asks which strategy it has: a telltale name, or an
    ``isinstance`` against a strategy class."""
    tree = ast.parse(source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names |= {f"{node.module}.{a.name}" for a in node.names}
    found = sorted(t for t in TELLTALES if any(t in name for name in names))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                and len(node.args) == 2
                and any(getattr(t, "id", None) in STRATEGY_CLASSES
                        for t in ast.walk(node.args[1]))):
            found.append("isinstance")
    return found


def test_no_module_outside_strategies_asks_which_strategy_it_has():
    """Strategies own their differences through the base Strategy's hooks (setup,
    backward, no-sync, clipping, state dicts, memory, release): code elsewhere names
    no strategy class to branch on, nor DeepSpeed's engine."""
    outside = [p for p in PACKAGE.rglob("*.py") if PACKAGE / "strategies" not in p.parents]
    assert len(outside) > 50
    found = {str(p.relative_to(PACKAGE)): strategy_branches(p.read_text()) for p in outside}
    assert {k: v for k, v in found.items() if v} == {}


def test_a_module_that_branched_on_a_strategy_would_be_caught():
    assert strategy_branches("from ..strategies.deepspeed import is_engine\n"
                             "if is_engine(model): pass\n") == [
        "is_engine", "strategies.deepspeed"]
    assert strategy_branches("from .strategies.fsdp import FSDP\n"
                             "sharded = isinstance(strategy, FSDP)\n") == [
        "strategies.fsdp", "isinstance"]
    assert strategy_branches("self.strategy.backward(self._model, loss)\n") == []


def test_nothing_outside_run_py_touches_a_runs_private_members():
    """What starts and follows ranks feeds a Run through its port (receive, write_output,
    queued, follow); a backend reaching into run._status or run._on_event went around it."""
    import re

    private = re.compile(r"\brun\._[a-z]\w*")
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
             for path in PACKAGE.rglob("*.py") if path.name != "run.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if private.search(line)]
    assert found == []


def test_no_strategy_or_launcher_name_is_compared_outside_their_rooms():
    """Differences are answered by their owners (a strategy's sharded(), theory(),
    collective_probe(); a launcher's threads(), warm(), exit hint), not by names."""
    import re

    named = re.compile(r"""(==|!=|\bin\s*\(|startswith\()\s*["'](ddp|fsdp|zero|deepspeed|"""
                       r"""fork|forkserver|spawn)""")
    own = ("strategies/", "launch/starting/fork.py", "launch/starting/spawn.py", "launch/starting/forkserver.py",
           "launch/starting/guards.py")
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in PACKAGE.rglob("*.py")
             if not str(path.relative_to(PACKAGE)).startswith(own)
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if named.search(line)]
    assert found == []


def test_launch_and_scaleout_do_not_import_each_other():
    """Scale-out registers its in-process backend with launch/start.py; launch/ imports
    nothing of scaleout/ (scaleout/ builds on launch/'s start path)."""
    graph = import_graph()
    launch_to_scaleout = {(m, t) for m, targets in graph.items() if m.startswith("nbtrain.launch")
                          for t in targets if t.startswith("nbtrain.scaleout")}
    assert launch_to_scaleout == set()


def test_no_private_name_is_imported_from_another_module():
    """A name one module keeps to itself (``_name``) is not another module's to import:
    what crosses rooms is public."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or
                                                     (node.module or "").startswith("nbtrain")):
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {a.name}"
                          for a in node.names if a.name.startswith("_") and not a.asname]
    assert found == []


def test_each_room_stays_small():
    """A module over ~400 lines holds more than one concept: split it by concept (as
    launch/following/watch.py, supervisor.py and pool_op.py were), not by line count."""
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 425} == {}
