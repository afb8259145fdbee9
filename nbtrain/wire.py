"""What crosses the process boundary between the kernel and a rank, in one place.

A rank's control pipe (rank -> kernel) carries one message per ``send_bytes``: a one-byte
tag, then its body. The kernel's command pipe (kernel -> rank) carries rank 0's ``STORE``
message on to the other ranks, then (a ``RankPool``'s worker) pickled command dicts.

    tag  body                                        sent by
    P    pickle of the function's return value       every rank, last (a result)
    D    dill of it (cell-defined classes)           every rank, last (a result)
    E    JSON failure: rank, type, module,           every rank, last (a failure)
         message, traceback
    S    ASCII port of rank 0's TCPStore             rank 0, at start
    C    nothing: this rank reached the store        every rank, at start
    J    nothing: every rank's group is up           every rank, at start
    A    JSON activity: collectives, optimizer steps every rank, before a result
    R    nothing: a pool worker's group is up        pool workers, at start
    V    JSON {"repr": str | None} of a cell         pool workers, per command
    M    JSON of what the rank holds (memory)        pool workers, per command

``Outcome`` is what ``Run`` reads once the ranks are done, whoever ran them: the local
``Supervisor``, a pool operation, torchrun's ranks or a watched job.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
import traceback
from collections.abc import Sequence
from typing import Any, Literal, Protocol

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

# Why a run's ranks were ended before they all returned; None: they returned (or one
# failed on its own and the others were ended because of it, see ``root_failure``).
Cause = Literal["failure", "stop", "timeout", "remote"] | None


class RankOutcome(Protocol):
    result: bytes | None  # a result message (P or D), once it returned
    failure: Any  # with rank, exc_type, message, traceback, hint; once it failed
    exitcode: int | None  # once its process ended here (None: it ran elsewhere)


@dataclasses.dataclass
class Reported:
    """A rank's outcome as a whole, for ranks that ran elsewhere (torchrun's, a SLURM
    job's)."""

    result: bytes | None = None
    failure: Any = None
    exitcode: int | None = None


class Outcome(Protocol):
    """What ``Run`` reads from whatever ran its ranks, once ``done`` is set."""

    done: threading.Event
    workers: dict[int, RankOutcome]
    teardown_cause: Cause
    timed_out_ranks: Sequence[int]  # the ranks still busy, when it is "timeout"
    crash: BaseException | None  # nbtrain's own failure while running them

    def root_failure(self) -> Any:
        """The failure that ended the run (the first rank's own), or None."""

    def request_stop(self, reason: str) -> None:
        """End the ranks (``run.stop()``)."""


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
def encode_failure(exc: BaseException, rank: int, skip: tuple[str, ...] = (),
                   hint: str = "") -> bytes:
    """The failure as JSON; leading frames of the files in ``skip`` (nbtrain's bootstrap)
    are left out of the traceback. ``hint``: what the rank adds (what to do)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next  # the user's frames only, not nbtrain's bootstrap
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    body = {"rank": rank, "type": type(exc).__name__, "module": type(exc).__module__,
            "message": str(exc), "traceback": text, "hint": hint}
    return FAILURE + json.dumps(body).encode()


def decode_failure(message: bytes) -> dict:
    """A failure message's fields: rank, type, module, message, traceback, hint."""
    return json.loads(message[1:])


def first_line(text: str) -> str:
    """A failure message's first line (the whole of a one-line message)."""
    return text.strip().splitlines()[0] if text.strip() else text


def label(text: str, rank: int) -> str:
    """Every line of ``text`` marked with the rank it came from."""
    return "\n".join(f"[rank {rank}] {line}" for line in text.rstrip().splitlines())


# -- the rest -----------------------------------------------------------------------------
def encode_activity(activity: dict[str, int]) -> bytes:
    return ACTIVITY + json.dumps(activity).encode()


def decode_json(message: bytes) -> Any:
    """The JSON body of an ``A``, ``V`` or ``M`` message."""
    return json.loads(message[1:])
