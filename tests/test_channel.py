import hashlib
import json
import socket
import threading
import time

import pytest

from nbtrain.telemetry.channel import (
    MAX_FRAME,
    TelemetryServer,
    frame,
    handshake,
    read_frame,
)
from nbtrain.telemetry.client import TelemetryClient
from nbtrain.telemetry.events import (
    Comm,
    Lifecycle,
    Metric,
    Step,
    decode,
    decode_many,
    encode,
    encode_many,
    encode_rows,
)


class Collect:
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def __call__(self, event):
        with self.lock:
            self.events.append(event)


def test_events_round_trip_and_reject_junk():
    m = Metric(rank=1, step=3, t=1.5, values={"loss": 0.25})
    assert decode(encode(m)) == m
    life = Lifecycle(rank=0, step=0, t=2.0, state="failed", detail="boom")
    assert decode(encode(life)) == life
    assert decode(b"\xff\x00") is None
    assert decode(b'{"v": 1, "kind": "pickle", "rank": 0}') is None
    assert decode(b'{"v": 99, "kind": "metric", "rank": 0, "step": 0, "t": 0}') is None
    assert decode(json.dumps({"v": 1, "kind": "metric", "rank": 0, "step": 0, "t": 0,
                              "values": {"loss": "NaN-string"}}).encode()) is None
    assert decode(b'[1, 2]') is None and decode(b'"metric"') is None
    # a newer rank's field this version does not know is left out, the event kept
    newer = json.dumps({"v": 1, "kind": "metric", "rank": 1, "step": 3, "t": 1.5,
                        "values": {"loss": 0.25}, "unit": "nats"}).encode()
    assert decode(newer) == m


def test_rows_carry_every_kind_and_stay_readable_across_versions():
    """Protocol 4's rows: each event as its values in field order. A newer rank's row has
    values past the fields known here (left out); an older one's fewer (defaults)."""
    events = [Step(rank=0, step=4, t=1.0, duration=0.01, samples=8, epoch=1, epoch_steps=9,
                   total_steps=90, phases={"forward": 0.004}),
              Comm(rank=0, step=4, t=1.0, counts={"all_reduce": 2}, bytes={"all_reduce": 64}),
              Metric(rank=0, step=4, t=1.5, values={"loss": 0.25}),
              Lifecycle(rank=0, step=4, t=2.0, state="failed", detail="boom\nline")]
    frame_body = encode_rows(events)
    assert decode_many(frame_body) == events
    assert len(frame_body) < len(encode_many(events)) * 0.7
    rows = json.loads(frame_body)["rows"]
    newer = json.dumps({"v": 1, "rows": [rows[2] + ["nats"]]}).encode()
    older = json.dumps({"v": 1, "rows": [rows[0][:4]]}).encode()  # kind, rank, step, t
    assert decode_many(newer) == [events[2]]
    assert decode_many(older) == [Step(rank=0, step=4, t=1.0)]
    # what is not a well-formed row is dropped alone; another schema's rows all are
    broken = [["metric", 0, "four", 1.0, {}], ["metric", 0, 4, 1.0, {"x": "NaN-string"}],
              ["pickle", 0, 4, 1.0], ["step"], {"kind": "step"}, "step", 7, rows[2]]
    assert decode_many(json.dumps({"v": 1, "rows": broken}).encode()) == [None] * 7 + [events[2]]
    assert decode_many(json.dumps({"v": 99, "rows": rows}).encode()) == [None] * 4


def test_every_event_arrives_in_order_per_rank():
    """Also when a flush holds more than one frame's worth (``BATCH``)."""
    sink = Collect()
    server = TelemetryServer(sink)
    try:
        clients = [TelemetryClient(server.address, server.token, rank, flush_interval=60.0)
                   for rank in (0, 1)]
        for step in range(500):
            for c in clients:
                c.send(Metric(rank=c.rank, step=step, t=time.monotonic(), values={"x": step}))
        for c in clients:
            c.close()
        assert server.wait_closed({0, 1}, timeout=10)
    finally:
        server.close()
    for rank in (0, 1):
        steps = [e.step for e in sink.events if e.rank == rank]
        assert steps == list(range(500))


def test_an_event_that_cannot_be_encoded_is_counted_and_the_stream_goes_on():
    """Events are encoded by the sender thread: one bad event must not end the stream."""
    sink = Collect()
    server = TelemetryServer(sink)
    try:
        client = TelemetryClient(server.address, server.token, 0)
        client.send(Metric(rank=0, step=0, t=0.0, values={"x": 1.0}))
        client.send(Metric(rank=0, step=1, t=0.0, values={"x": object()}))  # not JSON
        client.send(Metric(rank=0, step=2, t=0.0, values={"x": 3.0}))
        client.close()
        assert server.wait_closed({0}, timeout=10)
    finally:
        server.close()
    assert [e.step for e in sink.events] == [0, 2]
    assert client.dropped == 1


def test_flush_returns_once_the_queued_events_reached_the_listener():
    """What must not die with the rank (a checkpoint's report) is on the wire when flush
    returns, not 50 ms later."""
    sink = Collect()
    server = TelemetryServer(sink)
    try:
        client = TelemetryClient(server.address, server.token, 0, flush_interval=60.0)
        client.send(Metric(rank=0, step=7, t=0.0, values={"x": 1.0}))
        assert client.flush(timeout=10)
        deadline = time.monotonic() + 10
        while not sink.events:  # the listener's thread hands it on
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [e.step for e in sink.events] == [7]
        client.close()
    finally:
        server.close()


def _hung_up(sock) -> bool:
    """The server closed the connection: end-of-file, or a reset when it closed with our
    bytes still unread (the kernel then answers with RST instead of FIN)."""
    sock.settimeout(5)
    try:
        while sock.recv(4096):  # the challenge it opened with, if unread
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _raw(server, token, rank=0):
    """A connection that did the handshake with ``token`` (right or wrong)."""
    sock = socket.create_connection(server.address)
    handshake(sock, token, {"rank": rank}, timeout=5)
    return sock


class Recording:
    """A socket that keeps every byte sent through it."""

    def __init__(self, sock):
        self.sock, self.sent = sock, b""

    def sendall(self, data):
        self.sent += data
        return self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_wrong_token_is_refused():
    sink = Collect()
    server = TelemetryServer(sink)
    try:
        sock = _raw(server, "not-the-token")
        sock.sendall(frame(encode(Metric(rank=0, step=0, t=0.0, values={"x": 1.0}))))
        assert _hung_up(sock)
        sock.close()
        nohello = socket.create_connection(server.address)
        nohello.sendall(frame(b"hello?"))
        assert _hung_up(nohello)
        nohello.close()
        # version 1's hello, the token in clear: refused too
        old = socket.create_connection(server.address)
        old.sendall(frame(json.dumps({"token": server.token, "rank": 0}).encode()))
        assert _hung_up(old)
        old.close()
        assert server.refused == 3
        assert sink.events == []
    finally:
        server.close()


def test_the_token_never_crosses_the_wire_and_a_replayed_hello_is_refused():
    """As multiprocessing.connection's authkey: a challenge per connection, an HMAC back.
    What a client sends does not contain the token, and sent again on a new connection
    (another challenge) it is refused, as is a hello whose rank was changed on the way."""
    sink = Collect()
    server = TelemetryServer(sink)
    try:
        sock = Recording(socket.create_connection(server.address))
        handshake(sock, server.token, {"rank": 0, "ack": True}, timeout=5)  # proof checked
        assert server.token.encode() not in sock.sent
        assert hashlib.sha256(server.token.encode()).hexdigest().encode() not in sock.sent
        sock.sock.close()
        replay = socket.create_connection(server.address)
        read_frame(replay)  # its own challenge, ignored: the recorded hello is sent as it was
        replay.sendall(sock.sent)
        assert _hung_up(replay)
        replay.close()
        hello = json.loads(sock.sent[4:])
        altered = socket.create_connection(server.address)
        challenge = json.loads(read_frame(altered))["challenge"]
        signed = {**hello, "rank": 1}  # a rank claiming another's events, old MAC
        altered.sendall(frame(json.dumps(signed).encode()))
        assert _hung_up(altered)
        altered.close()
        assert challenge != json.loads(sock.sent[4:]).get("challenge")
        assert server.refused == 2 and sink.events == []
    finally:
        server.close()


def test_a_client_refuses_a_listener_that_cannot_prove_the_token():
    """A remote rank streams only to the notebook's listener: one that took its port but
    does not know the token answers a hello with an acknowledgement it cannot sign."""
    fake = socket.create_server(("127.0.0.1", 0))

    def impostor():
        conn, _ = fake.accept()
        conn.sendall(frame(json.dumps({"nbtrain": 2, "challenge": "00" * 16}).encode()))
        read_frame(conn)
        conn.sendall(frame(json.dumps({"ack": "f" * 64}).encode()))
        conn.close()

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises(ConnectionRefusedError, match="could not prove it knows the token"):
            TelemetryClient(fake.getsockname(), "the-token", 0, hello={"ack": True},
                            connect_timeout=5)
    finally:
        thread.join(5)
        fake.close()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_listener_of_an_older_nbtrain_gets_events_it_reads(protocol):
    """A rank sends rows only to a listener that reads them (protocol 4), an array of
    events to one of protocol 3, and one event a frame to an older one: an older
    nbtrain's listener on another host still gets each event. A run of steps' ``Comm``
    goes as one only to a listener that counts its steps (5); an older one gets one a
    step."""
    fake = socket.create_server(("127.0.0.1", 0))
    frames = []

    def older():
        conn, _ = fake.accept()
        conn.sendall(frame(json.dumps({"nbtrain": protocol,
                                       "challenge": "00" * 16}).encode()))
        read_frame(conn)  # the hello
        try:
            while True:
                frames.append(read_frame(conn))
        except ConnectionRefusedError:  # the client closed
            conn.close()

    thread = threading.Thread(target=older)
    thread.start()
    try:
        client = TelemetryClient(fake.getsockname(), "the-token", 0, flush_interval=60.0)
        for step in range(3):
            client.send(Metric(rank=0, step=step, t=0.0, values={"x": 1.0}))
        client.send(Comm(rank=0, step=3, t=0.0, counts={"all_reduce": 1},
                         bytes={"all_reduce": 64}, steps=3))
        client.close()
    finally:
        thread.join(5)
        fake.close()
    if protocol == 2:
        events = [decode(f) for f in frames]
    else:
        assert len(frames) == 1
        assert isinstance(json.loads(frames[0]), list if protocol == 3 else dict)
        events = decode_many(frames[0])
    assert [e.step for e in events if isinstance(e, Metric)] == [0, 1, 2]
    comm = [(e.step, e.steps, e.bytes) for e in events if isinstance(e, Comm)]
    each = [(step, 1, {"all_reduce": 64}) for step in (3, 4, 5)]
    assert comm == (each if protocol < 5 else [(3, 3, {"all_reduce": 64})])


def test_garbage_and_oversized_frames_are_dropped_not_fatal():
    sink = Collect()
    server = TelemetryServer(sink)
    try:
        sock = _raw(server, server.token, rank=0)

        def good(step):
            return frame(encode(Metric(rank=0, step=step, t=0.0, values={"x": 1.0})))

        sock.sendall(good(0))
        sock.sendall(frame(b"\x80\x04garbage-that-is-not-json"))
        sock.sendall(frame(encode(Metric(rank=5, step=1, t=0.0, values={"x": 1.0}))))  # wrong rank
        sock.sendall(good(2))
        sock.sendall((MAX_FRAME + 10).to_bytes(4, "big") + b"z" * (MAX_FRAME + 10))
        sock.sendall(good(3))
        # a rank's batch: its good events arrive, a broken one and another rank's do not
        batch = json.loads(encode_many([Metric(rank=0, step=s, t=0.0, values={"x": 1.0})
                                        for s in (4, 5, 6)]))
        batch[1]["values"] = {"x": "not a number"}
        batch.insert(2, {**batch[0], "rank": 5})
        sock.sendall(frame(json.dumps(batch).encode()))
        sock.close()
        assert server.wait_closed({0}, timeout=10)
        assert [e.step for e in sink.events] == [0, 2, 3, 4, 6]
        assert server.malformed == 4 and server.oversized == 1
    finally:
        server.close()


def test_a_slow_consumer_never_blocks_the_sender():
    """The kernel's consumer is held (it takes no event until the sends are done): every
    send still returns, what the bounded buffer cannot hold is counted as dropped. A send
    that waited for the consumer would never return, and the deadline below is only
    there so that such a bug fails the test instead of hanging it."""
    gate = threading.Event()
    taken = []

    def held(event):
        taken.append(event)
        gate.wait()

    server = TelemetryServer(held)
    client = TelemetryClient(server.address, server.token, 0, capacity=500)

    values = {f"metric{i}": 1.0 for i in range(100)}  # 5000 of these outgrow the sockets

    def send_all():
        for step in range(5000):
            client.send(Metric(rank=0, step=step, t=0.0, values=values))

    sender = threading.Thread(target=send_all)
    try:
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "a send waited for the held consumer"
        assert len(taken) <= 1  # the consumer was held all along
        assert client.dropped > 0  # the bounded buffer overflowed and counted it
    finally:
        gate.set()
        client._closing = True
        server.close()
        client.close(timeout=1)


def test_a_listener_address_is_one_string_host_port_token():
    from nbtrain.telemetry.channel import format_address, parse_address

    assert parse_address(format_address("10.0.0.5", 4000, "ab12")) == ("10.0.0.5", 4000, "ab12")
    assert parse_address(format_address("::1", 4000, "ab12")) == ("::1", 4000, "ab12")
    for bad in ("", "host:port:token", "host:4000", ":4000:tok"):
        with pytest.raises(ValueError, match="HOST:PORT:TOKEN"):
            parse_address(bad)
