"""Which notebook cell is running, and what has already shown itself in it.

An object that displays itself while a cell runs (a launch's dashboard, ``compare()``, a
picker) is often also the cell's last value; shown again as the result, it would appear
twice. Each remembers the cell it showed in. Kernel side only; IPython is imported only
when it is already loaded.
"""

from __future__ import annotations

import sys

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
    running cell's; entering it says "busy" once too, for a request answered between the
    cell's start and the block's (the frontend's own, as it sets the cell up: seen in CI
    as a status bar that read "Idle" for a whole run). Outside an ipykernel, or
    reentered, it does nothing.
    """

    _active = False

    def __enter__(self):
        import threading

        self._restore = None
        if busy_while_blocking._active or threading.current_thread() is not threading.main_thread():
            return self  # a background wait (the picker's) is not the cell
        kernel = current_kernel()
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
        publish("busy", "shell", cell)

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


def current_kernel():
    if "ipykernel" not in sys.modules:
        return None
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "kernel", None)

