"""Imported by the fork server before it forks any rank (``launch/starting/forkserver``'s
preload), and by nothing else: it makes the plain IPython shell that every rank of a
kernel gets to pass its displays on (``displays.own_shell``), once, so each rank forked
from the server inherits it instead of building its own (35-45 ms of each rank's start on
2 cores, the larger part of what the fork server's warm launch paid over fork's)."""

from __future__ import annotations

from .displays import plain_shell

try:
    plain_shell()
except Exception:  # a preload that raised would end the server: each rank makes its own
    pass
