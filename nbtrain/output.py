"""Where the ranks' output goes in the kernel: the cell that launched (or ran a pool
command), from whichever thread reads the ranks.

Lines go to the cell's stdout or stderr labelled ``[rank N]``. A forked rank's displays
(``display_record``) are published in the cell as its shell would have. A line a rank
redraws in place (a progress bar) shows live: in a kernel as one text display updated by
its id, a line for each rank's (a notebook keeps each run of stream text as one
output, so a line redrawn with carriage returns would be left behind in it as soon as
another output came between; display updates reach Jupyter, Colab, VS Code and nbclient
alike), in a terminal as one line for every rank's, redrawn with carriage returns; in a
file, not at all (its end comes as a line).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
import uuid

from .cells import cell_parent, current_kernel
from .display_record import decode_display


class CellOutput:
    REDRAW_S = 0.2  # the live line is redrawn at most this often (a redraw that came
    # sooner shows once this has passed, whether or not anything follows it)

    def __init__(self):
        self.streams = {"out": sys.stdout, "err": sys.stderr}
        self.parent = cell_parent()
        self._live: dict[tuple[int, str], str] = {}  # (rank, stream): its bar, as shown
        self._shown = ""  # the live line as it shows now
        self._shown_at = 0.0
        self._display_id: str | None = None  # the live line's display, once made
        self._drawn: tuple[str, int] | None = None  # in a terminal: its stream, length
        self._lock = threading.RLock()  # the reading thread, and a redraw that waited
        self._due: threading.Timer | None = None  # that redraw, once one is waiting
        self._held: str | None = None  # the kernel stream holding lines not yet sent

    def write(self, rank: int, stream: str, line: str) -> None:
        """``stream``: ``"out"``/``"err"``, a line of the rank's stdout or stderr;
        ``"display"``, a display record; ``"out-live"``/``"err-live"``, the line the rank
        redraws in place now (``""``: it ended or cleared itself)."""
        with self._lock:
            self._write(rank, stream, line)

    def _write(self, rank: int, stream: str, line: str) -> None:
        if stream == "display":
            self.display(rank, line)
        elif stream.endswith("-live"):
            key = (rank, stream[:-len("-live")])
            if line:
                self._live[key] = line
            elif self._live.pop(key, None) is None:
                return
            if not line or time.monotonic() - self._shown_at >= self.REDRAW_S:
                self._show_live()
            elif self._due is None:  # too soon: shown in its turn, whatever comes after
                wait = self._shown_at + self.REDRAW_S - time.monotonic()
                self._due = threading.Timer(max(0.0, wait), self._show_due)
                self._due.daemon = True
                self._due.start()
        else:
            self._erase()
            ended = self._live.pop((rank, stream), None) is not None  # its last state
            self._put(stream, f"[rank {rank}] {line}\n")
            if ended:
                self._show_live()
            else:
                self._draw()

    def display(self, rank: int, record: str) -> None:
        try:
            shown = decode_display(record)
        except ValueError:
            return
        if not self._publish(shown.msg_type, shown.content, shown.metadata) \
                and shown.msg_type == "display_data":  # no kernel: the text, as a script
            for line in str(shown.content.get("data", {}).get("text/plain", "")).splitlines():
                self.write(rank, "out", line)

    # -- the live line -------------------------------------------------------------------
    def _show_due(self) -> None:
        with self._lock:
            self._due = None
            self._show_live()

    def _show_live(self) -> None:
        if self._due is not None:  # what it waited to show shows now
            self._due.cancel()
            self._due = None
        bars = [f"[rank {r}] {t}" for (r, _), t in sorted(self._live.items())]
        self._shown_at = time.monotonic()
        kernel = self.parent is not None and current_kernel() is not None
        text = ("\n" if kernel else "   ").join(bars)  # a terminal redraws one line only
        if text == self._shown:
            return
        self._shown = text
        if kernel:
            first = self._display_id is None
            if first:
                self._display_id = uuid.uuid4().hex
            self._publish("display_data" if first else "update_display_data",
                          {"data": {"text/plain": text}, "metadata": {},
                           "transient": {"display_id": self._display_id}}, {})
        else:
            self._erase()
            self._draw()

    def _draw(self) -> None:
        """In a terminal: the live line, below the lines."""
        stream = "err" if any(s == "err" for _, s in self._live) else "out"
        if not self._live or not _tty(self.streams[stream]) or self._display_id is not None:
            return
        text = self._shown[:max(20, shutil.get_terminal_size().columns - 1)]  # unwrapped
        self._put(stream, "\r" + text)
        self._drawn = (stream, len(text))

    def _erase(self) -> None:
        """In a terminal: blank the live line before anything else is written."""
        if self._drawn is not None:
            stream, width = self._drawn
            self._put(stream, "\r" + " " * width + "\r")
            self._drawn = None

    # -- writing -------------------------------------------------------------------------
    def _put(self, stream: str, text: str) -> None:
        """Write, flushed at once unless a kernel's stream holds it: that sends what it
        holds from its IO thread within a fifth of a second, and a flush from this thread
        waits for that thread (per line, it held a chatty rank up 15-30x). What the other
        stream held goes first, so stdout and stderr stay in the order written."""
        if self._held not in (None, stream):
            self._flush_held()
        out = self.streams[stream]
        try:
            out.write(text)
            if _flushes_itself(out):
                self._held = stream
            else:
                out.flush()
        except Exception:
            pass

    def _flush_held(self) -> None:
        if self._held is not None:
            with contextlib.suppress(Exception):
                self.streams[self._held].flush()
            self._held = None

    def _publish(self, msg_type: str, content: dict, metadata: dict) -> bool:
        """Send one display message to the cell, after the lines written before it; False
        outside a kernel."""
        kernel = current_kernel()
        if kernel is None or self.parent is None:
            return False
        self._flush_held()
        try:
            kernel.session.send(kernel.iopub_socket, msg_type, content, parent=self.parent,
                                metadata=metadata)
        except Exception:  # the kernel is going away
            pass
        return True


def _flushes_itself(stream) -> bool:
    iostream = sys.modules.get("ipykernel.iostream")
    return iostream is not None and isinstance(stream, iostream.OutStream)


def _tty(stream) -> bool:
    try:
        return stream.isatty()
    except Exception:
        return False
