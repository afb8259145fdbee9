"""The worker -> kernel telemetry channel: a TCP listener in the kernel, a client per rank.

The same channel serves fork and spawn workers and, through ``nbtrain.listen()``, the
ranks of a torchrun job on other hosts: the kernel hands each worker an address and a
secret token (a job gets both in one string, ``host:port:token``). Frames are a 4-byte
big-endian length and a JSON body: one event, or an array of a rank's queued events.

The token never crosses the wire (a listener on ``0.0.0.0`` is reachable by anyone on
the network): as in ``multiprocessing.connection``'s ``authkey`` handshake, the listener
opens each connection with a fresh random challenge, and the client's first frame, its
hello (its rank, and for a remote rank which run it belongs to), carries an HMAC-SHA256
under the token of that challenge and the hello itself. A wrong token, a hello replayed
on another connection (another challenge) or one altered on the way (another rank)
closes the connection. A remote rank asks for an acknowledgement, and the listener proves
that it knows the token too, with an HMAC of the rank's own nonce: a rank does not stream
to a listener that merely took its port. Oversized frames are skipped, malformed ones are
dropped and counted; neither harms the run.

On the worker, ``send`` only appends the event to a bounded buffer that a background
thread encodes and flushes, so neither encoding nor a slow kernel stalls a training
step; events that do not fit are dropped and counted.
"""

from __future__ import annotations

import hmac
import json
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from .events import Event, decode_many

MAX_FRAME = 1 << 20  # bytes; larger frames are skipped
_HEADER = struct.Struct(">I")


PROTOCOL = 5  # 5: a Comm may stand for a run of identical steps (its ``steps``); 4: a
#              frame may hold rows of events; 3: an array of events; 2: challenge and
#              HMAC (1 sent the token in the hello)
RUNS_OF_STEPS = 5  # from this protocol on a listener reads a run of steps' Comm as one


def mac(token: str, purpose: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 under ``token`` of ``purpose`` and ``parts``, as hex."""
    digest = hmac.new(token.encode(), purpose, "sha256")
    for part in parts:
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.hexdigest()


def _signed(hello: dict) -> bytes:
    """The bytes a hello's MAC covers: the hello itself, less the MAC, canonically."""
    return json.dumps({k: v for k, v in hello.items() if k != "mac"}, sort_keys=True,
                      separators=(",", ":")).encode()


class _Conn:
    __slots__ = ("sock", "buf", "rank", "skip", "handler", "challenge")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.rank: int | None = None  # set once the hello frame proved the token
        self.skip = 0  # bytes of an oversized frame still to discard
        self.handler: Callable[[Event], None] | None = None  # where its events go
        self.challenge = secrets.token_hex(16)  # this connection's, sent at accept


class TelemetryServer:
    """Listens on loopback (by default) and hands every well-formed event to ``on_event``.

    ``on_hello(hello)``, when given, decides per connection: it gets the authenticated
    hello (a dict: ``rank`` and whatever the client added) and returns the callable that
    takes that connection's events (its ``closed()``, if it has one, is called when the
    connection ends), or None to refuse the connection.
    """

    def __init__(self, on_event: Callable[[Event], None] | None = None,
                 host: str = "127.0.0.1", port: int = 0, on_hello=None):
        self.token = secrets.token_hex(16)
        self._on_event = on_event
        self._on_hello = on_hello
        self._sock = socket.create_server((host, port))
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed_ranks: set[int] = set()
        self._last_data = time.monotonic()
        self._cond = threading.Condition()
        self._stop = False
        self.refused = 0
        self.malformed = 0
        self.oversized = 0
        self._thread = threading.Thread(target=self._loop, name="nbtrain-telemetry", daemon=True)
        self._thread.start()

    # -- kernel side API -------------------------------------------------------------
    def wait_closed(self, ranks: set[int], timeout: float, idle: float | None = None) -> bool:
        """Wait until every rank in ``ranks`` closed its connection (all its events read),
        at most ``timeout`` seconds, or ``idle`` seconds without a byte arriving (a rank
        that never connected does not hold the run's end for the whole timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ranks <= self._closed_ranks:
                now = time.monotonic()
                left = deadline - now
                if idle is not None:
                    left = min(left, self._last_data + idle - now)
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def drain_and_close(self, ranks: set[int]) -> None:
        """Read what the ranks sent before they ended, then close: a kernel slower than
        its workers (a loaded machine) dropped the last events when it closed at once."""
        self.wait_closed(ranks, timeout=30.0, idle=2.0)
        self.close()

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()
        self._wake_w.close()

    # -- the loop --------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(timeout=0.5):
                if key.data == "wake":
                    return
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self._sock.accept()
        except OSError:
            return
        conn = _Conn(sock)
        try:  # a few bytes into an empty socket buffer: sent at once
            sock.sendall(frame(json.dumps({"nbtrain": PROTOCOL,
                                           "challenge": conn.challenge}).encode()))
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        conn.sock.close()
        closed = getattr(conn.handler, "closed", None)
        if closed is not None:
            try:
                closed()
            except Exception:
                pass
        if conn.rank is not None:
            with self._cond:
                self._closed_ranks.add(conn.rank)
                self._cond.notify_all()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        self._last_data = time.monotonic()
        conn.buf += data
        while True:
            if conn.skip:
                n = min(conn.skip, len(conn.buf))
                del conn.buf[:n]
                conn.skip -= n
                if conn.skip:
                    return
            if len(conn.buf) < _HEADER.size:
                return
            (size,) = _HEADER.unpack_from(conn.buf)
            if size > MAX_FRAME:
                self.oversized += 1
                del conn.buf[:_HEADER.size]
                conn.skip = size
                if conn.rank is None:  # nobody authenticated sends that much first
                    self.refused += 1
                    self._drop(conn)
                    return
                continue
            if len(conn.buf) < _HEADER.size + size:
                return
            body = bytes(conn.buf[_HEADER.size:_HEADER.size + size])
            del conn.buf[:_HEADER.size + size]
            if conn.rank is None:
                if not self._hello(conn, body):
                    self.refused += 1
                    self._drop(conn)
                    return
                continue
            for event in decode_many(body):  # one event, or a rank's batch of them
                if event is None or event.rank != conn.rank:
                    self.malformed += 1
                    continue
                try:
                    conn.handler(event)
                except Exception:  # a broken sink must not end the channel
                    self.malformed += 1

    def _hello(self, conn: _Conn, body: bytes) -> bool:
        try:
            hello = json.loads(body)
            given, rank, nonce = hello["mac"], hello["rank"], hello.get("nonce", "")
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        if not (isinstance(given, str) and isinstance(rank, int) and isinstance(nonce, str)):
            return False
        expected = mac(self.token, b"nbtrain-hello", conn.challenge.encode(), _signed(hello))
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return False
        handler = self._on_event
        if self._on_hello is not None:
            try:
                handler = self._on_hello({k: v for k, v in hello.items()
                                          if k not in ("mac", "nonce")})
            except Exception:
                handler = None
        if handler is None:
            return False
        conn.rank, conn.handler = rank, handler
        if hello.get("ack") is True:  # prove the token back, on the rank's own nonce
            proof = mac(self.token, b"nbtrain-ack", nonce.encode(), conn.challenge.encode())
            try:
                conn.sock.sendall(frame(json.dumps({"ack": proof}).encode()))
            except OSError:
                return False
        return True


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body



def read_frame(sock: socket.socket) -> bytes:
    """One frame from a blocking socket (the handshake's)."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionRefusedError("the listener closed the connection")
            data += chunk
        return data

    (size,) = _HEADER.unpack(exactly(_HEADER.size))
    if size > 4096:
        raise ConnectionRefusedError("not an nbtrain listener (its first frame is too long)")
    return exactly(size)


def handshake(sock: socket.socket, token: str, hello: dict, timeout: float) -> int:
    """The client's side: answer the listener's challenge with an HMAC'd hello; with
    ``hello["ack"]``, check the listener's proof that it knows the token too. Returns
    the listener's protocol (an older nbtrain's listener reads one event a frame)."""
    sock.settimeout(timeout)
    try:
        opening = json.loads(read_frame(sock))
        challenge = opening["challenge"]
    except (ValueError, KeyError, TypeError) as err:
        raise ConnectionRefusedError("not an nbtrain listener (no challenge), or one of "
                                     "an older nbtrain") from err
    hello = {**hello, "nonce": secrets.token_hex(16)}
    hello["mac"] = mac(token, b"nbtrain-hello", challenge.encode(), _signed(hello))
    sock.sendall(frame(json.dumps(hello).encode()))
    if hello.get("ack") is True:  # a listener elsewhere: did it take the hello?
        try:
            proof = json.loads(read_frame(sock))["ack"]
        except ConnectionRefusedError as err:
            raise ConnectionRefusedError("the listener refused the connection (a wrong "
                                         "token?)") from err
        except (ValueError, KeyError, TypeError) as err:
            raise ConnectionRefusedError("the listener's answer is not nbtrain's") from err
        expected = mac(token, b"nbtrain-ack", hello["nonce"].encode(), challenge.encode())
        if not hmac.compare_digest(str(proof).encode(), expected.encode()):
            raise ConnectionRefusedError("the listener could not prove it knows the token "
                                         "(not the notebook's listener?)")
    sock.settimeout(None)
    protocol = opening.get("nbtrain")
    return protocol if isinstance(protocol, int) else 2


def format_address(host: str, port: int, token: str) -> str:
    """The one string a job needs to attach to a listener: ``host:port:token``."""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}:{token}"


def parse_address(text: str) -> tuple[str, int, str]:
    """``host:port:token`` (as ``format_address`` writes it) -> (host, port, token)."""
    head, _, token = text.strip().rpartition(":")
    host, _, port = head.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not token:
        raise ValueError(f"{text!r} is not a listener address: expected HOST:PORT:TOKEN, as "
                         "watch.address gives it (watch = nbtrain.listen()).")
    return host, int(port), token
