"""A rank forked from a kernel shows its displays in the cell.

Such a rank inherits the kernel's IPython shell: ``display()`` and a transformers
Trainer's notebook progress table (``display(..., display_id=True)``, then updates)
publish through the kernel's session, which refuses to send from another process
(ipykernel logs "attempted to send message from fork" and drops the message: nothing
shows). Here the session's ``send`` writes a display, or an update of one, as one record
(``display_record.DISPLAY_MARK``) on the rank's stdout, in order with its prints; the
kernel publishes it in the cell that launched (``output.CellOutput``).

Widgets are not passed on: their comms live in the rank, so the kernel could show them
but not keep them (a page reload, nbclient's Output-widget emulation), and an Output
widget's capture (rich's live display) and ``clear_output`` would reach into the cell
nbtrain's view and the other ranks share. Their messages are dropped, as ipykernel
dropped them; an Output widget is shown as a display that what it captures replaces
(rich's live display, Lightning's default bar with rich installed, draws in one:
``_Forwarder``); tqdm draws its text bar instead (``_no_widgets``). A rank spawned or forked by the fork
server for a kernel gets a plain shell of its own whose displays go the same way
(``own_shell``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

from ..display_record import DISPLAYED, Display, encode_display

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def forward() -> bool:
    """Route the inherited shell's displays to this rank's stdout; False without one."""
    module = sys.modules.get("IPython.core.interactiveshell")
    if module is None or not module.InteractiveShell.initialized():
        return False
    shell = module.InteractiveShell.instance()
    if getattr(shell, _PLAIN, False):  # the fork server's, not a kernel's: own_shell's
        return False
    sessions = [getattr(getattr(shell, "display_pub", None), "session", None),
                getattr(getattr(shell, "kernel", None), "session", None)]
    _no_widgets(shell)
    forwarder = _Forwarder()
    done = set()
    for session in sessions:
        if session is not None and id(session) not in done and hasattr(session, "msg"):
            done.add(id(session))
            session.send = forwarder.sender(session)
    return bool(done)


def flush() -> None:
    """What an Output widget's stand-in still waits to show, now (the rank is leaving,
    or its pool command ends)."""
    if _Forwarder.active is not None:
        _Forwarder.active.flush()


class _Forwarder:
    """A forked rank's shell messages as records: displays and their updates as they
    are; an Output widget (rich's live display draws in one: Lightning's default bar
    when rich is installed) as a display standing in for it, which what the widget
    captures replaces (at most ``REDRAW_S`` apart, the last always shown)."""

    REDRAW_S = 0.2
    active: _Forwarder | None = None

    def __init__(self):
        self.lock = threading.Lock()
        self.capturing: list[str] = []  # the Output widgets capturing now (comm ids)
        self.stand_ins: dict[str, str] = {}  # an Output widget's comm id -> display id
        self.shown_at: dict[str, float] = {}
        self.waiting: dict[str, bytes] = {}  # a stand-in's update that came too soon
        self.timer: threading.Timer | None = None
        _Forwarder.active = self

    def sender(self, session):
        def send(stream, msg_or_type, content=None, parent=None, ident=None, buffers=None,
                 track=False, header=None, metadata=None):
            if isinstance(msg_or_type, dict):
                msg = msg_or_type
            else:
                msg = session.msg(msg_or_type, content, parent=parent, header=header,
                                  metadata=metadata)
            self.take(msg["header"]["msg_type"], msg.get("content") or {},
                      msg.get("metadata") or {})
            return msg

        return send

    def take(self, kind: str, body: dict, metadata: dict) -> None:
        if kind == "comm_msg":  # an Output widget's capture begins (its msg_id) or ends
            state = (body.get("data") or {}).get("state") or {}
            comm = body.get("comm_id")
            if "msg_id" in state:
                if state["msg_id"]:
                    self.capturing.append(comm)
                elif comm in self.capturing:
                    self.capturing.remove(comm)
        elif kind == "comm_close" or (kind == "clear_output" and not body.get("wait")):
            comm = body.get("comm_id") if kind == "comm_close" else \
                (self.capturing[-1] if self.capturing else None)
            if comm in self.stand_ins:  # a closed or cleared widget shows nothing
                self.stand_in(comm, {"data": {"text/plain": ""}, "metadata": {}})
        elif kind in DISPLAYED and WIDGET_VIEW not in body.get("data", {}):
            if self.capturing and kind == "display_data":
                self.stand_in(self.capturing[-1], body)
            else:
                with self.lock:
                    write_record(encode_display(Display(kind, body, metadata)))

    def stand_in(self, comm: str, body: dict) -> None:
        first = comm not in self.stand_ins
        display_id = self.stand_ins.setdefault(comm, uuid.uuid4().hex)
        content = {"data": body.get("data", {}), "metadata": body.get("metadata", {}),
                   "transient": {"display_id": display_id}}
        record = encode_display(Display("display_data" if first else "update_display_data",
                                        content, {}))
        with self.lock:
            now = time.monotonic()
            if first or (now - self.shown_at.get(comm, 0.0) >= self.REDRAW_S
                         and comm not in self.waiting):
                self.shown_at[comm] = now
                write_record(record)
                return
            self.waiting[comm] = record
            if self.timer is None:
                self.timer = threading.Timer(self.REDRAW_S, self.flush)
                self.timer.daemon = True
                self.timer.start()

    def flush(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            for comm, record in self.waiting.items():
                self.shown_at[comm] = time.monotonic()
                write_record(record)
            self.waiting.clear()


def own_shell() -> bool:
    """A rank spawned (or forked by the fork server) for a kernel has no shell of its own:
    ``display()`` printed the text, a display handle was None (its ``update`` failed), a
    matplotlib figure read "Figure(640x480)". Give it a plain IPython shell (no history
    file, no kernel app) whose displays are written as records, as a forked rank's are."""
    shell = plain_shell()
    if shell is None or getattr(shell, "_nbtrain_publishes", False):
        return False
    shell._nbtrain_publishes = True
    forwarder = _Forwarder()  # what a forked rank's session sends, from this publisher

    def publish(data, metadata=None, source=None, *, transient=None, update=False, **_):
        content = {"data": data, "metadata": metadata or {}, "transient": transient or {}}
        forwarder.take("update_display_data" if update else "display_data", content,
                       metadata or {})

    shell.display_pub.publish = publish
    shell.display_pub.clear_output = lambda wait=False: None  # the cell is not the rank's
    return True


_PLAIN = "_nbtrain_plain"  # marks the shell plain_shell made: the pid of the process that made it


def plain_shell():
    """This process's plain IPython shell (no history file, no kernel app), made on the
    first call; None where IPython is missing or the process has another shell (a
    kernel's). The fork server makes it before it forks any rank
    (``rank/server_shell.py``): building it took 35-45 ms of each rank's start."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config
    except ImportError:
        return None
    if InteractiveShell.initialized():
        shell = InteractiveShell.instance()
        return shell if getattr(shell, _PLAIN, False) else None
    config = Config()
    config.HistoryManager.enabled = False  # not the kernel's sqlite file, from every rank
    shell = InteractiveShell.instance(config=config)
    setattr(shell, _PLAIN, os.getpid())
    return shell


def _no_widgets(shell) -> None:
    """tqdm draws its text bar here (it shows live, ``launch/following/pipes.py``), not a widget:
    what asks (``tqdm.auto`` on first import, transformers' ``is_in_notebook``: is the
    shell an ``IPKernelApp``'s?) hears no, and the notebook bar the kernel already
    imported (bound in transformers' ``ProgressCallback``, Lightning's bar, a cell's
    ``tqdm.auto``) loses its widget methods: it is tqdm's text bar, in this process."""
    try:
        shell.config.pop("IPKernelApp", None)
    except Exception:
        pass
    notebook = sys.modules.get("tqdm.notebook")
    bar = getattr(notebook, "tqdm", None)
    if not isinstance(bar, type):
        return
    for name, value in list(vars(bar).items()):
        if isinstance(value, (staticmethod, classmethod, property)) or callable(value):
            try:
                delattr(bar, name)
            except (AttributeError, TypeError):
                pass


def write_record(record: bytes) -> None:
    """One record on the rank's stdout (fd 1, the pipe the kernel reads), after what
    was printed before it."""
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
