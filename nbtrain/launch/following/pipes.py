"""A rank's stdout or stderr as the kernel reads it: whole lines, in order with the
display records a forked rank writes between them (``display_record.DISPLAY_MARK``, taken out
where they stand, mid-line too), and a line redrawn in place with carriage returns (a
progress bar: tqdm, a transformers Trainer's) kept to what a terminal shows of it, its
redraws reported as they come instead of held until its newline."""

from __future__ import annotations

import codecs
import re
import time

from ...display_record import DISPLAY_MARK

# what gloo writes as a group starts (torch 2.10 and 2.11 do): not the user's output
GLOO_START = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


class PipeText:
    """``feed(data)`` gives ``(kind, text)`` pairs in order: ``(stream, line)`` for a
    whole line, ``("display", record)``, and ``(stream + "-live", shown)`` when the line
    still being redrawn shows something new (``""``: it ended or cleared itself)."""

    def __init__(self, stream: str):
        self.stream = stream
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self.partial = ""  # the line not ended yet (of a redrawn one: what shows, then
        self.live: str | None = None  # its last redraw); what it showed as reported
        self.since: float | None = None  # when the line not ended yet began

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        text = self.partial + self._decode(data)  # a character split between reads waits
        if "\r" not in text and DISPLAY_MARK not in text and self.live is None:
            *lines, self.partial = text.split("\n")  # plain lines: the common case
            self._begun(bool(lines))
            return [(self.stream, line) for line in lines]
        items: list[tuple[str, str]] = []
        start = 0
        pending = ""  # a line's start, before a record that stood in it
        while (end := text.find("\n", start)) >= 0:
            piece = text[start:end]
            start = end + 1
            mark = piece.find(DISPLAY_MARK)
            if mark >= 0:
                pending += piece[:mark]
                items.append(("display", piece[mark + len(DISPLAY_MARK):]))
                continue
            line, pending = pending + piece, ""
            if self.live is not None:  # the redrawn line ended
                self.live = None
                items.append((self.stream + "-live", ""))
            if "\r" in line:
                line = redrawn(line)
                if line is None:  # it cleared itself
                    continue
            items.append((self.stream, line))
        self.partial = pending + text[start:]
        self._begun(start > 0)
        shown = None
        if DISPLAY_MARK in self.partial:
            pass
        elif "\r" in self.partial:
            *before, last = self.partial.split("\r")
            self.partial = (redrawn("\r".join(before)) or "") + "\r" + last
            shown = redrawn(self.partial) or ""
        elif self.live is not None:  # an unended line shown already (``waiting``) grew
            shown = self.partial
        if shown is not None and shown != (self.live or ""):
            self.live = shown
            items.append((self.stream + "-live", shown))
        return items

    def _begun(self, ended: bool) -> None:
        if not self.partial:
            self.since = None
        elif ended or self.since is None:
            self.since = time.monotonic()

    def waiting(self, now: float, after: float) -> str | None:
        """The unended line, once it has stood ``after`` seconds unshown (``print("epoch
        1 ...", end="")`` before a long step; a terminal shows it): from now on it is
        shown as a line redrawn in place is, until it ends. None otherwise."""
        if self.live is not None or self.since is None or now - self.since < after \
                or "\r" in self.partial or DISPLAY_MARK in self.partial:
            return None
        self.live = self.partial
        return self.partial

    def end(self) -> str | None:
        """The unended line, as shown, once the pipe is closed (or the rank is gone)."""
        rest, self.partial, self.live = self.partial, "", None
        return redrawn(rest) if "\r" in rest else rest or None


def redrawn(line: str) -> str | None:
    """What a terminal shows of a line redrawn in place: each carriage return goes back
    to its start and overwrites it. None when nothing is left (a bar that cleared
    itself)."""
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part):]
    return shown.rstrip() or None
