"""docs/architecture.md is the map: short enough to read, and its claims that code can
check are checked here (test_layers.py checks the import rules it states)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbtrain"
MAP = (ROOT / "docs" / "architecture.md").read_text()


def _modules():
    for path in PACKAGE.rglob("*.py"):
        yield path, ast.parse(path.read_text())


def test_the_map_stays_short():
    assert len(MAP.splitlines()) <= 200


def test_every_file_the_map_names_exists():
    """Each `path.py` the map names is a module of the package (or a file of the repo)."""
    named = set(re.findall(r"`([\w/]+\.py)", MAP))
    missing = [n for n in named
               if not any((base / n).exists() for base in (PACKAGE, PACKAGE / "launch",
                                                           PACKAGE / "rank", ROOT))
               and not list(PACKAGE.rglob(Path(n).name))]
    assert missing == []


def test_every_pipe_message_kind_is_spelled_in_wire():
    """'wire.py is the only place a pipe message is spelled': no other module defines a
    one-byte message kind."""
    found = []
    for path, tree in _modules():
        if path.name == "wire.py":
            continue
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, bytes) and len(node.value.value) == 1):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


HOOKS = ("register_forward_pre_hook", "register_forward_hook",
         "register_step_pre_hook", "register_step_post_hook",
         "register_optimizer_step_post_hook")
OUTSIDE = ("outside_graphs", "disable")  # timing.outside_graphs, torch.compiler.disable


def test_every_hook_telemetry_puts_on_a_model_runs_outside_graphs():
    """'every telemetry hook on a model goes through outside_graphs' (so dynamo never
    traces it): in telemetry/ and in the strategies' collective probes."""
    unwrapped = []
    for path, tree in _modules():
        rel = str(path.relative_to(PACKAGE))
        if not (rel.startswith("telemetry/") or rel == "strategies/ddp.py"):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name not in HOOKS:
                continue
            arg = node.args[0]
            wrapper = getattr(getattr(arg, "func", None), "attr",
                              getattr(getattr(arg, "func", None), "id", ""))
            if wrapper not in OUTSIDE:
                unwrapped.append(f"{rel}:{node.lineno}")
    assert unwrapped == []
