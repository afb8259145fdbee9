"""``nbtrain run FILE.py:FUNCTION [ARGS] [--nproc-per-node M ...]``: a thin front to torchrun.

For a function that lives in a file (say, copied out of a notebook) and no script
around it. The command builds a torchrun command line and runs it; torchrun starts the
processes, and each one (``python -m nbtrain _rank ...``) loads the file, finds the
function and calls ``nbtrain.launch(function, *ARGS, **KWARGS, strategy=...)``, which
under torchrun runs it in that process as its rank. ``ARGS`` are ``key=value`` (keyword)
or bare values (positional), each read as a Python literal when it is one
(``lr=3e-4 steps=100 name=tiny``). Every option of torchrun's own (``--nnodes``,
``--rdzv-endpoint``, ``--max-restarts``, ``--tee``, ``--log-dir``, ``--master-addr``,
``--local-ranks-filter``, ...) goes to torchrun unchanged; torch's own parser says which
they are and which take a value.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
from typing import Any

USAGE = "nbtrain run FILE.py:FUNCTION [ARGS] [nbtrain's options] [torchrun's options]"
# torchrun options that would replace what torchrun runs: nbtrain's rank entry point.
NOT_PASSED = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")


def parser(prog: str = "nbtrain run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, usage=USAGE, description=__doc__.split("\n\n")[1],
        epilog="Every option of torchrun (python -m torch.distributed.run --help) is passed "
               "on unchanged, e.g. --nproc-per-node 8 --nnodes 2 --rdzv-endpoint head:29500 "
               "--max-restarts 3 --tee 3 --log-dir logs. Without them: one process "
               "(--nproc-per-node 1) on this node (--standalone); with --rdzv-endpoint, "
               "--rdzv-backend c10d and --rdzv-id nbtrain unless given.")
    p.add_argument("target", help="FILE.py:FUNCTION, the function to run on every rank")
    p.add_argument("args", nargs="*", help="the function's arguments: key=value or values")
    p.add_argument("--strategy", default="ddp", help="a strategy name (default: ddp)")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "cuda", "gpu"))
    p.add_argument("--seed", type=int, default=None, help="the base seed (rank r: seed + r)")
    p.add_argument("--attach", default=None, metavar="ADDRESS",
                   help="stream to a notebook's nbtrain.listen() (watch.address)")
    return p


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` as ``(nbtrain's, torchrun's)``: each torchrun option (with its value, when it
    takes one) goes to torchrun in the order given; the rest is the target, the
    function's arguments and nbtrain's options."""
    ours = parser()._option_string_actions
    theirs = torchrun_parser()._option_string_actions
    mine: list[str] = []
    passed: list[str] = []
    items = iter(argv)
    for item in items:
        name = item.split("=", 1)[0]
        if not item.startswith("-") or name in ours or name in ("-h", "--help"):
            mine.append(item)
        elif name in NOT_PASSED:
            raise SystemExit(f"nbtrain run: {item} would replace what torchrun runs (nbtrain's "
                             "rank entry); run torchrun yourself for that.")
        elif name in theirs:
            passed.append(item)
            if "=" not in item and theirs[name].nargs != 0:
                value = next(items, None)
                if value is None:
                    raise SystemExit(f"nbtrain run: {item} needs a value.")
                passed.append(value)
        else:
            raise SystemExit(f"nbtrain run: {item} is neither nbtrain's option nor torchrun's "
                             "(see nbtrain run --help and python -m torch.distributed.run "
                             "--help).")
    return mine, passed


def main(argv: list[str]) -> int:
    """The ``nbtrain run`` command: check the target here, then hand over to torchrun."""
    mine, passed = split_argv(argv)
    options = parser().parse_intermixed_args(mine)
    path, name = _split(options.target)
    _check_defines(path, name)  # a wrong file or name fails here, once, not on every rank
    torchrun = torchrun_parser().parse_args([*passed, "_"])
    if str(torchrun.nnodes) not in ("1", "1:1") and not _given(passed, "--rdzv-endpoint",
                                                               "--master-addr"):
        print(f"nbtrain run: --nnodes {torchrun.nnodes} needs --rdzv-endpoint HOST:PORT "
              "(where the nodes meet, the same on every node).", file=sys.stderr)
        return 2
    command = torchrun_command(mine, passed)
    env = dict(os.environ)
    # Each restart's ranks meet in a store of their own, not in the agent's (shared by
    # every attempt, where a restarted rank can read a dead attempt's address: torch's
    # issue 135712; torch's own remedy). scaleout/torchrun.py covers plain torchrun.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if options.attach:
        env["NBTRAIN_ATTACH"] = options.attach
    # torchrun's agent takes this process's place: whoever started `nbtrain run` (a
    # notebook's subprocess, a shell) holds the agent itself, so its interrupt or kill
    # reaches the agent, whose ranks end with it (torchrun.end_with_agent), instead of a
    # middle process whose death would leave the agent and its ranks running.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


def torchrun_command(mine: list[str], passed: list[str]) -> list[str]:
    """torchrun's command line: its options as given (one process, standalone, when none
    says otherwise), then nbtrain's rank entry with nbtrain's part of the arguments."""
    defaults = []
    if not _given(passed, "--nproc-per-node"):
        defaults.append("--nproc-per-node=1")
    if _given(passed, "--rdzv-endpoint"):  # torchrun's own defaults are static and "none"
        if not _given(passed, "--rdzv-backend"):
            defaults.append("--rdzv-backend=c10d")
        if not _given(passed, "--rdzv-id"):
            defaults.append("--rdzv-id=nbtrain")
    nodes = str(torchrun_parser().parse_args([*passed, "_"]).nnodes)
    if nodes in ("1", "1:1") and not _given(passed, "--standalone", "--rdzv-endpoint",
                                            "--master-addr"):
        defaults.append("--standalone")
    return [sys.executable, "-m", "torch.distributed.run", *defaults, *passed,
            "-m", "nbtrain", "_rank", *_without_attach(mine)]


def _given(passed: list[str], *names: str) -> bool:
    """Was one of torchrun's options ``names`` given (in either spelling)?"""
    spelled = {n for name in names for n in (name, name.replace("-", "_").replace("__", "--"))}
    return any(item.split("=", 1)[0] in spelled for item in passed)


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

    options = parser().parse_intermixed_args(argv)  # nbtrain's part: see torchrun_command
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
