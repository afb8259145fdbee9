"""A rank forked from a kernel shows its displays in the cell.

Such a rank inherits the kernel's IPython shell: ``display()``, a transformers Trainer's
notebook progress table and tqdm's notebook bars (``tqdm.auto`` in a kernel) publish
through the kernel's session, which refuses to send from another process (ipykernel
logs "attempted to send message from fork" and drops the message: nothing shows). Here
the session's ``send`` writes what it would have published instead, as one record
(``display_record.DISPLAY_MARK``) on the rank's stdout, in order with its prints; the kernel
publishes it in the cell that launched (``cells.CellOutput``). Widgets show and update
(their comm messages travel too); the kernel does not know their comms, so a change made
in the page does not reach the rank. A spawned rank has no shell: its ``display()``
prints the text, as a script's does.
"""

from __future__ import annotations

import os
import sys
import threading

from ..display_record import DISPLAYED, Display, encode_display


def forward() -> bool:
    """Route the inherited shell's displays to this rank's stdout; False without one."""
    module = sys.modules.get("IPython.core.interactiveshell")
    if module is None or not module.InteractiveShell.initialized():
        return False
    shell = module.InteractiveShell.instance()
    sessions = [getattr(getattr(shell, "display_pub", None), "session", None),
                getattr(getattr(shell, "kernel", None), "session", None)]
    lock = threading.Lock()
    done = set()
    for session in sessions:
        if session is not None and id(session) not in done and hasattr(session, "msg"):
            done.add(id(session))
            session.send = _sender(session, lock)
    return bool(done)


def _sender(session, lock: threading.Lock):
    def send(stream, msg_or_type, content=None, parent=None, ident=None, buffers=None,
             track=False, header=None, metadata=None):
        if isinstance(msg_or_type, dict):
            msg = msg_or_type
            buffers = buffers or msg.get("buffers")
        else:
            msg = session.msg(msg_or_type, content, parent=parent, header=header,
                              metadata=metadata)
        kind = msg["header"]["msg_type"]
        if kind in DISPLAYED:
            record = encode_display(Display(kind, msg.get("content") or {},
                                            msg.get("metadata") or {}, list(buffers or [])))
            with lock:
                _write(record)
        return msg

    return send


def _write(record: bytes) -> None:
    try:
        sys.stdout.flush()  # what was printed before it comes first
    except Exception:
        pass
    view = memoryview(record)
    while view:
        try:
            view = view[os.write(1, view):]
        except InterruptedError:
            continue
        except OSError:  # the kernel is gone
            return
