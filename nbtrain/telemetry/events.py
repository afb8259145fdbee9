"""Typed events that cross from a worker to the kernel.

Each event is a frozen dataclass carrying ``rank``, ``step`` and ``t`` (``time.monotonic()``,
one clock for every process on the host). On the wire an event is a JSON object with a
schema version ``v`` and its ``kind``; the kernel never unpickles what a worker sends.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Literal

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"
    rank: int
    step: int
    t: float


@dataclass(frozen=True)
class Metric(Event):
    """Values from one ``ctx.log(...)`` call."""

    kind: ClassVar[str] = "metric"
    values: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Lifecycle(Event):
    """A rank started its function, finished it, or failed in it."""

    kind: ClassVar[str] = "lifecycle"
    state: Literal["started", "finished", "failed"] = "started"
    detail: str = ""


EVENT_TYPES: dict[str, type[Event]] = {cls.kind: cls for cls in (Metric, Lifecycle)}


def encode(event: Event) -> bytes:
    body = {"v": SCHEMA_VERSION, "kind": event.kind, **asdict(event)}
    return json.dumps(body, separators=(",", ":"), allow_nan=True).encode()


def decode(data: bytes) -> Event | None:
    """The event in ``data``, or ``None`` when it is not a well-formed event of a known kind."""
    try:
        body: Any = json.loads(data)
        cls = EVENT_TYPES[body["kind"]]
        if body.get("v") != SCHEMA_VERSION:
            return None
        values = {f.name: body[f.name] for f in fields(cls) if f.name in body}
        event = cls(**values)
        if not isinstance(event.rank, int) or not isinstance(event.step, int):
            return None
        if isinstance(event, Metric) and not (
                isinstance(event.values, dict)
                and all(isinstance(v, (int, float)) for v in event.values.values())):
            return None
        return event
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
