"""The telemetry of the function running in this process, for adapters that live in
other frameworks' callbacks (``nbtrain.integrations``): ``log(step, values)`` while a
launched function runs with telemetry on, nothing otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_log: Callable[[int | None, dict[str, Any]], None] | None = None


def set_logger(log: Callable[[int | None, dict[str, Any]], None] | None) -> None:
    global _log
    _log = log


def active() -> bool:
    return _log is not None


def log(step: int | None, values: dict[str, Any]) -> None:
    """Scalar metrics of this rank at ``step`` (None: the current step)."""
    if _log is not None:
        _log(step, values)
