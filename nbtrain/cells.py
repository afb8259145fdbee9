"""Which notebook cell is running, and what has already shown itself in it.

An object that displays itself while a cell runs (a launch's dashboard, ``compare()``, a
picker) is often also the cell's last value; shown again as the result, it would appear
twice. Each remembers the cell it showed in. Kernel side only; IPython is imported only
when it is already loaded.
"""

from __future__ import annotations

import shutil
import sys
import time

from .display_record import decode_display

# What a RankPool's code is compiled as (tracebacks and stacks name it): the n-th
# ``pool.run``'s, or the ``%%ranks`` cell of In[n], sent after a blank line so that its
# lines count as the cell's (the magic's is the first). ``errors.cell_label`` names the
# latter as IPython names a cell, ``Cell In[n]``.
POOL_CODE = "<%%ranks cell {}>"
RANKS_CELL = "<%%ranks In[{}]>"


def current() -> int | None:
    """The number of the cell running now, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None:
        return None
    # The running cell's result knows its In[n]; the shell's count is n + 1 by now from
    # IPython 9 on (n until it ends before that).
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return number if number is not None else getattr(shell, "execution_count", None)


def mark_shown(obj) -> None:
    """``obj`` has shown itself in the cell running now."""
    obj._nbtrain_shown_in = current()


def shown_here(obj) -> bool:
    """Did ``obj`` already show itself in this cell? Then, as the cell's last line, it
    must not show a second time (``nbtrain.compare(a, b)``, a picker, a launch)."""
    cell = current()
    return cell is not None and getattr(obj, "_nbtrain_shown_in", None) == cell


class busy_while_blocking:
    """While a cell blocks in nbtrain (a launch, ``run.wait()``, a pool command), the
    kernel's status stays "busy".

    JupyterLab shows the kernel's last status message, whichever request it answers. A
    widget frontend asks the kernel for a subshell (control channel) and sends widget
    messages to it; ipykernel answers each with busy, then idle, and the status bar read
    "Idle" while the cell still ran (from about when the live chart appeared). Inside
    this block, every "idle" for another request is followed by a "busy" for the
    running cell's. Outside an ipykernel, or reentered, it does nothing.
    """

    _active = False

    def __enter__(self):
        import threading

        self._restore = None
        if busy_while_blocking._active or threading.current_thread() is not threading.main_thread():
            return self  # a background wait (the picker's) is not the cell
        kernel = _kernel()
        cell = kernel.get_parent("shell") if kernel is not None else None
        if not cell or not hasattr(kernel, "_publish_status"):
            return self
        publish = kernel._publish_status
        cell_id = cell.get("header", {}).get("msg_id")

        def publish_keeping_busy(status, channel, parent=None):
            publish(status, channel, parent)
            if status != "idle":
                return
            answered = parent or kernel.get_parent(channel) or {}
            if answered.get("header", {}).get("msg_id") != cell_id:
                publish("busy", "shell", cell)

        kernel._publish_status = publish_keeping_busy
        busy_while_blocking._active = True

        def restore():
            kernel._publish_status = publish
            busy_while_blocking._active = False

        self._restore = restore
        return self

    def __exit__(self, *exc):
        if self._restore is not None:
            self._restore()


def cell_parent():
    """The running cell's message header in an ipykernel (where displays go), else None."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    pub = getattr(get_ipython(), "display_pub", None)
    header = getattr(pub, "parent_header", None)
    return dict(header) or None if header is not None else None


class CellOutput:
    """Where the ranks' output goes: the cell running now (a launch's, a pool command's),
    from whichever thread reads the ranks. ``write(rank, stream, line)``: a line of a
    rank's stdout (``"out"``) or stderr (``"err"``) to the cell's, labelled ``[rank N]``;
    ``"display"``: a forked rank's display record (``display_record.Display``), published in the
    cell as the rank's shell would have, or outside a kernel its text as a line."""

    REDRAW_S = 0.1  # the live line is redrawn at most this often

    def __init__(self):
        self.streams = {"out": sys.stdout, "err": sys.stderr}
        self.parent = cell_parent()
        self._live: dict[tuple[int, str], str] = {}  # (rank, stream): its bar, as shown
        self._drawn: tuple[str, int] | None = None  # the stream and length of what shows
        self._drawn_at = 0.0

    def write(self, rank: int, stream: str, line: str) -> None:
        """``stream`` ``"out-live"``/``"err-live"``: the line a rank redraws in place now
        (a progress bar; ``""``: gone). Every rank's shows on one line of the cell, redrawn
        with carriage returns as a terminal and Jupyter show tqdm's, below the lines."""
        if stream == "display":
            self.display(rank, line)
            return
        if stream.endswith("-live"):
            key = (rank, stream[:-len("-live")])
            if line:
                self._live[key] = line
            elif self._live.pop(key, None) is None:
                return
            if time.monotonic() - self._drawn_at >= self.REDRAW_S or not line:
                self._erase(key[1])
                self._draw()
            return
        self._erase(stream)
        self._live.pop((rank, stream), None)
        self._put(stream, f"[rank {rank}] {line}\n")
        self._draw()

    def _put(self, stream: str, text: str) -> None:
        try:
            self.streams[stream].write(text)
            self.streams[stream].flush()
        except Exception:
            pass

    def _erase(self, stream: str) -> None:
        """Clear the live line before other text goes to its stream (or, in a terminal,
        where both streams share the screen, to either)."""
        if self._drawn is None:
            return
        drawn, width = self._drawn
        if stream == drawn or _tty(self.streams[drawn]):
            self._put(drawn, "\r" + " " * width + "\r")
            self._drawn = None

    def _draw(self) -> None:
        if not self._live:
            return
        stream = "err" if any(s == "err" for _, s in self._live) else "out"
        text = "   ".join(f"[rank {r}] {t}" for (r, _), t in sorted(self._live.items()))
        if _tty(self.streams[stream]):  # a wrapped line cannot be redrawn in a terminal
            text = text[:max(20, shutil.get_terminal_size().columns - 1)]
        width = self._drawn[1] if self._drawn else 0
        self._put(stream, "\r" + text + " " * max(0, width - len(text)))
        self._drawn, self._drawn_at = (stream, len(text)), time.monotonic()

    def display(self, rank: int, record: str) -> None:
        try:
            shown = decode_display(record)
        except ValueError:
            return
        kernel = _kernel()
        if kernel is not None and self.parent is not None:
            try:
                kernel.session.send(kernel.iopub_socket, shown.msg_type, shown.content,
                                    parent=self.parent, metadata=shown.metadata)
            except Exception:  # the kernel is going away
                pass
        elif shown.msg_type == "display_data":
            for line in str(shown.content.get("data", {}).get("text/plain", "")).splitlines():
                self.write(rank, "out", line)


def _tty(stream) -> bool:
    try:
        return stream.isatty()
    except Exception:
        return False


def _kernel():
    if "ipykernel" not in sys.modules:
        return None
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "kernel", None)

