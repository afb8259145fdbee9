"""Exceptions a launch raises in the notebook cell.

A worker cannot send its exception object back safely (its class may not exist in the
kernel, and the kernel never unpickles telemetry), so a failure crosses the process
boundary as plain data: the rank, the original type and message, and the traceback text.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import signal
import sys

from .cells import RANKS_CELL
from .cells import current as current_cell

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FRAME = re.compile(r'^(\s*)File "([^"]+)", line (\d+)(.*)$')


class WorkerError(RuntimeError):
    """A rank failed: it raised, was killed by a signal, or exited without returning.

    Attributes:
        rank: the rank that failed first (the root cause when several did).
        exc_type: the original exception's type name, e.g. ``"ValueError"``; for a
            signal death ``"SIGKILL"`` and so on.
        message: the original exception's message (or what happened to the process).
        traceback: the worker's formatted traceback, each line labelled with the rank.
        others: one line per other rank that did not finish normally.
    """

    others_heading = "other ranks:"

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str = "",
                 others: list[str] | None = None, hint: str = ""):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.others = list(others or [])
        self.hint = hint
        # The cell whose live view already shows this failure's traceback (set by the
        # kernel); shown in that cell, the exception does not repeat all of it.
        self.shown_in_cell: int | None = None
        super().__init__(self._text())

    def _text(self) -> str:
        lines = [f"rank {self.rank} failed with {self.exc_type}: {self.message}"]
        if self.traceback:
            lines += ["", self.traceback.rstrip()]
        if self.others:
            lines += ["", self.others_heading] + [f"  {line}" for line in self.others]
        if self.hint:
            lines += ["", self.hint]
        return "\n".join(lines)

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.message, self.traceback,
                             self.others, self.hint))

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for it: the user's cell that launched, then the worker's
        traceback once, without the kernel-side frames of nbtrain (launch, wait)."""
        import traceback

        skip = (_PACKAGE, *_package_dirs("IPython", "ipykernel"))
        frames = [f for f in traceback.extract_tb(self.__traceback__)
                  if not os.path.abspath(f.filename).startswith(skip)]
        red, plain = "\x1b[0;31m", "\x1b[0m"
        lines = [f"{red}{'-' * 75}{plain}",
                 f"{red}{type(self).__name__}{plain}{' ' * max(1, 42 - len(type(self).__name__))}"
                 "Traceback (most recent call last)"]
        if frames:
            lines += cell_names("".join(traceback.format_list(frames))).rstrip().splitlines()
            lines.append("")
        body = self._text()
        if self.traceback and self.shown_in_cell is not None and self.shown_in_cell == current_cell():
            # The run's view in this cell shows the traceback: here only where it failed in
            # the user's cells, so it is not on the page twice.
            cells = _cell_frames(self.traceback)
            lines.append(f"{red}{type(self).__name__}{plain}: rank {self.rank} failed with "
                         f"{self.exc_type}: {self.message}")
            if cells:
                lines += ["", *cells]
            lines += ["", "(the whole traceback: in the run's view above, and in "
                      "err.traceback)"]
            if self.others:
                lines += ["", self.others_heading] + [f"  {line}" for line in self.others]
            if self.hint:
                lines += ["", self.hint]
            return lines
        head, _, rest = body.partition("\n")
        return lines + [f"{red}{type(self).__name__}{plain}: {head}", *rest.splitlines()]


class RunTimeoutError(WorkerError):
    """The run passed its ``timeout=``; ``.ranks`` are the ranks that were still running,
    ``others`` says where each one was (when it said)."""

    others_heading = "where they were:"

    def __init__(self, timeout: float, ranks: list[int], finished: list[int],
                 where: dict[int, str] | None = None):
        self.timeout = timeout
        self.ranks, self.finished = list(ranks), list(finished)
        self.where = {r: at for r, at in (where or {}).items() if at}  # one line each
        still = ", ".join(map(str, ranks)) or "none"
        done = ", ".join(map(str, finished)) or "none"
        super().__init__(
            ranks[0] if ranks else 0, "Timeout",
            f"the run passed timeout={timeout:g}s; ranks still running: {still} "
            f"(finished: {done})",
            others=[f"rank {r}: still running, at {at}" for r, at in self.where.items()],
            hint="A rank that never reaches a collective the others wait in (a barrier, an "
                 "all-reduce, a forward pass skipped on one rank) hangs them all. Check that "
                 "every rank runs the same number of steps, or raise timeout= if the work "
                 "is just long.")

    def __reduce__(self):
        return (type(self), (self.timeout, self.ranks, self.finished, self.where))


def places_of(ranks: dict) -> dict[int, str]:
    """``{rank: frame_text(its where)}`` for ranks of a run's outcome (``outcome.RankOutcome``);
    "" for a rank that did not say where it was."""
    return {r: frame_text(getattr(w, "where", None)) for r, w in ranks.items()}


def where_text(where: dict[int, str]) -> str:
    """Where ranks were (``{rank: frame_text}``), ranks at the same line together:
    ``where the ranks were: ranks 0, 1 at Cell In[4], line 9, in train: loss.backward()``
    ("" if none said)."""
    places: dict[str, list[int]] = {}
    for rank, at in sorted(where.items()):
        if at:
            places.setdefault(at, []).append(rank)
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} at {at}"
             for at, r in places.items()]
    return "where the ranks were: " + "; ".join(parts) if parts else ""


class RunStoppedError(RuntimeError):
    """Results were asked of a run that was stopped (``run.stop()`` or an interrupt)."""


def cell_names(text: str) -> str:
    """A traceback's text with the files IPython compiles cells to (and ``%%ranks``
    cells) named as IPython names them (``Cell In[5], line 8`` instead of
    ``File "/tmp/ipykernel_1/1671.py", line 8``),
    and each frame's source line filled in from the kernel where the worker had none
    (a spawned worker never saw the cells' source). Outside IPython: ``text`` as it is."""
    cells = filename_map()
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m is None:
            out.append(line)
            continue
        indent, filename, lineno, rest = m.groups()
        place = cell_label(filename, cells)
        out.append(f"{indent}{place}, line {lineno}{rest}" if place else line)
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not following.startswith(indent + "  ") or _FRAME.match(following):
            source = linecache.getline(filename, int(lineno)).strip()  # the kernel's copy
            if source:
                out.append(f"{indent}  {source}")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def cell_label(filename: str, cells: dict[str, int] | None = None) -> str | None:
    """``"Cell In[5]"`` for a file IPython compiled a cell to (``cells``: the map
    ``filename_map()`` gives, read once by a caller that asks about many files)."""
    number = (filename_map() if cells is None else cells).get(filename)
    if number is None:  # an IPython 7 name, or a %%ranks cell's, carries its number
        found = _IPYTHON7_CELL.match(filename) or _RANKS_CELL.fullmatch(filename)
        number = found and int(found.group(1))
    return None if number is None else f"Cell In[{number}]"


_IPYTHON7_CELL = re.compile(r"<ipython-input-(\d+)-")
_RANKS_CELL = re.compile(re.escape(RANKS_CELL).replace(r"\{\}", r"(\d+)"))


def frame_text(frame) -> str:
    """An ``outcome.Frame`` on one line, as a cell names it: ``Cell In[5], line 8, in train:
    loss.backward()`` (a file: its path, relative to the working directory if inside);
    "" for None."""
    if frame is None:
        return ""
    filename, lineno, name = frame.filename, frame.lineno, frame.name
    place = cell_label(filename)
    if place is None:
        path = os.path.abspath(filename)
        place = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else filename
    source = linecache.getline(filename, lineno).strip()
    return f"{place}, line {lineno}, in {name}" + (f": {source}" if source else "")


def filename_map() -> dict[str, int]:
    """IPython's ``{cell file name: execution count}``; empty outside IPython."""
    if "IPython" not in sys.modules:
        return {}
    from IPython import get_ipython

    remember_cell_names()
    compiler = getattr(get_ipython(), "compile", None)
    return dict(getattr(compiler, "_filename_map", None) or {})


def remember_cell_names() -> None:
    """Give IPython 7's compiler (Colab, Kaggle) the ``{file name: execution count}`` map
    IPython 8 keeps: kept from now on, and guessed for the cells that ran before from the
    history (ipykernel names a cell by a hash of its source, which the history keeps
    without its trailing newlines)."""
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    shell = get_ipython()
    compiler = getattr(shell, "compile", None)
    if compiler is None or hasattr(compiler, "_filename_map"):
        return
    names: dict[str, int] = {}
    history = getattr(shell, "history_manager", None)
    if history is not None:
        cells = zip(history.input_hist_parsed, history.input_hist_raw, strict=False)
        for number, (parsed, raw) in enumerate(cells):
            if not (number and raw):
                continue
            for ending in ("", "\n"):
                with contextlib.suppress(Exception):
                    names[compiler.get_code_name(raw + ending, parsed + ending,
                                                 number)] = number
    cache = compiler.cache

    def cache_naming(transformed_code, number=0, raw_code=None):
        name = cache(transformed_code, number, raw_code)
        names[name] = number
        return name

    compiler._filename_map = names
    compiler.cache = cache_naming


def _cell_frames(traceback: str) -> list[str]:
    """The lines of ``traceback`` (as ``cell_names`` left it) that are frames in cells,
    each with its source line."""
    lines = traceback.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "Cell In[" in line:
            out.append(line)
            if i + 1 < len(lines) and "Cell In[" not in lines[i + 1] and \
                    " File " not in lines[i + 1]:
                out.append(lines[i + 1])
    return out


def _package_dirs(*names: str) -> list[str]:
    """The folders of those packages that are imported (their frames are the shell's)."""
    dirs = []
    for name in names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    return dirs


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


COLLECTIVE_MISMATCH = re.compile(r"collective mismatch|mismatch between collectives|"
                                 r"doesn't match expected size", re.IGNORECASE)


def peers_returned_hint(rank: int, returned: list[int]) -> str:
    """A rank's communication error when every other rank had returned: it ran a
    collective they did not."""
    them = (f"rank {returned[0]}" if len(returned) == 1
            else "ranks " + ", ".join(map(str, returned)))
    return (f"{them.capitalize()} had returned when rank {rank} waited in this collective: "
            f"rank {rank} ran a collective that {them} did not (a barrier, an all_reduce, a "
            "forward pass or a state_dict under `if ctx.rank == 0:`, or more steps: give "
            "every rank the same number of batches). Run the same collectives, in the same "
            "order, on every rank.")


def signal_hint(signum: int, native: str = "") -> str:
    """What a rank's death by ``signum`` usually means; ``native``: what native code
    printed as it died (a C++ exception's message)."""
    if COLLECTIVE_MISMATCH.search(native):
        return ("The ranks ran different collectives at the same time: one rank ran a "
                "collective the others did not (a forward pass, a barrier, a state_dict or "
                "an all_reduce under `if ctx.rank == 0:`; under FSDP every forward and "
                "backward gathers parameters), or ran one with another size (batches of "
                "different sizes). Run the same collectives, in the same order, on every "
                "rank; \"other ranks\" says where each one was.")
    if signum == signal.SIGABRT:
        return ("SIGABRT is native code in the rank aborting (a C++ exception it could not "
                "raise to Python, a failed check in torch, gloo, NCCL or a C extension): "
                "what it printed is in the message, the line it ran in the traceback.")
    if signum == signal.SIGKILL:
        return ("SIGKILL with no traceback usually means the operating system's out-of-memory "
                "killer ended the process: check free memory (or `dmesg`), lower the batch "
                "size, or pick a sharded strategy such as 'fsdp'.")
    if signum == signal.SIGSEGV:
        return ("A segmentation fault is a crash in native code (a CUDA/NCCL driver, a C "
                "extension); run on 1 device to see whether it is distributed-only.")
    if signum == signal.SIGBUS:
        return ("SIGBUS often means shared memory (/dev/shm) ran out; DataLoader workers use "
                "it. Lower num_workers or enlarge /dev/shm.")
    return "The process was ended by a signal from outside nbtrain."
