"""``ctx.checkpoint_every``: checkpoints a restart goes on from exactly.

Every ``every`` training steps, at the boundary between two steps, every rank saves the
state it was given (models, optimizers, plain values) through ``ctx.save``'s sharded
path, together with what makes the next steps the same ones: the number of steps done,
where ``ctx.dataloader``'s loader is (epoch and batch), this rank's random streams
(torch's CPU and CUDA generators, Python's ``random``, numpy's) and fp16's loss scale
(the scaler ctx made). The last three are this rank's own, so each rank writes them under
a key of its own.

When the launch goes on from a checkpoint (a restart under ``max_restarts``,
``launch(resume=...)``, or torchrun's agent starting the ranks again, which finds it in
``checkpoint_every``'s own directory), it is loaded before training starts: the models
and optimizers in place, the step, the loader's position (a loop over
``loader.epochs(n)`` starts at the saved epoch, one over ``range(n)`` finds the epochs
already done empty; the saved epoch goes on without loading the batches before the
saved one), and, at the first step boundary, the random streams. Losses after a restart
are then an uninterrupted run's, on the same number of ranks; not replayed exactly:
random transforms inside DataLoader worker processes (``num_workers > 0``).

A step boundary is where the loader is asked for its next batch, or, in a loop that
does not use ``ctx.dataloader``, where ``ctx.step`` is set to the next step. With
gradient accumulation (``ctx.accumulate``), a boundary between two micro-batches of one
optimizer step holds gradients no checkpoint keeps: a save falls due every ``every``
steps and is written at the first boundary where no accumulated gradient waits (right
after an optimizer step), so the accumulation resumes in phase.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from . import checkpoint
from .loader import DeviceLoader

_KEY = "nbtrain.resume.{rank}"  # this rank's step, data position and random streams


def default_path(function: str, kernel_pid: int) -> str:
    """Where ``checkpoint_every`` saves without ``path=``: one directory per kernel and
    function under the system's temporary directory, so relaunching a function replaces
    its checkpoint instead of adding one."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", function).strip("_") or "train"
    return os.path.join(tempfile.gettempdir(), f"nbtrain-checkpoints-{os.getuid()}",
                        f"{kernel_pid}-{name}")


def elastic_restart() -> bool:
    """Is this process a restart by torchrun's agent (``--max-restarts``)? It knows no
    checkpoint; ``checkpoint_every``'s own directory is where to go on from."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def random_streams(device: torch.device) -> dict[str, Any]:
    streams: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if device.type == "cuda":
        streams["cuda"] = torch.cuda.get_rng_state(device)
    if "numpy" in sys.modules:
        streams["numpy"] = sys.modules["numpy"].random.get_state()
    return streams


def set_random_streams(streams: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(streams["torch"])
    random.setstate(streams["random"])
    if "cuda" in streams and device.type == "cuda":
        torch.cuda.set_rng_state(streams["cuda"], device)
    if "numpy" in streams:
        import numpy

        numpy.random.set_state(streams["numpy"])


class Checkpointer:
    """What ``ctx.checkpoint_every`` set up on this rank.

    ``save(path, state)`` and ``load(path, state)`` are ctx's; ``loader`` is the
    ``ctx.dataloader`` whose position is kept and whose batches are the steps (None in a
    hand-written loop, where ``ctx.step`` says them).
    """

    def __init__(self, every: int, path: str, state: dict[str, Any], rank: int,
                 device: torch.device, save: Callable, load: Callable,
                 in_phase: Callable[[], bool] = lambda: True,
                 ctx_state: tuple[Callable[[], dict], Callable[[dict], None]] | None = None):
        self.every, self.path, self.state = every, path, state
        self.rank, self.device = rank, device
        self._save, self._load, self._in_phase = save, load, in_phase
        # ctx's own state to keep (fp16's loss scale, the skipped steps): get, set
        self._ctx_state = ctx_state
        self.loader: DeviceLoader | None = None
        self.start = 0  # the steps done when this attempt began
        self._saved_at = 0  # the steps done at the last save (or the resume)
        self._streams: dict[str, Any] | None = None  # to set at the first boundary
        self._position: tuple[int, int] | None = None  # the loader's, to go on from

    @classmethod
    def begin(cls, every: int, path: str | os.PathLike, state: dict[str, Any],
              loaders: list[DeviceLoader], rank: int, device: torch.device,
              save: Callable, load: Callable,
              in_phase: Callable[[], bool] = lambda: True,
              ctx_state: tuple[Callable[[], dict], Callable[[dict], None]] | None = None,
              ) -> Checkpointer:
        """Checked arguments; the loader kept: the one in ``state``, else the first of
        ``loaders`` (ctx's so far), else the first ctx makes later (``attach``)."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"ctx.checkpoint_every({every!r}): give the number of steps "
                             "between checkpoints, an int >= 1.")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"ctx.checkpoint_every(path={path!r}): give a directory's path.")
        given = [k for k, v in state.items() if isinstance(v, DeviceLoader)]
        if len(given) > 1:
            raise ValueError(f"ctx.checkpoint_every: {given} are all loaders; give the one "
                             "whose batches are the training steps.")
        kept = state.pop(given[0]) if given else (loaders[0] if loaders else None)
        keeper = cls(every, os.fspath(path), state, rank, device, save, load, in_phase,
                     ctx_state)
        if kept is not None:
            keeper.attach(kept)
        return keeper

    # -- resuming ------------------------------------------------------------------------
    def resume(self, source: str | None) -> dict[str, Any]:
        """Load ``source`` (a checkpoint), when given, into the state; returns the state
        with ``step``, the steps done (0 on a fresh start). A checkpoint of
        ``ctx.save``'s, or one saved by another number of ranks, gives what it has (the
        models, optimizers and values) and no step, position or random streams."""
        self.state.pop("step", None)
        if not source and elastic_restart() and checkpoint.exists(self.path):
            source = self.path  # torchrun started this process again: go on from ours
        if source:
            key = _KEY.format(rank=self.rank)
            if key in checkpoint.keys(source):
                loading = {**self.state, "step": 0, key: b""}
                self._load(source, loading)  # models and optimizers in place
                self.state.update((k, loading[k]) for k in self.state)
                own = pickle.loads(loading[key])
                self.start = self._saved_at = own["step"]
                self._streams = own["streams"]
                set_random_streams(own["streams"], self.device)  # and at the first boundary
                self._position = own["data"]
                if own.get("ctx") and self._ctx_state is not None:
                    self._ctx_state[1](own["ctx"])  # fp16's scale goes on
                if self.loader is not None:
                    self.attach(self.loader)
            else:
                self._load(source, self.state)
        self.state["step"] = self.start
        return self.state

    def attach(self, loader: DeviceLoader) -> None:
        """The loader whose position is kept (and whose batches are the steps)."""
        self.loader = loader
        loader.on_fetch = self._fetching
        if self._position is not None:
            loader.resume_at(*self._position)
            self._position = None

    # -- step boundaries -----------------------------------------------------------------
    def _fetching(self, loader: DeviceLoader) -> None:
        self.boundary(self.start + loader.handed_out)

    def step_set(self, value: int) -> None:
        """``ctx.step = value`` in a loop without ``ctx.dataloader``: ``value`` steps done."""
        if self.loader is None:
            self.boundary(value)

    def boundary(self, done: int) -> None:
        if self._streams is not None:  # the first boundary after a resume: the streams
            set_random_streams(self._streams, self.device)  # as they were at the save
            self._streams = None
        # due: a multiple of ``every`` passed since the last save; written once no
        # accumulated gradient waits (at once without accumulation)
        if done - done % self.every > self._saved_at and self._in_phase():
            self.save(done)

    def save(self, done: int) -> None:
        own = {"step": done, "streams": random_streams(self.device),
               "data": self.loader.position if self.loader is not None else None,
               "ctx": self._ctx_state[0]() if self._ctx_state is not None else None}
        # the state handed back keeps the step this attempt began at
        self._save(self.path, {**self.state, "step": done,
                               _KEY.format(rank=self.rank): pickle.dumps(own)})
        self._saved_at = done
