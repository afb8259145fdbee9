"""A rank that asks for input (``input()``, ``getpass``, a debugger's prompt after
``breakpoint()``, ``pdb.set_trace()`` or ``torch.distributed.breakpoint()``) is answered
from the cell that waits for it.

A rank has no terminal. A spawned rank's stdin is closed (``input()`` raised EOFError);
a forked rank's ``input`` was the kernel's, which sent its request on the kernel's socket
and waited for a reply that only the kernel can get: the rank hung, silent. Now the rank
writes its question as one record on its stdout, in order with what it printed before (a
debugger's listing): the display record's mark and framing (``display_record``), of the
Jupyter protocol's ``input_request``. The kernel's watch posts it here (``post``); the
cell that waits for the ranks (``Run.wait``, a ``%%ranks`` cell) asks it with the
kernel's own ``input`` (in Jupyter, a box under the cell; in a terminal, the terminal),
the prompt labelled with the rank, and the answer goes back on the rank's command pipe
(``ANSWER``). Where nothing can answer (nbclient, whose frontend takes no input; a
script whose stdin is closed), the rank's ``input`` raises EOFError saying why, as a
script's does at the end of its input; a debugger then quits. Like ``wire.py``, it
imports nothing of nbtrain but the record's framing and the answer's kind (``wire``).
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import getpass
import json
import threading
import time
from collections.abc import Callable

from .display_record import Display, encode_display
from .wire import ANSWER  # kernel -> rank, on its command pipe: JSON {"text", "error"}

NOTICE_S = 1.0  # a question nothing asked within this long is pointed out in the cell
_HEAD = '{"msg_type": "input_request"'  # how a question's record starts


def encode_question(prompt: str, password: bool = False) -> bytes:
    return encode_display(Display("input_request", {"prompt": prompt, "password": password}))


def question_in(record: str) -> tuple[str, bool] | None:
    """A record's prompt and whether it asks for a password; None if it is a display."""
    if not record.startswith(_HEAD):
        return None
    try:
        content = json.loads(record)["content"]
        return str(content.get("prompt", "")), bool(content.get("password", False))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str | None  # what was typed; None when nothing could answer
    error: str = ""  # why nothing could


def encode_answer(answer: Answer) -> bytes:
    return ANSWER + json.dumps(dataclasses.asdict(answer)).encode()


def decode_answer(data: bytes) -> Answer:
    """An answer; ValueError for anything else (a command sent to a busy pool rank)."""
    if data[:1] != ANSWER:
        raise ValueError(f"not an answer to a rank's question: {data[:40]!r}")
    try:
        body = json.loads(data[1:])
        return Answer(body["text"], body.get("error", ""))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"a malformed answer: {data[:200]!r}") from err


# -- the kernel's side -----------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Question:
    """A question from a rank, as the watch that read it posts it."""

    rank: int
    prompt: str
    password: bool
    reply: Callable[[bytes], None]  # sends an encoded answer to the rank
    alive: Callable[[], bool]  # the rank still runs (else its question is dropped)
    taken: threading.Event = dataclasses.field(default_factory=threading.Event)


_waiting: collections.deque[Question] = collections.deque()
_lock = threading.Lock()


class _serving:
    at = -float("inf")  # when a cell last looked for questions (``answer_waiting``)
    asking = False  # a cell asks one now (someone types)


def post(question: Question, notice: Callable[[str], None]) -> None:
    """Queue ``question`` for the next cell that waits (``answer_waiting``). If none asks
    it within ``NOTICE_S`` (a run in the background), ``notice`` gets a line that says
    how to answer it."""
    with _lock:
        _waiting.append(question)

    def unasked() -> None:
        if question.taken.is_set() or not question.alive():
            return
        if _serving.asking or time.monotonic() - _serving.at < NOTICE_S:
            later(NOTICE_S)  # a cell waits (it asks another rank's question first)
            return
        notice(f"nbtrain: rank {question.rank} waits for input (input(), a debugger) "
               "and no cell waits for this run to ask it: run.wait() in a cell does "
               "(nbtrain.last_run().wait()).")

    def later(delay: float) -> None:
        timer = threading.Timer(delay, unasked)
        timer.daemon = True
        timer.start()

    later(NOTICE_S)


def answer_waiting() -> None:
    """Ask every question ranks are waiting on, one after another, and send each answer
    back: from the thread a cell waits in (the main one), with the kernel's ``input`` (or
    ``getpass``). What cannot ask (no frontend input, a closed stdin) answers "nothing",
    with its reason. An interrupt while asking leaves the question for the next wait."""
    if threading.current_thread() is not threading.main_thread():
        return
    _serving.at = time.monotonic()
    while True:
        with _lock:
            if not _waiting:
                return
            question = _waiting.popleft()
        if not question.alive():
            continue
        question.taken.set()
        prompt = f"[rank {question.rank}] {question.prompt}"
        _serving.asking = True
        try:
            ask = getpass.getpass if question.password else builtins.input
            answer = Answer(ask(prompt))
        except KeyboardInterrupt:
            with _lock:
                _waiting.appendleft(question)
            question.taken.clear()
            raise
        except Exception as err:  # StdinNotImplementedError, EOFError, pytest's capture
            if isinstance(err, EOFError):  # a terminal's closed stdin: the prompt shows
                print()
            answer = Answer(None, f"{type(err).__name__}: {err}".rstrip(": "))
        finally:
            _serving.asking, _serving.at = False, time.monotonic()
        try:
            question.reply(encode_answer(answer))
        except (OSError, ValueError):  # it is gone meanwhile
            pass
