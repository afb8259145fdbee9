"""The rank's end of the telemetry channel (``channel.py`` has the listener and the wire
format): ``send`` only queues an event; a thread of its own proves the token (the
listener's HMAC challenge), then writes what is queued every 50 ms, often while the
training loop is in torch's C++ code without the GIL: up to ``BATCH`` events a frame."""

from __future__ import annotations

import collections
import dataclasses
import socket
import threading

from .channel import MAX_FRAME, PROTOCOL, RUNS_OF_STEPS, frame, handshake
from .events import Comm, Event, encode, encode_many, encode_rows

BATCH = 256  # events a frame holds at most (a row is 40-250 bytes; a frame, MAX_FRAME)


class TelemetryClient:
    """Worker side: ``send`` never blocks; a background thread writes batches."""

    def __init__(self, address: tuple[str, int], token: str, rank: int,
                 capacity: int = 10_000, flush_interval: float = 0.05,
                 connect_timeout: float = 30.0, hello: dict | None = None):
        self.rank = rank
        self.dropped = 0
        self._buf: collections.deque[Event] = collections.deque()
        self._capacity = capacity
        self._interval = flush_interval
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._queued = 0  # events queued so far, and how many of them are on the wire
        self._sent = 0
        self._sent_changed = threading.Condition()
        self.lost: str | None = None  # why the listener went away mid-run, if it did
        self._sock = socket.create_connection(tuple(address), timeout=connect_timeout)
        # hello: the rank, plus what a remote job says about itself (run id...)
        greeting = {**(hello or {}), "rank": rank}
        self._handshake = lambda: handshake(self._sock, token, greeting, connect_timeout)
        self._protocol = PROTOCOL  # the listener's: how a frame holds several events
        if greeting.get("ack") is True:
            # a listener elsewhere: the rank must know now whether it took the token
            try:
                self._protocol = self._handshake()
            except BaseException:
                self._sock.close()
                raise
            self._handshake = None
        # else (the kernel's own listener) the sender thread answers the challenge: the
        # rank goes on starting meanwhile instead of waiting for the kernel's thread
        self._thread = threading.Thread(target=self._loop, name="nbtrain-telemetry-send",
                                        daemon=True)
        self._thread.start()

    def send(self, event: Event) -> None:
        # The training loop only queues the (frozen) event; the sender thread encodes
        # it, often while the loop is in torch's C++ code without the GIL.
        with self._lock:
            if len(self._buf) >= self._capacity:
                self.dropped += 1
                return
            self._buf.append(event)
            self._queued += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until what is queued now is on the wire (what must not die with the rank:
        a checkpoint's report); False if it is not within ``timeout``."""
        with self._lock:
            target = self._queued
        self._wake.set()
        with self._sent_changed:
            return self._sent_changed.wait_for(
                lambda: self._sent >= target or self.lost is not None, timeout)

    def _take(self) -> tuple[bytes, int]:
        with self._lock:
            events = list(self._buf)
            self._buf.clear()
            upto = self._queued
        if self._protocol < RUNS_OF_STEPS:
            events = list(each_step(events))
        frames = []
        for i in range(0, len(events), BATCH):
            chunk = events[i:i + BATCH]
            body = None
            if self._protocol >= 3:  # rows (4), or an array of objects (3)
                try:
                    body = (encode_rows if self._protocol >= 4 else encode_many)(chunk)
                except Exception:  # one event that cannot be encoded must not end the stream
                    pass
            if body is not None and len(body) <= MAX_FRAME:
                frames.append(frame(body))
                continue
            for event in chunk:  # one at a time: what is too large or broken stays alone
                try:
                    frames.append(frame(encode(event)))
                except Exception:
                    self.dropped += 1
        return b"".join(frames), upto

    def _loop(self) -> None:
        if self._handshake is not None:
            try:
                self._protocol = self._handshake()
            except Exception as err:  # refused, or the kernel is gone: events are dropped
                self.lost = f"{type(err).__name__}: {err}"
                return
        while True:
            closing = self._closing
            chunk, upto = self._take()
            if chunk:
                try:
                    self._sock.sendall(chunk)
                except OSError as err:
                    self.lost = f"{type(err).__name__}: {err}"
                    with self._sent_changed:
                        self._sent_changed.notify_all()
                    return  # the kernel is gone; the supervisor will notice
            with self._sent_changed:
                self._sent = upto
                self._sent_changed.notify_all()
            if closing:
                return
            self._wake.wait(self._interval)
            self._wake.clear()

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is buffered and close, so the kernel has every event."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def each_step(events):
    """``events`` for a listener older than ``RUNS_OF_STEPS``, which counts a ``Comm`` as
    one step: a run of steps as one ``Comm`` a step."""
    for e in events:
        if type(e) is Comm and e.steps > 1:
            yield from (dataclasses.replace(e, step=step, steps=1)
                        for step in range(e.step, e.last + 1))
        else:
            yield e
