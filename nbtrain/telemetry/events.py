"""Typed events that cross from a worker to the kernel.

Each event is a frozen dataclass carrying ``rank``, ``step`` and ``t`` (``time.monotonic()``,
one clock for every process on the host). On the wire an event is a JSON object with a
schema version ``v`` and its ``kind``, or (a rank's batch, for a listener of protocol 4)
a row of its values in field order; the kernel never unpickles what a worker sends.
A field is only ever added at the end of its event: a row from a newer rank then has
values past the fields known here (left out), one from an older rank fewer (defaults).
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"
    rank: int
    step: int
    t: float

    @classmethod
    def of(cls, **fields: Any) -> Event:
        """``cls(**fields)`` when ``fields`` are all of the event's: made without the
        generated ``__init__``'s ``object.__setattr__`` a field (the price of frozen),
        1.2 -> 0.2 µs for a ``Step``; a tiny step makes three, and the kernel as many."""
        return _made(cls, fields)


@dataclass(frozen=True)
class Metric(Event):
    """Values from one ``ctx.log(...)`` call."""

    kind: ClassVar[str] = "metric"
    values: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Step(Event):
    """One training step (a batch from ``ctx.dataloader``, or one optimizer step)."""

    kind: ClassVar[str] = "step"
    duration: float = 0.0  # seconds, from this step's batch to the next one
    samples: int = 0  # samples in the step's batch on this rank
    epoch: int = 0  # ctx.dataloader's epoch (0-based)
    epoch_steps: int = 0  # batches per epoch (0: unknown)
    total_steps: int = 0  # what the function said it will run (ctx.total_steps; 0: unknown)
    # where the duration went, in seconds: data, forward, backward, optimizer, comm (waited
    # for), other (telemetry/timing.py); empty when not measured
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Memory(Event):
    """Bytes by category on this rank, after an optimizer step.

    Categories measured from the tensors themselves (the same on CPU and CUDA):
    ``params``, ``grads``, ``optimizer`` — each rank's local shards, shared storage
    counted once. On CUDA also ``cuda_allocated``, ``cuda_reserved``, ``cuda_peak`` (the
    allocator's peak since the previous step) and ``device_used`` (the driver's view,
    as ``nvidia-smi`` shows it, for the whole GPU).
    """

    kind: ClassVar[str] = "memory"
    values: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Comm(Event):
    """Collectives issued during each step of a run of ``steps`` consecutive steps from
    ``step`` (each the same), by op type: calls and logical bytes. A rank sends one for
    each run of identical steps (most of training: the same buckets, the same gathers),
    when the run ends and at least every ``recorder.COMM_EVERY_S``; ``t``: its last step's
    end."""

    kind: ClassVar[str] = "comm"
    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    steps: int = 1

    @property
    def last(self) -> int:
        """The run's last step."""
        return self.step + self.steps - 1


@dataclass(frozen=True)
class Lifecycle(Event):
    """A rank started its function, finished it, or failed in it (with the traceback)."""

    kind: ClassVar[str] = "lifecycle"
    state: Literal["started", "finished", "failed"] = "started"
    detail: str = ""


@dataclass(frozen=True)
class Output(Event):
    """One whole line a worker wrote to stdout or stderr."""

    kind: ClassVar[str] = "output"
    stream: Literal["stdout", "stderr"] = "stdout"
    line: str = ""


@dataclass(frozen=True)
class Checkpoint(Event):
    """Rank 0: every rank finished writing a checkpoint (``ctx.save``) at ``path``.
    ``resumes``: a restart may go on from it (``ctx.checkpoint_every``'s, or a
    ``ctx.save(..., resume=True)``); a restart goes on from the last such one
    (``launch(max_restarts=...)``), never from another save (a best model's)."""

    kind: ClassVar[str] = "checkpoint"
    path: str = ""
    resumes: bool = False


@dataclass(frozen=True)
class Restart(Event):
    """The kernel: attempt ``attempt`` ended by ``cause`` at ``step`` (the last step a
    rank reported) and the run starts again (from ``resume``, a checkpoint, if any)."""

    kind: ClassVar[str] = "restart"
    attempt: int = 1
    cause: str = ""
    resume: str = ""


@dataclass(frozen=True)
class Evaluation(Event):
    """An evaluation pass on this rank (a ``ctx.dataloader`` pass begun after
    ``model.eval()``; ``step``: the training step before it): ``done`` of its ``batches``,
    sent as it begins, about once a second while it runs, and as it ends."""

    kind: ClassVar[str] = "evaluation"
    done: int = 0
    batches: int = 0


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls for cls in (Metric, Step, Memory, Comm, Lifecycle, Output, Checkpoint,
                              Restart, Evaluation)}


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=True)


def _body(event: Event) -> dict[str, Any]:
    # vars(), not dataclasses.asdict: the fields are flat (numbers, strings, dicts of
    # numbers), and asdict's deep copy was most of a worker's ~12 µs per event.
    return {"v": SCHEMA_VERSION, "kind": event.kind, **vars(event)}


def encode(event: Event) -> bytes:
    return _JSON.encode(_body(event)).encode()


def encode_many(events: list[Event]) -> bytes:
    """Several events as one JSON array: a rank's batch goes out as one frame, which the
    kernel parses at once (per event, 1.7 µs instead of 5 to parse and 2.8 instead of 4.3
    to encode, measured; a tiny step sends three)."""
    return _JSON.encode([_body(e) for e in events]).encode()


def encode_rows(events: list[Event]) -> bytes:
    """Several events as one frame of rows, ``{"v": 1, "rows": [[kind, rank, step, t,
    ...], ...]}`` (protocol 4): what the kernel reads is the same, in a third of the
    bytes, without each event's keys to encode (the sender holds the GIL the loop waits
    for meanwhile); a full-precision float's repr, ~0.5 µs, is the same either way."""
    return _JSON.encode({"v": SCHEMA_VERSION,
                         "rows": [(e.kind, *_VALUES[e.kind](e)) for e in events]}).encode()


# each kind's field names, and those that hold a mapping of numbers (checked on decode)
_FIELDS = {kind: tuple(f.name for f in fields(cls)) for kind, cls in EVENT_TYPES.items()}
_MAPPINGS = {kind: tuple(n for n in ("values", "counts", "bytes", "phases") if n in names)
             for kind, names in _FIELDS.items()}
_VALUES = {kind: operator.attrgetter(*names) for kind, names in _FIELDS.items()}


def decode(data: bytes) -> Event | None:
    """The event in ``data``, or ``None`` when it is not a well-formed event of a known kind."""
    try:
        return _event(json.loads(data))
    except (ValueError, UnicodeDecodeError):
        return None


def decode_many(data: bytes) -> list[Event | None]:
    """The events of a frame: one event, ``encode_many``'s array of them or
    ``encode_rows``' rows (``None`` for each that is not well formed)."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return [None]
    if isinstance(body, list):
        return [_event(b) for b in body]
    if isinstance(body, dict) and isinstance(body.get("rows"), list):
        if body.get("v") != SCHEMA_VERSION:
            return [None] * len(body["rows"])
        return [_row(r) for r in body["rows"]]
    return [_event(body)]


def _made(cls: type[Event], fields: dict[str, Any]) -> Event:
    """``cls(**fields)``, faster when ``fields`` names every field (``Event.of``)."""
    if fields.keys() != _NAMES[cls]:
        return cls(**fields)
    event = object.__new__(cls)
    event.__dict__.update(fields)
    return event


def _row(row: Any) -> Event | None:
    try:
        kind = row[0]
        names = _FIELDS[kind]
        if len(row) > len(names):  # every field (values past them, a newer rank's, left out)
            event = object.__new__(EVENT_TYPES[kind])
            event.__dict__.update(zip(names, row[1:], strict=False))
            return _checked(kind, event)
        # fewer values than fields (an older rank's): the rest take their defaults
        return _checked(kind, EVENT_TYPES[kind](**dict(zip(names, row[1:], strict=False))))
    except (KeyError, TypeError, IndexError):
        return None


def _event(body: Any) -> Event | None:
    try:
        kind = body.pop("kind")
        if body.pop("v", None) != SCHEMA_VERSION:
            return None
        cls = EVENT_TYPES[kind]
        try:
            event = _made(cls, body)
        except TypeError:  # a field this version does not know (a newer rank's): left out
            event = cls(**{name: body[name] for name in _FIELDS[kind] if name in body})
        return _checked(kind, event)
    except (KeyError, TypeError, AttributeError):
        return None


def _checked(kind: str, event: Event) -> Event | None:
    """``event`` (made with every field of ``kind``) if they are well formed, else None."""
    if type(event.rank) is not int or type(event.step) is not int:
        return None
    for name in _MAPPINGS[kind]:
        mapping = getattr(event, name)
        if not (isinstance(mapping, dict) and _NUMBERS.issuperset(map(type, mapping.values()))):
            return None
    if kind == "comm" and not (type(event.steps) is int and event.steps >= 1):
        return None
    return event


_NUMBERS = frozenset((int, float))
_NAMES = {cls: frozenset(f.name for f in fields(cls)) for cls in EVENT_TYPES.values()}
