"""``nbtrain.progress(items, "sweep")``: one line of progress over a loop of runs.

In a kernel the line is one output that updates in place (a display handle, text only,
at most every ``every`` seconds); in a terminal it is printed to stderr, a line at most
every ``terminal_every`` seconds and one at the end. ``compare()`` uses it for many runs.
Nothing here is imported by workers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO


class Progress:
    """Iterate ``items`` and show ``label i/n · item · elapsed, ~left`` as it goes.

    Args:
        items: what the loop goes over; ``total`` defaults to ``len(items)``.
        label: the line's first word, e.g. ``"sweep"``.
        delay: show nothing until this many seconds have passed (short loops stay quiet).
        display: False shows nothing.
        stream: write lines here instead of choosing (a kernel display or stderr).
    """

    every = 0.25  # seconds between updates of the line in a kernel
    terminal_every = 5.0  # seconds between lines in a terminal

    def __init__(self, items: Iterable[Any], label: str = "progress", *,
                 total: int | None = None, delay: float = 0.0, display: bool = True,
                 stream: TextIO | None = None):
        if not isinstance(label, str):
            raise TypeError(f"label={label!r}: give a short text such as 'sweep'.")
        if total is None and hasattr(items, "__len__"):
            total = len(items)
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                                  or total < 0):
            raise ValueError(f"total={total!r}: give the number of items (an int >= 0).")
        if not isinstance(delay, (int, float)) or delay < 0:
            raise ValueError(f"delay={delay!r}: give seconds >= 0.")
        self.items, self.label, self.total, self.delay = items, label, total, delay
        self.done = 0
        self.current: Any = None
        self.lines: list[str] = []  # every line shown or written, for tests and logs
        self._display, self._stream = display, stream
        self._handle = None
        self._started = self._shown_at = 0.0

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress has no total (its items have no len()).")
        return self.total

    def __iter__(self) -> Iterator[Any]:
        self._started = time.monotonic()
        for item in self.items:
            self.current = item
            self._show(final=False)
            yield item
            self.done += 1
        self.current = None
        self._show(final=True)

    def text(self) -> str:
        elapsed = time.monotonic() - self._started
        of = f"/{self.total}" if self.total is not None else ""
        if self.current is None and self.done and (self.total is None or self.done == self.total):
            return f"{self.label}: {self.done}{of} done in {elapsed:.1f} s"
        parts = [f"{self.label}: {self.done}{of}"]
        if self.current is not None:
            parts.append(_short(self.current))
        left = ""
        if self.done and self.total:
            left = f", ~{elapsed / self.done * (self.total - self.done):.0f} s left"
        parts.append(f"{elapsed:.0f} s{left}")
        return " · ".join(parts)

    def _show(self, final: bool) -> None:
        now = time.monotonic()
        if not self._display or now - self._started < self.delay:
            return
        if self._stream is None and self._handle is None:
            from .frontend import in_kernel

            if not in_kernel():
                self._stream = sys.stderr
        if self._stream is not None:
            if final or not self.lines or now - self._shown_at >= self.terminal_every:
                self._write(self.text(), now)
                self._stream.write(self.lines[-1] + "\n")
                self._stream.flush()
            return
        if not final and self._handle is not None and now - self._shown_at < self.every:
            return
        self._write(self.text(), now)
        bundle = {"text/plain": self.lines[-1]}
        if self._handle is None:
            from IPython.display import display

            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def _write(self, text: str, now: float) -> None:
        self.lines.append(text)
        self._shown_at = now


def progress(items: Iterable[Any], label: str = "progress", **options: Any) -> Progress:
    """Wrap a loop so it shows one line of progress::

        for width, name in nbtrain.progress(grid, "sweep"):
            runs[width, name] = nbtrain.launch(train, ..., dashboard=False)

    A line that updates in place in a notebook; lines on stderr in a terminal. Options:
    ``total=``, ``delay=`` (seconds before showing anything), ``display=False``,
    ``stream=``.
    """
    return Progress(items, label, **options)


def _short(item: Any, width: int = 40) -> str:
    text = item if isinstance(item, str) else repr(item)
    return text if len(text) <= width else text[:width - 1] + "…"
