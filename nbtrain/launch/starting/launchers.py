"""The ways to start a run's ranks, by the name ``start_method=`` takes, registered as
strategies are (``strategies/registry.py``): a new way is a ``Launcher`` (``launcher.py``)
registered here. ``choose_start_method`` turns ``"auto"`` into one: fork where
``guards.py`` finds forking the kernel safe, else the first registered way whose ranks
start clean after the kernel touched CUDA (the fork server)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from . import guards
from .devices import cuda_device_count
from .fork import ForkLauncher
from .forkserver import ForkServerLauncher
from .launcher import Launcher
from .spawn import SpawnLauncher


@dataclass(frozen=True)
class Way:
    """One registered way to start ranks."""

    name: str  # what start_method= takes, and run.start_method says
    make: Callable[[], Launcher]
    clean_after_cuda: bool  # its ranks start clean when the kernel has touched CUDA
    said: str  # how a warning names it: "a fork server"


LAUNCHERS: dict[str, Way] = {}


def register(name: str, make: Callable[[], Launcher], clean_after_cuda: bool,
             said: str) -> None:
    if name in LAUNCHERS or name == "auto":
        raise ValueError(f"a start method named {name!r} is registered already.")
    LAUNCHERS[name] = Way(name, make, clean_after_cuda, said)


def make(name: str) -> Launcher:
    """A new launcher of the registered way ``name``."""
    return LAUNCHERS[name].make()


def choose_start_method(requested: str, accelerator: str | None = None) -> str:
    """``"auto"``: fork when safe for ranks on ``accelerator`` (None: CUDA where this
    kernel sees GPUs), else the fork server with a one-line warning saying why. A way
    asked for by name is checked (fork: that it is safe) and kept."""
    known = ("auto", *LAUNCHERS)
    if requested not in known:
        raise ValueError(f"start_method={requested!r} is not one of {known}.")
    if guards.importing_main_in_spawned_worker():
        raise RuntimeError(
            "nbtrain: a spawned worker imports the script that started it, and the script "
            "launches workers at import. Put the launch under `if __name__ == \"__main__\":` "
            "in the script (a notebook cell is never imported again).")
    if requested != "auto" and LAUNCHERS[requested].clean_after_cuda:
        return requested  # asked for: no canary (on a GPU it costs milliseconds still)
    if accelerator is None:
        accelerator = "cuda" if cuda_device_count() else "cpu"
    reason = guards.fork_unsafe_reason(accelerator)  # (a module's: tests fake it)
    clean = next(w for w in LAUNCHERS.values() if w.clean_after_cuda)
    if requested != "auto":
        if reason:
            raise RuntimeError(
                f"start_method={requested!r} is unsafe here: {reason}. Forked workers would "
                "fail with 'Cannot re-initialize CUDA in forked subprocess'. Restart the "
                "kernel and launch before touching CUDA, or pass "
                f"start_method={clean.name!r} (safe, and warm after its first launch).")
        return requested
    if reason:
        warnings.warn(f"nbtrain: starting workers from {clean.said} instead of forking the "
                      f"kernel, because {reason}.", RuntimeWarning, stacklevel=3)
        return clean.name
    return "fork"


register("fork", ForkLauncher, clean_after_cuda=False, said="a fork of the kernel")
register("forkserver", ForkServerLauncher, clean_after_cuda=True, said="a fork server")
register("spawn", SpawnLauncher, clean_after_cuda=True, said="new interpreters")
