"""A forked rank's displays as they cross to the kernel: one record a line on the rank's
stdout, between its own lines (``rank/displays.py`` writes them, ``launch/following/pipes.py``
takes them out, ``output.CellOutput`` publishes them in the cell). Like ``wire.py``, it
imports nothing of nbtrain."""

from __future__ import annotations

import dataclasses
import json

# One record a line: this mark, then JSON.
DISPLAY_MARK = "\x1enbtrain-display:"
DISPLAYED = ("display_data", "update_display_data")


@dataclasses.dataclass(frozen=True)
class Display:
    """One IOPub message a rank's shell would have sent (``DISPLAYED``): a display, or
    an update of one by its ``display_id``."""

    msg_type: str
    content: dict
    metadata: dict = dataclasses.field(default_factory=dict)


def encode_display(display: Display) -> bytes:
    return (DISPLAY_MARK + json.dumps(dataclasses.asdict(display), default=str)
            + "\n").encode()


def decode_display(record: str) -> Display:
    """A record's JSON (what follows ``DISPLAY_MARK`` up to the end of its line)."""
    try:
        body = json.loads(record)
        display = Display(**body)
    except (ValueError, TypeError) as err:
        raise ValueError(f"a display record that is not one: {record[:200]!r}") from err
    if display.msg_type not in DISPLAYED or not isinstance(display.content, dict) \
            or not isinstance(display.metadata, dict):
        raise ValueError(f"a display record of no kind a rank displays: {record[:200]!r}")
    return display
