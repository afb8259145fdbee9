"""``nbtrain run FILE.py:FUNCTION [ARGS] --nproc-per-node M [...]``: a thin front to torchrun.

For a function that lives in a file (say, copied out of a notebook) and no script
around it. The command builds a torchrun command line and runs it; torchrun starts the
processes, and each one (``python -m nbtrain _rank ...``) loads the file, finds the
function and calls ``nbtrain.launch(function, *ARGS, **KWARGS, strategy=...)``, which
under torchrun runs it in that process as its rank. ``ARGS`` are ``key=value`` (keyword)
or bare values (positional), each read as a Python literal when it is one
(``lr=3e-4 steps=100 name=tiny``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
from typing import Any

USAGE = "nbtrain run FILE.py:FUNCTION [ARGS] --nproc-per-node M [options]"


def parser(prog: str = "nbtrain run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, usage=USAGE, description=__doc__.split("\n\n")[1])
    p.add_argument("target", help="FILE.py:FUNCTION, the function to run on every rank")
    p.add_argument("args", nargs="*", help="the function's arguments: key=value or values")
    p.add_argument("--strategy", default="ddp", help="a strategy name (default: ddp)")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "cuda", "gpu"))
    p.add_argument("--seed", type=int, default=None, help="the base seed (rank r: seed + r)")
    p.add_argument("--attach", default=None, metavar="ADDRESS",
                   help="stream to a notebook's nbtrain.listen() (watch.address)")
    t = p.add_argument_group("torchrun")
    t.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="processes on this node (a count, or gpu/cpu/auto as torchrun takes)")
    t.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", metavar="HOST:PORT",
                   help="where the nodes meet (required with --nnodes > 1)")
    t.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d")
    t.add_argument("--rdzv-id", "--rdzv_id", default="nbtrain")
    t.add_argument("--node-rank", "--node_rank", default=None)
    t.add_argument("--rdzv-conf", "--rdzv_conf", default=None, metavar="KEY=VALUE,...",
                   help="torchrun's rendezvous options, e.g. is_host=1 on the node that "
                   "hosts the store")
    return p


def main(argv: list[str]) -> int:
    """The ``nbtrain run`` command: check the target here, then hand over to torchrun."""
    options = parser().parse_intermixed_args(argv)
    path, name = _split(options.target)
    _check_defines(path, name)  # a wrong file or name fails here, once, not on every rank
    if options.nnodes not in ("1", "1:1") and not options.rdzv_endpoint:
        print(f"nbtrain run: --nnodes {options.nnodes} needs --rdzv-endpoint HOST:PORT "
              "(where the nodes meet, the same on every node).", file=sys.stderr)
        return 2
    command = torchrun_command(options, argv)
    env = dict(os.environ)
    if options.attach:
        env["NBTRAIN_ATTACH"] = options.attach
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:  # torchrun got the interrupt too and ends its workers
        return 130


def torchrun_command(options: argparse.Namespace, argv: list[str]) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={options.nproc_per_node}", f"--nnodes={options.nnodes}"]
    if options.rdzv_endpoint:
        command += [f"--rdzv-backend={options.rdzv_backend}",
                    f"--rdzv-endpoint={options.rdzv_endpoint}", f"--rdzv-id={options.rdzv_id}"]
    else:
        command += ["--standalone"]
    if options.rdzv_conf:
        command += [f"--rdzv-conf={options.rdzv_conf}"]
    if options.node_rank is not None:
        command += [f"--node-rank={options.node_rank}"]
    return command + ["-m", "nbtrain", "_rank", *_without_attach(argv)]


def _without_attach(argv: list[str]) -> list[str]:
    """``argv`` less ``--attach ADDRESS``: the ranks read it from NBTRAIN_ATTACH, and the
    token stays out of process listings."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--attach":
            skip = True
        elif not item.startswith("--attach="):
            out.append(item)
    return out


def rank_main(argv: list[str]) -> int:
    """One torchrun process: load the function and ``launch()`` it as this rank."""
    from ..launch import launch

    options = parser().parse_intermixed_args(argv)
    path, name = _split(options.target)
    fn = _load(path, name)
    args, kwargs = function_args(options.args)
    run = launch(fn, *args, strategy=options.strategy, accelerator=options.accelerator,
                 seed=options.seed, **kwargs)
    if run is not None:  # rank 0: what the run measured, for the log
        print(f"{run!r}\n{run.summary()}", flush=True)
    return 0


def function_args(items: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """``["3", "lr=3e-4", "name=tiny"]`` -> ``([3], {"lr": 0.0003, "name": "tiny"})``."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if eq and key.isidentifier():
            kwargs[key] = _literal(text)
        elif kwargs:
            raise ValueError(f"{item!r}: positional arguments come before key=value ones.")
        else:
            args.append(_literal(item))
    return args, kwargs


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _split(target: str) -> tuple[str, str]:
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise SystemExit(f"nbtrain run: {target!r} is not FILE.py:FUNCTION "
                         "(e.g. train.py:train).")
    return os.path.abspath(path), name


def _check_defines(path: str, name: str) -> None:
    """Fail early when ``path`` has no top-level ``name`` (read, not run: no side effects)."""
    if not os.path.isfile(path):
        raise SystemExit(f"nbtrain run: no file {path}.")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = {n.name for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    names |= {(a.asname or a.name).split(".")[0] for n in tree.body
              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    if name not in names:
        raise SystemExit(f"nbtrain run: {os.path.basename(path)} defines no {name!r} at its "
                         "top level.")


def _load(path: str, name: str):
    """The function ``name`` from the file at ``path``, loaded as a module named after
    the file (its folder first on ``sys.path``, so its own imports work)."""
    if not os.path.isfile(path):
        raise SystemExit(f"nbtrain run: no file {path}.")
    folder, module_name = os.path.dirname(path), os.path.splitext(os.path.basename(path))[0]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = sys.modules.get(module_name)
    if getattr(module, "__file__", None) != path:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # results of its classes unpickle by name
        spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SystemExit(f"nbtrain run: {os.path.basename(path)} has no function {name!r}.")
    return fn
