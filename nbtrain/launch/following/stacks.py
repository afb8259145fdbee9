"""A rank's Python stack as ``faulthandler`` writes it to the rank's stderr, read in the
kernel: when a rank asked with SIGUSR1 answers (where it waits), and when a rank dies in
native code (SIGABRT from gloo's "collective mismatch", SIGSEGV in a C extension:
``faulthandler.enable`` in each rank writes its stack before it dies, where Python's own
traceback never comes).

``Dump`` parses the text: one block per Python thread, innermost frame first. The thread
that matters is the one that runs the user's function (its outermost frames are nbtrain's
rank bootstrap, ``nbtrain/rank/``); ``traceback()`` writes that thread the way Python
writes a traceback (outermost first, from the user's function on), so the kernel's cell
names and source lines fill in as they do for a rank's exception (``errors.cell_names``).
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass, field

from ...outcome import Frame

FATAL = "Fatal Python error:"  # the first line of a dump written as the rank dies
# Every other line such a dump has (Python 3.10-3.13): what does not match ends it.
_DUMP_LINE = re.compile(r'^(\s*$|(Current thread|Thread) 0x|Stack \(most recent call first\)|'
                        r'  File "|  <no Python frame>|  \.\.\.|Extension modules:|'
                        r"Python runtime state:)")
_THREAD = re.compile(r"^((Current thread|Thread) 0x[0-9a-fA-F]+|Stack \(most recent call first\))")
# A dump's first line, also where it follows text the rank left unended (a progress bar)
_START = re.compile(r"Fatal Python error:|(Current thread|Thread) 0x[0-9a-fA-F]+ "
                    r"\(most recent call first\):|Stack \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RANK_DIR = os.path.join(_PACKAGE_DIR, "rank")


@dataclass
class Dump:
    """One ``faulthandler`` dump: ``fatal`` is its first line when the rank was dying
    (``Fatal Python error: Aborted``), and each thread's frames, innermost first."""

    fatal: str = ""
    threads: list[list[Frame]] = field(default_factory=list)

    @classmethod
    def parse(cls, lines: list[str]) -> Dump:
        dump = cls()
        for line in lines:
            if line.startswith(FATAL):
                dump.fatal = line[len(FATAL):].strip()
            elif _THREAD.match(line):
                dump.threads.append([])
            elif (m := _FRAME.match(line)) and dump.threads:
                dump.threads[-1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
        return dump

    def function_frames(self) -> list[Frame]:
        """The thread that runs the rank's function, outermost frame first, from the
        first frame after nbtrain's rank bootstrap (empty when no thread runs one)."""
        for frames in self.threads:
            outermost_first = frames[::-1]
            ours = [i for i, f in enumerate(outermost_first) if _in_rank_code(f.filename)]
            if ours and ours[-1] + 1 < len(outermost_first):
                return outermost_first[ours[-1] + 1:]
        return []

    def traceback(self) -> str:
        """That thread as Python writes a traceback (no source lines: the kernel adds
        them); empty when no thread ran the rank's function."""
        frames = self.function_frames()
        if not frames:
            return ""
        return "Traceback (most recent call last):\n" + "".join(
            f'  File "{f.filename}", line {f.lineno}, in {f.name}\n' for f in frames)

    def where(self) -> Frame | None:
        """Where the rank's function was: the innermost frame of its thread in the user's
        own code, else in a library's (a function that came from a package); None when
        its function was not running: only nbtrain's own code and the standard library's
        were, or what nbtrain's code called (its start: a seed, a ``Context``; its end)."""
        frames = self.function_frames()
        if frames and (_ours(frames[0].filename) or _standard(frames[0].filename)):
            return None  # nbtrain's code called it (an import the rank's start made)
        for accept in (_users, _not_ours):
            for f in reversed(frames):
                if accept(f.filename):
                    return f
        return None

    def complete(self) -> bool:
        """Whether the thread that runs the rank's function has been read to its end."""
        return bool(self.function_frames())


def dump_within(line: str) -> int:
    """Where a dump starts in ``line`` after what the rank had left unended on it (a bar
    redrawn in place, ended by the dump's first line); 0 when it does not."""
    found = _START.search(line, 1)
    return found.start() if found else 0


def in_dump(line: str) -> bool:
    """Whether ``line`` can be part of a faulthandler dump after its first line."""
    return bool(_DUMP_LINE.match(line))


def _in_rank_code(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_RANK_DIR + os.sep)


def _dirs(*keys: str) -> tuple[str, ...]:
    return tuple({os.path.abspath(p) + os.sep for key in keys
                  if (p := sysconfig.get_paths().get(key))})


_STDLIB_DIRS = _dirs("stdlib", "platstdlib")
_LIBRARY_DIRS = (*_STDLIB_DIRS, *_dirs("purelib", "platlib"), _PACKAGE_DIR + os.sep)


_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")  # dist-: Debian's (Colab's)


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _standard(filename: str) -> bool:
    """The standard library's file (``<frozen importlib._bootstrap>`` too)."""
    if filename.startswith("<frozen "):
        return True
    path = os.path.abspath(filename)
    return path.startswith(_STDLIB_DIRS) and not _INSTALLED.search(path)


def _not_ours(filename: str) -> bool:
    """A library's file, not nbtrain's or the standard library's."""
    return bool(_INSTALLED.search(filename)) and not _ours(filename)


_CELLS = ("<ipython-input", "<%%ranks")  # IPython 7's cells; a RankPool's (cells.py)


def _users(filename: str) -> bool:
    if filename.startswith("<") and not filename.startswith(_CELLS):
        return False  # <frozen ...>, <string>
    path = os.path.abspath(filename)
    return not path.startswith(_LIBRARY_DIRS) and not _INSTALLED.search(path)


def native_message(lines: list[str]) -> str:
    """What native code printed before the rank died: the C++ exception's ``what():``
    (gloo's enforce failures, c10 errors) or, failing that, the last line printed."""
    texts = [line.strip() for line in lines if line.strip()]
    for text in reversed(texts):
        if text.startswith("what():"):
            return text[len("what():"):].strip()
    return texts[-1] if texts else ""
