"""The package's declared dependencies cover what it imports, and the fresh-environment
check (``tests/fresh_env.py``, which CI also runs in a venv with runtime dependencies
only) passes here."""

from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Imported only inside a function that says how to install it when it is missing.
# Imported only for users who have them: Run.to_pandas, and nbtrain.integrations' adapters
# for the frameworks they plug into (importing them is the user's choice).
# nbtrain.submit's submitit comes with the nbtrain[slurm] extra, its Ray engine's ray with
# nbtrain[ray].
OPTIONAL = {"pandas", "lightning", "pytorch_lightning", "transformers", "deepspeed",
            "submitit", "ray"}
# Needed at run time without being imported by nbtrain: torch's CPU wheel does not
# bring numpy, yet torch.distributed's object collectives (checkpoints) and plotly's
# handling of arrays need it.
ALSO_NEEDED = {"numpy"}


def _imported_top_level_modules() -> set[str]:
    names = set()
    for path in (ROOT / "nbtrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"nbtrain"}


def _declared() -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_norm(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])
            for req in project["dependencies"]}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_declared():
    dists = md.packages_distributions()
    missing = {}
    for module in sorted(_imported_top_level_modules() - OPTIONAL):
        owners = {_norm(d) for d in dists.get(module, [module])}
        if not owners & _declared():
            missing[module] = sorted(owners)
    assert not missing, (f"nbtrain imports these without declaring them in pyproject.toml's "
                         f"dependencies: {missing}")
    assert _declared() >= ALSO_NEEDED


def test_a_fresh_environment_saves_and_loads_checkpoints_and_draws(no_leftovers):
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "fresh_env.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fresh environment: ok" in done.stdout
    assert done.stdout.count("checkpoint ") == 3
