"""Which notebook cell is running, and what has already shown itself in it.

An object that displays itself while a cell runs (a launch's dashboard, ``compare()``, a
picker) is often also the cell's last value; shown again as the result, it would appear
twice. Each remembers the cell it showed in. Kernel side only; IPython is imported only
when it is already loaded.
"""

from __future__ import annotations


def current() -> int | None:
    """The number of the cell running now, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "execution_count", None) if shell is not None else None


def mark_shown(obj) -> None:
    """``obj`` has shown itself in the cell running now."""
    obj._nbtrain_shown_in = current()


def shown_here(obj) -> bool:
    """Did ``obj`` already show itself in this cell? Then, as the cell's last line, it
    must not show a second time (``nbtrain.compare(a, b)``, a picker, a launch)."""
    cell = current()
    return cell is not None and getattr(obj, "_nbtrain_shown_in", None) == cell
