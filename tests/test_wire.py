"""Every message that crosses a rank's pipes is a dataclass in nbtrain/wire.py: it round
trips, and what is not one is a ValueError that says what arrived, never a KeyError in a
reader."""

from __future__ import annotations

import pickle

import pytest

from nbtrain import wire
from nbtrain.telemetry.settings import Telemetry


def test_each_message_round_trips():
    try:
        raise ValueError("boom")
    except ValueError as err:
        failure = wire.decode_failure(wire.encode_failure(err, 3, hint="do this"))
    assert (failure.rank, failure.type, failure.module, failure.message, failure.hint) == (
        3, "ValueError", "builtins", "boom", "do this")
    assert "raise ValueError" in failure.traceback
    assert wire.decode_activity(wire.encode_activity(wire.Activity(4, 2))) == \
        wire.Activity(collectives=4, optimizer_steps=2)
    assert wire.decode_value(wire.encode_value(wire.CellValue("tensor([1.])"))).repr == \
        "tensor([1.])"
    assert wire.decode_memory(wire.encode_memory({"rss_bytes": 5})) == {"rss_bytes": 5}
    assert wire.decode_store(wire.encode_store(wire.StorePort(29500))) == wire.StorePort(29500)
    settings = wire.RunSettings(("127.0.0.1", 4000), "tok", Telemetry(), None, 7, 0)
    for command in (wire.Exec("x = 1", "<cell>"), wire.LaunchRun(b"fn", settings),
                    wire.Pull("x"), wire.Push(b"{}"), wire.MemoryQuery(), wire.Exit()):
        assert wire.decode_command(wire.encode_command(command)) == command
    assert settings.fields()["seed"] == 7


@pytest.mark.parametrize("decode, message, says", [
    (wire.decode_failure, b"E{not json", "not JSON"),
    (wire.decode_failure, b'E{"rank": 0}', "not a RankFailure"),
    (wire.decode_failure, b'E{"rank": 0, "type": "X", "module": "m", "message": "", '
                          b'"traceback": "", "extra": 1}', "not a RankFailure"),
    (wire.decode_activity, b"P\x80", "expected a 'A' message"),
    (wire.decode_memory, b'M{"rss_bytes": "a lot"}', "names and byte counts"),
    (wire.decode_store, b"Sport", "not a store message"),
    (wire.decode_store, b"S99999", "not a TCP port"),
    (wire.decode_command, pickle.dumps({"op": "exit"}), "not a pool command: dict"),
    (wire.decode_command, b"\x00junk", "does not unpickle"),
])
def test_what_is_not_a_message_is_said_so(decode, message, says):
    with pytest.raises(ValueError, match=says):
        decode(message)


def test_only_commands_are_sent():
    with pytest.raises(TypeError, match="not a pool command"):
        wire.encode_command({"op": "exec"})


def test_a_rank_that_sends_no_message_of_nbtrains_fails_saying_so():
    """The supervisor reads a rank's control pipe through the decoders: a malformed
    failure is that rank's failure, named, and the run ends as for any failure."""
    import types

    from nbtrain.launch.following.supervisor import Supervisor, WorkerHandle

    class Pipe:
        def __init__(self, *messages):
            self.messages = list(messages)

        def recv_bytes(self):
            return self.messages.pop(0)

    handle = WorkerHandle(1, types.SimpleNamespace(pid=12345), Pipe(b"E{truncated"), None,
                          None)
    supervisor = Supervisor([handle], lambda *a: None, None, join=False)
    worker = supervisor.workers[1]
    supervisor.watch.read_control(worker)
    assert worker.failure.exc_type == "MalformedMessage"
    assert "not JSON" in worker.failure.message and worker.failure.rank == 1
    assert "same nbtrain" in worker.failure.hint
