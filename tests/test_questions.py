"""A rank that asks for input (``input()``, ``getpass``, a debugger) is asked in the
thread that waits for the run, and answered; where nothing can answer, it fails saying
so. Before, a forked rank's ``input`` waited forever on the kernel's socket, silent.

The ranks and pipes are real; the person at the keyboard is the kernel side's
``input`` (a function here, an input box in the kernel tests of
``test_rank_output.py``)."""

from __future__ import annotations

import builtins
import getpass
import pdb
import time

import pytest

import nbtrain
from nbtrain import questions
from nbtrain.display_record import DISPLAY_MARK, Display, encode_display
from nbtrain.launch.following.pipes import PipeText
from nbtrain.wire import Exit, encode_command

pytestmark = pytest.mark.usefixtures("no_leftovers")


def test_a_question_crosses_the_pipe_as_a_record_and_its_answer_comes_back():
    pipe = PipeText("out")
    items = pipe.feed(b"listing\n" + questions.encode_question("(Pdb) ", False) + b"after\n")
    assert [kind for kind, _ in items] == ["out", "display", "out"]
    assert questions.question_in(items[1][1]) == ("(Pdb) ", False)
    display = encode_display(Display("display_data", {"data": {}}))
    assert questions.question_in(display.decode()[len(DISPLAY_MARK):-1]) is None
    answer = questions.Answer("c")
    assert questions.decode_answer(questions.encode_answer(answer)) == answer
    with pytest.raises(ValueError, match="not an answer"):
        questions.decode_answer(encode_command(Exit()))  # a pool's command, not an answer


def asks(ctx):
    name = input(f"name {ctx.rank}? ")
    secret = getpass.getpass()
    return name, secret


class Keyboard:
    """What a person types: each prompt, seen here, answered by what it asked."""

    def __init__(self, *typed: str):
        self.typed = list(typed)
        self.prompts: list[str] = []

    def input(self, prompt: str = "") -> str:
        self.prompts.append(prompt)
        return self.typed.pop(0) if self.typed else f"typed at {prompt!r}"

    def getpass(self, prompt: str = "Password: ", stream=None) -> str:
        return self.input("password " + prompt)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_each_ranks_input_and_getpass_are_asked_in_the_waiting_cell(start_method, monkeypatch):
    keys = Keyboard()
    monkeypatch.setattr(builtins, "input", keys.input)
    monkeypatch.setattr(getpass, "getpass", keys.getpass)
    run = nbtrain.launch(asks, devices=2, start_method=start_method, dashboard=False)
    # each answer is what the prompt the cell showed asked: labelled with the rank
    assert run.results == [("typed at '[rank 0] name 0? '", "typed at 'password [rank 0] Password: '"),
                           ("typed at '[rank 1] name 1? '", "typed at 'password [rank 1] Password: '")]
    assert sorted(keys.prompts) == sorted(["[rank 0] name 0? ", "[rank 1] name 1? ",
                                           "password [rank 0] Password: ",
                                           "password [rank 1] Password: "])


def debugged(ctx):
    secret = 40 + ctx.rank
    if ctx.rank == 1:
        pdb.Pdb().set_trace()  # breakpoint(), under pytest, is pytest's (kernel test: ours)
    return secret


def test_a_ranks_breakpoint_is_a_debugger_the_cell_talks_to(monkeypatch, capsys):
    keys = Keyboard("p secret * 10", "secret = 7", "c")
    monkeypatch.setattr(builtins, "input", keys.input)
    run = nbtrain.launch(debugged, devices=2, dashboard=False)
    assert run.results == [40, 7]  # the debugger's assignment took
    assert keys.prompts == ["[rank 1] (Pdb) "] * 3
    out = capsys.readouterr().out
    assert "[rank 1] 410" in out  # what `p` printed, from the rank
    assert "[rank 1] -> return secret" in out  # its listing, from the rank too


def test_a_question_nothing_can_answer_fails_the_rank_saying_so_at_once():
    """pytest captures stdin: the kernel side cannot read it (as nbclient's frontend
    takes no input). The rank's input() raises EOFError that says so; a debugger quits."""
    def one_asks(ctx):
        if ctx.rank == 0:
            return input("anyone? ")
        return ctx.rank

    t = time.monotonic()
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(one_asks, devices=2, dashboard=False, timeout=120)
    assert time.monotonic() - t < 60
    err = info.value
    assert err.rank == 0 and "EOFError" in str(err)
    assert "rank 0 asked for input and nothing could answer it" in str(err)

    def one_debugs(ctx):
        if ctx.rank == 0:
            pdb.Pdb().set_trace()
        return ctx.rank

    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(one_debugs, devices=2, dashboard=False, timeout=120)
    assert info.value.rank == 0


def slow_asker(ctx):
    if ctx.rank == 1:
        return input("ready? ")
    return "rank 0"


def test_a_background_runs_question_is_pointed_out_and_asked_by_its_wait(monkeypatch, capsys):
    keys = Keyboard("yes")
    monkeypatch.setattr(builtins, "input", keys.input)
    run = nbtrain.launch(slow_asker, devices=2, dashboard=False, background=True)
    deadline = time.monotonic() + 60
    err = ""
    while "waits for input" not in err and time.monotonic() < deadline:
        time.sleep(0.2)
        err += capsys.readouterr().err
    assert "[rank 1] nbtrain: rank 1 waits for input" in err and "run.wait()" in err
    assert not run.done and keys.prompts == []
    assert run.wait(timeout=60) == ["rank 0", "yes"]
    assert keys.prompts == ["[rank 1] ready? "]


def test_a_pool_ranks_input_is_asked_by_its_command(monkeypatch):
    keys = Keyboard("a", "b")
    monkeypatch.setattr(builtins, "input", keys.input)
    with nbtrain.RankPool(devices=2) as pool:
        values = pool.run("answer = input(f'rank {rank}? ')\nanswer")
        assert sorted(values.values()) == ["'a'", "'b'"]
        assert sorted(keys.prompts) == ["[rank 0] rank 0? ", "[rank 1] rank 1? "]
        assert pool.run("1 + 1") == {0: "2", 1: "2"}  # the pool goes on
