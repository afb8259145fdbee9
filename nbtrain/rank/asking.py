"""A rank's ``input()`` and ``getpass.getpass()`` ask the cell that waits for the run
(``questions.py`` says how): a debugger's prompt (``breakpoint()``, ``pdb``,
``torch.distributed.breakpoint()``) reads through ``input`` too, so a rank can be
debugged from the notebook. ``breakpoint()`` is Python's own (pdb) again in a rank."""

from __future__ import annotations

import builtins
import getpass
import sys

from ..questions import decode_answer, encode_question
from .displays import write_record


def install(commands, rank: int) -> None:
    """From now on this process's ``input`` and ``getpass`` ask the kernel, whose answer
    comes on ``commands`` (the rank's command pipe)."""

    def ask(prompt: object = "", password: bool = False) -> str:
        try:
            sys.stderr.flush()  # what came before shows before it (stdout: write_record)
        except Exception:
            pass
        write_record(encode_question(str(prompt), password))
        try:
            answer = decode_answer(commands.recv_bytes())
        except (EOFError, OSError) as err:  # the kernel went away, or closed the pipe
            raise EOFError(f"rank {rank} asked for input and the kernel is gone") from err
        except ValueError as err:  # the pool sent a command: it is ending this one
            raise EOFError(f"rank {rank} asked for input and no answer came") from err
        if answer.text is None:
            why = f"rank {rank} asked for input and nothing could answer it ({answer.error})"
            print(f"nbtrain: {why}: run the launch in a notebook (an input box shows "
                  "under the cell) or a terminal, or remove the input() or breakpoint().",
                  file=sys.stderr, flush=True)
            raise EOFError(why)
        return answer.text

    def rank_input(prompt: object = "") -> str:
        return ask(prompt)

    def rank_getpass(prompt: str = "Password: ", stream=None) -> str:
        return ask(prompt, password=True)

    builtins.input = rank_input
    getpass.getpass = rank_getpass
    # A kernel's breakpoint() waits for its visual debugger (ipykernel hands it to
    # debugpy), which never reaches a rank: there it did nothing. Python's own hook
    # (pdb, or what PYTHONBREAKPOINT names; 0 turns breakpoints off) asks as above.
    sys.breakpointhook = sys.__breakpointhook__
