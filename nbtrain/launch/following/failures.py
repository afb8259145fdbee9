"""How each way a rank ends reads as a ``Failure``: the exception it reported, a signal
or an exit code, a death in native code (with the stack it wrote as it died,
``stacks.py``), and a communication error that was the rank's own doing."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from ...errors import COLLECTIVE_MISMATCH, peers_returned_hint, signal_hint, signal_name
from ...outcome import Ending
from ...wire import RankFailure
from .stacks import Dump, native_message

_COMM_ERROR = re.compile(r"gloo|nccl|connection (closed|reset) by peer|broken pipe|"
                         r"DistBackendError|DistNetworkError|DistStoreError|Socket Timeout",
                         re.IGNORECASE)
# torch's re-raise of an exception from another process or thread (``unwrapped``)
_RERAISED = re.compile(r"Caught (\w+) (.+?)\.\nOriginal Traceback \(most recent call last\):\n")


@dataclass
class Failure:
    rank: int
    exc_type: str
    message: str
    traceback: str
    t: float
    # Not the root cause: a communication error caused by another rank's death, or the
    # KeyboardInterrupt of a rank that nbtrain interrupted.
    secondary: bool = False
    hint: str = ""
    # nbtrain's doing: the error of a rank freed from a stuck collective (a pool's peers
    # left its process group), shown as the rank being stopped, not as its failure
    stopped: bool = False
    ending: Ending = Ending.RAISED  # how it failed (what a restart may cure)

# a fault in the rank's own native code, not a signal from outside
CRASHES = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE")


def communication_error(text: str) -> bool:
    """An exception's text says a collective or the store failed (a peer gone): what
    follows another rank's failure, not a failure of its own."""
    return bool(_COMM_ERROR.search(text))


def reported_failure(rank: int, body: RankFailure, interrupted: bool) -> Failure:
    """The exception a rank reported; ``interrupted``: nbtrain interrupted the rank."""
    text = f"{body.type}: {body.message}\n{body.traceback}"
    interrupt = interrupted and body.type == "KeyboardInterrupt"
    comm = communication_error(text)
    ending = (Ending.INTERRUPTED if interrupt
              else Ending.MISMATCH if COLLECTIVE_MISMATCH.search(body.message)
              else Ending.COMMUNICATION if comm else Ending.RAISED)
    return Failure(rank, body.type, unwrapped(body.message), body.traceback, time.monotonic(),
                   hint=body.hint, secondary=interrupt or comm, ending=ending)


def unwrapped(message: str) -> str:
    """torch raises a DataLoader worker's exception again in the rank (a pin-memory
    thread's, a DataParallel replica's) with that process's whole traceback as the
    message: the original exception's own message, and where it was raised. The
    traceback, which keeps all of it, is the rank's to show."""
    found = _RERAISED.match(message)
    if found is None:
        return message
    lines = message[found.end():].rstrip("\n").splitlines()
    last = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=None)
    if last is None:
        return message
    rest = lines[last + 1:]
    while rest and rest[0].startswith(" "):  # the frame's source and its carets
        rest = rest[1:]
    original = "\n".join(rest).strip()
    kind = f"{found.group(1)}: "
    original = original[len(kind):] if original.startswith(kind) else original
    return f"{original} (raised {found.group(2)})" if original else message



def exit_failure(rank: int, exitcode: int, exit_hint: str = "",
                 dying: list[str] | None = None, before: list[str] = ()) -> Failure:
    """A rank that exited without a report: killed by a signal, or an exit code (code 1:
    ``exit_hint``, what its launcher says that usually means). ``dying``: the stack it
    wrote as a fatal signal killed it, ``before``: its last stderr lines before that
    (what native code said)."""
    if exitcode < 0:
        sig = -exitcode
        name = f"{signal_name(sig)} (signal {sig})"
        ending = Ending.CRASHED if signal_name(sig) in CRASHES else Ending.KILLED
        if not dying:
            return Failure(rank, signal_name(sig), f"rank {rank} was killed by {name} "
                           "without a Python traceback", "", time.monotonic(),
                           hint=signal_hint(sig), ending=ending)
        native = native_message(list(before))
        if native and COLLECTIVE_MISMATCH.search(native):  # a native abort on a mismatch
            ending = Ending.MISMATCH
        return Failure(rank, signal_name(sig),
                       f"rank {rank} was killed by {name} in native code"
                       + (f": {native}" if native else ""),
                       Dump.parse(dying).traceback() or "\n".join(dying), time.monotonic(),
                       hint=signal_hint(sig, native), ending=ending)
    return Failure(rank, "WorkerExit", f"rank {rank} exited with code {exitcode} before "
                   "returning (os._exit() or a crash in native code?)", "", time.monotonic(),
                   hint=exit_hint if exitcode == 1 else "", ending=Ending.EXITED)


def with_stack(failure: Failure | None, exitcode: int | None, dying: list[str],
               before: list[str]) -> Failure | None:
    """The failure of a rank a signal killed, remade with the stack it wrote as it died
    (``dying``); None when that dump was not its death (it reported its own failure, or
    was ended by nbtrain)."""
    if failure is None or exitcode is None or exitcode >= 0 or failure.traceback or \
            failure.exc_type != signal_name(-exitcode):
        return None
    made = exit_failure(failure.rank, exitcode, dying=dying, before=before)
    made.t = failure.t
    return made


def explain_alone(failure: Failure, returned: list[int], world_size: int) -> None:
    """The only failure of a run, a communication error, while every other rank had
    returned: not a peer's death but a collective this rank ran and they did not."""
    if failure.secondary and not failure.hint and len(returned) == world_size - 1:
        failure.secondary, failure.hint = False, peers_returned_hint(failure.rank, returned)
        failure.ending = Ending.MISMATCH
