"""What crosses the process boundary between the kernel and a rank, in one place.

A rank's control pipe (rank -> kernel) carries one message per ``send_bytes``: a one-byte
tag, then its body. The kernel's command pipe (kernel -> rank) carries rank 0's ``STORE``
message on to the other ranks, then (a ``RankPool``'s worker) its commands, and the
answers to a rank's questions (``questions.ANSWER``: its ``input()``, a debugger's).

    tag  body                                        sent by
    P    pickle of the function's return value       every rank, last (a result)
    D    dill of it (cell-defined classes)           every rank, last (a result)
    E    JSON ``RankFailure``                        every rank, last (a failure)
    S    ``StorePort``: rank 0's TCPStore, in ASCII   rank 0, at start
    C    nothing: this rank reached the store        every rank, at start
    J    nothing: every rank's group is up           every rank, at start
    A    JSON ``Activity``                           every rank, before a result
    R    nothing: a pool worker's group is up        pool workers, at start
    V    JSON ``CellValue``                          pool workers, per command
    M    JSON of what the rank holds (memory)        pool workers, per command

A pool's commands are the dataclasses below (``Exec``, ``LaunchRun``, ``Pull``, ``Push``,
``MemoryQuery``, ``Exit``), pickled (``encode_command``; ``decode_command`` refuses
anything else). Every reader decodes through the functions here: a malformed or unknown
message is a ``ValueError`` that says what arrived, never a ``KeyError`` deep in a reader.

What ``Run`` reads once the ranks are done is in ``outcome.py``.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import traceback
from typing import Any

RESULT_PICKLE = b"P"
RESULT_DILL = b"D"
FAILURE = b"E"
STORE = b"S"
AT_STORE = b"C"
JOINED = b"J"
ACTIVITY = b"A"
READY = b"R"
VALUE = b"V"
MEMORY = b"M"
ANSWER = b"I"  # kernel -> rank, on its command pipe: a question's answer (questions.py)

# -- results ------------------------------------------------------------------------------
def to_cpu(obj: Any) -> Any:
    """Tensors anywhere inside ``obj`` (dicts, lists, tuples) moved to CPU and detached."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        moved = {k: to_cpu(v) for k, v in obj.items()}
        try:  # keep OrderedDict and friends
            return moved if type(obj) is dict else type(obj)(moved)
        except TypeError:
            return moved
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        items = [to_cpu(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def encode_result(result: Any, rank: int) -> bytes:
    """A rank's return value, on CPU, as a result message: pickle, else dill (by value)."""
    result = to_cpu(result)
    try:
        return RESULT_PICKLE + pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    import dill

    try:  # cell-defined classes and the like travel by value
        return RESULT_DILL + dill.dumps(result, recurse=True)
    except Exception as err:
        where = _unpicklable_part(result)
        raise TypeError(
            f"rank {rank} returned a value that cannot be sent back to the kernel: {where} "
            f"({err}). Return plain data (numbers, strings, tensors, dicts and lists of "
            "them), e.g. ctx.full_state_dict(model) instead of the model.") from None


def decode_result(message: bytes) -> Any:
    """The value a result message holds."""
    if message[:1] == RESULT_PICKLE:
        return pickle.loads(message[1:])
    import dill

    return dill.loads(message[1:])


def _unpicklable_part(obj: Any, path: str = "the result") -> str:
    import dill

    children: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    for child_path, child in children:
        try:
            dill.dumps(child, recurse=True)
        except Exception:
            return _unpicklable_part(child, child_path)
    return f"{path} of type {type(obj).__name__}"


# -- failures -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RankFailure:
    """A failure message's body: the rank, the exception's type (and module), message and
    traceback, and the rank's ``hint`` (what to do; an out-of-memory error's measured
    remedies)."""

    rank: int
    type: str
    module: str
    message: str
    traceback: str
    hint: str = ""


def encode_failure(exc: BaseException, rank: int, skip: tuple[str, ...] = (),
                   hint: str = "") -> bytes:
    """The failure as JSON; leading frames of the files in ``skip`` (nbtrain's bootstrap)
    are left out of the traceback. ``hint``: what the rank adds (what to do)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next  # the user's frames only, not nbtrain's bootstrap
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    body = RankFailure(rank, type(exc).__name__, type(exc).__module__, str(exc), text, hint)
    return FAILURE + json.dumps(dataclasses.asdict(body)).encode()


def decode_failure(message: bytes) -> RankFailure:
    """A failure message (``E``) as a ``RankFailure``."""
    return _decode(message, FAILURE, RankFailure)


def first_line(text: str) -> str:
    """A failure message's first line (the whole of a one-line message)."""
    return text.strip().splitlines()[0] if text.strip() else text


def label(text: str, rank: int) -> str:
    """Every line of ``text`` marked with the rank it came from."""
    return "\n".join(f"[rank {rank}] {line}" for line in text.rstrip().splitlines())


# -- what else a rank says ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Activity:
    """What the function did (``A``): the collectives it issued on the run's group and
    the optimizer steps it took."""

    collectives: int = 0
    optimizer_steps: int = 0


def encode_activity(activity: Activity) -> bytes:
    return ACTIVITY + json.dumps(dataclasses.asdict(activity)).encode()


def decode_activity(message: bytes) -> Activity:
    return _decode(message, ACTIVITY, Activity)


@dataclasses.dataclass(frozen=True)
class CellValue:
    """A ``%%ranks`` cell's reply (``V``): the repr of its last expression, or None."""

    repr: str | None = None


def encode_value(value: CellValue) -> bytes:
    return VALUE + json.dumps(dataclasses.asdict(value)).encode()


def decode_value(message: bytes) -> CellValue:
    return _decode(message, VALUE, CellValue)


def encode_memory(figures: dict[str, int]) -> bytes:
    return MEMORY + json.dumps(figures).encode()


def decode_memory(message: bytes) -> dict[str, int]:
    """What a pool rank holds (``M``): bytes by name (tensors, RSS, CUDA's figures)."""
    figures = _json(message, MEMORY)
    if not isinstance(figures, dict) or not all(isinstance(v, int) for v in figures.values()):
        raise ValueError(f"a memory message that is not names and byte counts: {figures!r:.200}")
    return figures


@dataclasses.dataclass(frozen=True)
class StorePort:
    """Where rank 0's TCPStore listens (``S``): the kernel passes it on to the other
    ranks, which join the process group through it."""

    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"not a TCP port: {self.port!r}")


def encode_store(store: StorePort) -> bytes:
    return STORE + str(store.port).encode()


def decode_store(message: bytes) -> StorePort:
    """Rank 0's store port (``S``)."""
    if message[:1] != STORE or not message[1:].isdigit():
        raise ValueError(f"not a store message: {message[:40]!r}")
    return StorePort(int(message[1:]))


def _json(message: bytes, tag: bytes) -> Any:
    if message[:1] != tag:
        raise ValueError(f"expected a {tag.decode()!r} message, got {message[:40]!r}")
    try:
        return json.loads(message[1:])
    except ValueError as err:
        raise ValueError(f"a {tag.decode()!r} message whose body is not JSON: "
                         f"{message[:80]!r}") from err


def _decode(message: bytes, tag: bytes, kind: type):
    body = _json(message, tag)
    names = {f.name for f in dataclasses.fields(kind)}
    if not isinstance(body, dict) or not set(body) <= names:
        raise ValueError(f"a {tag.decode()!r} message that is not a {kind.__name__}: "
                         f"{message[:200]!r}")
    try:
        return kind(**body)
    except TypeError as err:  # a field missing
        raise ValueError(f"a {tag.decode()!r} message that is not a {kind.__name__} "
                         f"({err}): {message[:200]!r}") from None


# -- a RankPool's commands (kernel -> pool worker) ----------------------------------------
@dataclasses.dataclass(frozen=True)
class Exec:
    """A ``%%ranks`` cell: run ``code`` (compiled as ``filename``) in the rank's namespace;
    the reply is a ``CellValue`` or a failure."""

    code: str
    filename: str


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a run on a warm rank sets beside the pool's ``WorkerSpec`` (the fields of that
    name): where its telemetry goes, and its checkpoint and seeds."""

    telemetry_address: tuple[str, int] | None
    telemetry_token: str
    telemetry: Any  # nbtrain.Telemetry
    resume_from: str | None
    seed: int
    data_seed: int

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class LaunchRun:
    """``pool.launch``: the function (dill bytes of ``fn``, its arguments and strategy) run
    as a one-shot worker runs it, with ``settings``; the reply is a result or a failure."""

    payload: bytes
    settings: RunSettings


@dataclasses.dataclass(frozen=True)
class Pull:
    """A name of the rank's namespace, out (tensors on CPU): the reply is a result."""

    name: str


@dataclasses.dataclass(frozen=True)
class Push:
    """Names into the rank's namespace (``values``: dill bytes of a dict)."""

    values: bytes


@dataclasses.dataclass(frozen=True)
class MemoryQuery:
    """What the rank holds now: the reply is a memory message."""


@dataclasses.dataclass(frozen=True)
class Exit:
    """Leave the command loop and the process."""


@dataclasses.dataclass(frozen=True)
class DropGroup:
    """Shut down ``fds`` (this rank's TCP connections to the other ranks, ``links.py``)
    and destroy the process group, to free a peer stuck in a collective this rank is not
    in: its wait fails at once. Sent to idle ranks only; no reply."""

    fds: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Regroup:
    """Start the process group again (after ``DropGroup``), as the pool's start does; the
    reply is a ``CellValue`` once every rank has joined."""


Command = Exec | LaunchRun | Pull | Push | MemoryQuery | Exit | DropGroup | Regroup
COMMANDS = (Exec, LaunchRun, Pull, Push, MemoryQuery, Exit, DropGroup, Regroup)


def encode_command(command: Command) -> bytes:
    if not isinstance(command, COMMANDS):
        raise TypeError(f"not a pool command: {command!r}")
    return pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)


def decode_command(data: bytes) -> Command:
    try:
        command = pickle.loads(data)
    except Exception as err:
        raise ValueError(f"a pool command that does not unpickle: {err}") from None
    if not isinstance(command, COMMANDS):
        raise ValueError(f"not a pool command: {type(command).__name__}")
    return command
