"""Byte counts as people read them: powers of 1024 named KB, MB and GB, as torch's
memory summaries and nvidia-smi name them. Imports nothing of nbtrain's: both sides
(a rank's out-of-memory hint, the notebook's tables and charts) use it."""

from __future__ import annotations

_UNITS = (("GB", 2**30), ("MB", 2**20), ("KB", 2**10))


def unit_for(nbytes: float) -> tuple[str, float]:
    """The unit (KB, MB or GB) that keeps ``nbytes`` readable, and its size: one unit for
    a chart's whole axis."""
    for name, size in _UNITS:
        if nbytes >= size:
            return name, size
    return "KB", 2**10


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in its unit, three significant digits: "7.85 GB", "512 MB", "100 B"."""
    if abs(nbytes) < 2**10:
        return f"{nbytes:.0f} B"
    name, size = unit_for(abs(nbytes))
    value = nbytes / size
    if abs(value) >= 999.5:  # 1000-1023 of a unit: three digits would read "1e+03"
        return f"{value:.0f} {name}"
    return f"{value:.3g} {name}"
