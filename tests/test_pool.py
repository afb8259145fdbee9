"""RankPool in this process: warm workers on 2 CPU ranks, kept across commands and runs.

Every test starts its own pool and checks (``no_leftovers``) that closing it, or its
teardown after a failure, leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import psutil
import pytest
import torch
from workloads import collections_in_a_rank, fail_on, sleeper, train

import nbtrain
from nbtrain.launch.pool.op import Quiet
from nbtrain.launch.pool.ranks import RankCellError

pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture
def pool():
    p = nbtrain.RankPool(devices=2, accelerator="cpu", start_method="fork")
    try:
        yield p
    finally:
        p.close()


def test_pool_launch_twice_gives_what_launch_gives(pool):
    expected = nbtrain.launch(train, devices=2, start_method="fork", dashboard=False).results
    pids = [row["pid"] for row in pool.status]
    for _ in range(2):
        run = pool.launch(train, dashboard=False)
        assert isinstance(run, nbtrain.Run) and run.status == "done"
        for got, want in zip(run.results, expected, strict=True):
            assert got["loss"] == want["loss"] and got["rank"] == want["rank"]
            for k, v in want["full"].items():
                assert torch.equal(got["full"][k], v), k
        assert run.history.metric("loss", rank=0), "the run's telemetry reached its history"
    assert [row["pid"] for row in pool.status] == pids, "the same workers ran both"
    assert pool.started == 1


def test_a_pool_worker_collects_everything_again_between_runs(pool):
    """While a run's function runs, the worker's collector leaves what was there before
    alone (``test_launch.py``); between runs it is all collectable again, so what one
    run left in a cycle does not stay for the pool's life."""
    for _ in range(2):
        assert all(frozen > 0 for frozen, _ in pool.launch(collections_in_a_rank,
                                                            dashboard=False).results)
        assert pool.run("import gc\ngc.get_freeze_count()") == {0: "0", 1: "0"}


def test_spawn_pool_starts_once_and_runs_cell_defined_code():
    with nbtrain.RankPool(devices=2, accelerator="cpu", start_method="spawn") as pool:
        assert pool.start_method == "spawn"
        first = pool.launch(fail_on, "none", dashboard=False)
        second = pool.launch(fail_on, "none", dashboard=False)
        assert first.results == second.results == [0, 1]
        assert "spawn" in second.start_method
        assert pool.started == 1


def test_status_shows_each_rank_and_close_ends_everything(pool):
    rows = pool.status
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["alive"] and not r["busy"] for r in rows)
    assert all(r["rss_bytes"] > 0 and "tensor_bytes" in r for r in rows)
    assert "rank" in repr(rows) and "MB" in repr(rows)
    pids = [r["pid"] for r in rows]
    pool.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in pids)
    assert repr(pool).endswith("closed>")
    with pytest.raises(RuntimeError, match="closed"):
        pool.run("1")
    from nbtrain.launch.pool.ranks import active_pool

    with pytest.raises(RuntimeError, match=r"no RankPool is open: start one first"):
        active_pool()  # what %%ranks uses


def test_names_live_across_commands_and_push_pull(pool):
    assert pool.run("x = torch.tensor([float(rank + 1)])\ndist.all_reduce(x)\nx * rank") == \
        {0: "tensor([0.])", 1: "tensor([3.])"}
    assert pool.run("x.item()", ranks=[1]) == {1: "3.0"}
    assert pool.run("y = 1") == {0: None, 1: None}
    pool.push(w=torch.arange(3))
    got = pool.pull("w")
    assert len(got) == 2 and all(torch.equal(t, torch.arange(3)) for t in got)
    assert pool.pull("rank") == [0, 1]
    with pytest.raises(RankCellError, match="name 'nope' is not defined"):
        pool.pull("nope")


def test_an_exception_reports_every_failing_rank_and_the_pool_goes_on(pool):
    pool.run("keep = rank * 10")
    with pytest.raises(RankCellError) as info:
        pool.run("print('before', rank)\nraise ValueError(f'bad on {rank}')")
    err = info.value
    assert isinstance(err, nbtrain.WorkerError)
    assert sorted(err.failures) == [0, 1]
    assert "[rank 0] ValueError: bad on 0" in str(err)
    assert "[rank 1] ValueError: bad on 1" in str(err)
    assert "<%%ranks cell" in err.traceback and "raise ValueError" in err.traceback
    assert pool.run("keep") == {0: "0", 1: "10"}  # same workers, same names
    assert pool.started == 1


def test_a_syntax_error_is_raised_in_the_kernel_and_no_rank_runs_the_code():
    p = nbtrain.RankPool(devices=2, accelerator="cpu", start_method="fork")
    try:
        with pytest.raises(SyntaxError) as info:
            p.run("x = 1\ndef (:\n", filename="<%%ranks In[4]>")
        assert info.value.filename == "<%%ranks In[4]>" and info.value.lineno == 2
        assert p.run("rank") == {0: "0", 1: "1"}
        before = p.channel.op
        with pytest.raises(SyntaxError):
            p.run("print(")
        assert p.channel.op is before and p.started == 1  # nothing went to the ranks
    finally:
        p.close()


def test_memory_of_a_run_is_freed_on_every_rank(pool):
    before = [r["tensor_bytes"] for r in pool.status]
    pool.run("big = torch.zeros(1 << 20)")  # a name the user keeps: 4 MiB, not freed
    held = [r["tensor_bytes"] for r in pool.status]
    assert all(h - b >= 4 << 20 for h, b in zip(held, before, strict=True))
    pool.run("del big")
    pool.launch(train, dashboard=False)
    after = [r["tensor_bytes"] for r in pool.status]
    assert all(a - b < 64 << 10 for a, b in zip(after, before, strict=True)), (before, after)


FREED = ("rank 0 was stuck in a collective the other ranks never joined; the pool freed "
         "it by starting its process group again.")


def test_a_timeout_names_the_rank_stuck_in_a_collective_and_the_pool_frees_it(pool):
    """A collective on one rank alone (the teaching mistake): at the timeout it is named
    where it waits, its peer leaves the process group to free it, and the pool goes on
    with the same workers, their names and a new group. A DDP model in the names holds
    the old group (its sockets stay open when the group is destroyed): the peer shuts
    its connections down, so the stuck rank is freed all the same."""
    pool.run("keep = rank * 10\nold = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))")
    pids = [r["pid"] for r in pool.status]
    t = time.monotonic()
    with pytest.raises(nbtrain.RunTimeoutError) as info:
        pool.run("if rank == 0:\n    dist.barrier()", timeout=1)
    assert info.value.ranks == [0]
    assert time.monotonic() - t < 15
    # seen asleep in the collective (not waited out for INTERRUPT_GRACE_S), and freed
    assert FREED + " Names on the ranks are kept" in str(info.value), str(info.value)
    # where it waited: its stack, asked before it was interrupted, read in the cell
    assert re.fullmatch(r"<%%ranks cell \d+>, line 2, in <module>: dist.barrier\(\)",
                        info.value.where[0]), info.value.where
    assert "rank 0: still running, at <%%ranks cell" in str(info.value)
    assert [r["pid"] for r in pool.status] == pids and pool.started == 1
    assert pool.run("keep") == {0: "0", 1: "10"}
    # the new group works, on every rank and on some
    assert pool.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()") == \
        {0: "3.0", 1: "3.0"}
    with pytest.raises(nbtrain.RunTimeoutError, match="rank 1 was stuck"):
        pool.run("dist.barrier()", ranks=1, timeout=1)  # the other rank not even asked
    assert pool.run("keep") == {0: "0", 1: "10"} and pool.started == 1
    # a model built again on the new group trains
    pool.run("new = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
             "new(torch.ones(1, 2) * rank).sum().backward()")
    grads = pool.run("new.module.weight.grad.tolist()")
    assert grads[0] == grads[1] == "[[0.5, 0.5], [0.5, 0.5]]", grads


def test_a_group_that_cannot_start_again_ends_the_pool_and_says_why(pool):
    """The stuck rank is freed, but a rank cannot join the new group (its start raises,
    as a store that cannot be reached would): the workers are ended, saying why."""
    pool.run("import sys\ndef boom(*args):\n    raise RuntimeError('no store for you')\n"
             "sys.modules['nbtrain.rank.pool_worker'].init_distributed = boom", ranks=1)
    # (a rank that cannot join leaves: the store's address must not reach its commands)
    with pytest.raises(nbtrain.RunTimeoutError) as info:
        pool.run("dist.barrier()", ranks=0, timeout=1)
    assert "workers were ended: its process group could not be started again after " \
           "freeing a stuck rank (rank 1: RuntimeError: no store for you)" in str(info.value)
    assert pool.run("rank") == {0: "0", 1: "1"} and pool.started == 2


def test_an_interrupt_while_the_group_starts_again_ends_the_pool(pool, tmp_path):
    """An interrupt while the ranks start their new group (rank 1's start hangs here)
    ends the pool rather than leave it half started, and says so."""
    started = tmp_path / "in the new group's start"
    pool.run(f"import sys, time\ndef slow(*args):\n    open({str(started)!r}, 'w').close()\n"
             "    time.sleep(60)\nsys.modules['nbtrain.rank.pool_worker'].init_distributed = slow",
             ranks=1)

    def interrupt_once_started():
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.raise_signal(signal.SIGINT)

    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel
    timer = threading.Thread(target=interrupt_once_started)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt, match="workers were ended: interrupted while "
                                                    "its process group started again"):
            pool.run("dist.barrier()", ranks=0, timeout=1)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, outer)
    assert started.exists()
    assert pool.run("rank") == {0: "0", 1: "1"} and pool.started == 2


def test_ranks_stuck_with_no_idle_peer_to_free_them_end_the_pool(pool):
    """Every rank waits for another (rank 0 in a barrier, rank 1 for a message rank 0
    never sends): no peer can leave the group to free them, so the pool ends them."""
    with pytest.raises(nbtrain.RunTimeoutError) as info:
        pool.run("if rank == 0:\n    dist.barrier()\nelse:\n    dist.recv(torch.ones(1), 0)",
                 timeout=1)
    assert info.value.ranks == [0, 1]
    text = str(info.value)
    assert "workers were ended: ranks 0, 1 did not answer an interrupt and slept without " \
           "CPU time" in text, text
    assert "stuck in a collective the other ranks never joined" not in text
    assert pool.status.ended and not any(r["alive"] for r in pool.status)
    assert pool.run("rank") == {0: "0", 1: "1"} and pool.started == 2  # started again


def test_a_busy_cell_is_interrupted_and_the_pool_stays(pool):
    pool.run("keep = 5")
    box = {}
    before = pool.channel.op

    def cell():
        box["thread"] = threading.get_ident()
        try:
            pool.run("import time\nwhile True:\n    time.sleep(0.05)")
        except BaseException as err:
            box["err"] = err

    # The cell waits in a thread here; stop it the way an interrupt in the kernel does.
    th = threading.Thread(target=cell)
    th.start()
    deadline = time.monotonic() + 10
    while pool.channel.op is before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t = time.monotonic()
    pool.channel.op.request_stop("interrupted")
    th.join(10)
    assert time.monotonic() - t < 3
    assert isinstance(box["err"], RankCellError)
    assert box["err"].exc_type == "KeyboardInterrupt"
    assert pool.run("keep") == {0: "5", 1: "5"} and pool.started == 1


def _gone(pool, rank: int) -> None:
    """Until the pool knows the killed rank is dead (a fork server's child: once the
    server says so)."""
    deadline = time.monotonic() + 10
    while pool.workers.handles[rank].process.exitcode is None:  # no command: no side effect
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_interrupted_cell_says_where_each_rank_was(pool):
    """An interrupt in the wait (a kernel's SIGINT): the ranks are asked where they are
    before they are interrupted; one stuck in a collective is freed by its peer leaving
    the process group, and the cell's KeyboardInterrupt names the line of each."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel
    try:
        for code, stuck in (("import time\ntime.sleep(60)", False),
                            ("if rank == 1:\n    dist.barrier()", True)):
            timer = threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,))
            timer.start()
            with pytest.raises(KeyboardInterrupt) as info:
                pool.run(code)
            timer.join()
            text = str(info.value)
            where = (r"where the ranks were: rank 1 at <%%ranks cell \d+>, line 2, in "
                     r"<module>: dist.barrier\(\)" if stuck else
                     r"where the ranks were: ranks 0, 1 at <%%ranks cell \d+>, line 2, "
                     r"in <module>: time.sleep\(60\)")
            assert re.search(where, text), text
            assert ("rank 1 was stuck in a collective" in text) == stuck, text
            assert text.startswith("interrupted on rank(s) ["), text
    finally:
        signal.signal(signal.SIGINT, outer)
    assert pool.run("rank") == {0: "0", 1: "1"} and pool.started == 1


def test_a_rank_killed_between_commands_is_replaced_and_the_next_command_runs(pool,
                                                                             capsys):
    """The pool heals: a rank the OOM killer took while the pool was idle is named in one
    line, every worker is replaced, and the command runs on the new ones."""
    pool.run("keep = 1")
    victim = pool.status[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    _gone(pool, 1)
    assert pool.run("rank") == {0: "0", 1: "1"}
    err = capsys.readouterr().err
    assert "restarting the pool's 2 workers (rank 1 died (SIGKILL))" in err, err
    assert "names defined in %%ranks cells before are gone" in err
    assert pool.started == 2 and victim not in [r["pid"] for r in pool.status]
    with pytest.raises(RankCellError, match="'keep' is not defined"):
        pool.run("keep")
    assert pool.launch(fail_on, "none", dashboard=False).results == [0, 1]  # and launches


def test_a_rank_killed_before_a_launch_is_replaced_and_the_launch_runs(pool, capsys):
    victim = pool.status[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    _gone(pool, 0)
    assert pool.launch(fail_on, "none", dashboard=False).results == [0, 1]
    assert "rank 0 died (SIGKILL)" in capsys.readouterr().err


def test_a_failing_launch_raises_worker_error_and_the_next_launch_works(pool):
    with pytest.raises(nbtrain.WorkerError) as info:
        pool.launch(fail_on, "raise", dashboard=False)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    # rank 0 waited in an all-reduce for rank 1: freed, and the pool says how
    assert FREED in str(info.value) and "Names on" not in str(info.value)
    line = next(i for i, text in enumerate(open(fail_on.__code__.co_filename), 1)
                if "the healthy ranks wait here" in text)
    assert re.fullmatch(rf"rank 0: stopped by nbtrain, at \S*workloads.py, line {line}, "
                        r"in fail_on: dist.all_reduce\(t\).*", info.value.others[0]), \
        info.value.others
    assert pool.launch(fail_on, "none", dashboard=False).results == [0, 1]
    assert pool.started == 1  # the same warm workers


def test_a_background_launch_can_be_stopped_and_the_pool_goes_on(pool, capsys):
    run = pool.launch(sleeper, background=True, dashboard=False)
    with pytest.raises(RuntimeError, match="busy"):
        pool.run("1")
    deadline, out = time.monotonic() + 20, ""
    while out.count("started") < 2:  # both in the function (not still in nbtrain's setup)
        assert time.monotonic() < deadline
        time.sleep(0.02)
        out += capsys.readouterr().out
    t = time.monotonic()
    run.stop()
    assert time.monotonic() - t < 3.5
    assert run.status == "stopped"
    assert re.search(r"nbtrain: the run was stopped; where the ranks were: ranks 0, 1 at "
                     r"\S*workloads.py, line \d+, in sleeper: time.sleep\(seconds\)",
                     capsys.readouterr().err)
    assert pool.run("rank") == {0: "0", 1: "1"} and pool.started == 1


def test_a_rank_killed_during_a_launch_is_named_and_the_pool_starts_again(pool):
    with pytest.raises(nbtrain.WorkerError) as info:
        pool.launch(fail_on, "sigkill", dashboard=False)
    err = info.value
    assert err.rank == 1 and err.exc_type == "SIGKILL" and "out-of-memory" in str(err)
    assert "workers were ended: rank 1 died (SIGKILL)" in str(err)
    assert pool.launch(fail_on, "none", dashboard=False).results == [0, 1]
    assert pool.started == 2


def test_a_cell_that_crashes_in_native_code_names_its_line(pool):
    """A segfault in a %%ranks cell: the stack the rank wrote as it died is the cell's
    traceback, with the cell's source line (the kernel keeps the cell's text)."""
    with pytest.raises(RankCellError) as info:
        pool.run("import ctypes\nif rank == 1:\n    ctypes.string_at(0)\n")
    err = info.value
    assert err.rank == 1 and err.exc_type == "SIGSEGV" and "in native code" in err.message
    assert re.search(r'\[rank 1\]   File "<%%ranks cell \d+>", line 3, in <module>\n'
                     r"\[rank 1\]     ctypes.string_at\(0\)", err.traceback), err.traceback
    assert pool.run("rank") == {0: "0", 1: "1"}  # a new pool


def test_a_strategy_that_means_another_start_method_is_refused(pool):
    with pytest.raises(ValueError, match="means start_method='spawn'"):
        pool.launch(fail_on, "none", strategy="ddp_spawn")
    assert pool.launch(fail_on, "none", strategy="ddp_notebook",
                       dashboard=False).results == [0, 1]


def test_ranks_line_and_per_rank_display():
    from nbtrain.magics import PerRank, parse_line

    assert parse_line("") == (None, None)
    assert parse_line("all") == (None, None)
    assert parse_line("0,1") == ([0, 1], None)
    assert parse_line("1 --timeout 2.5") == ([1], 2.5)
    assert parse_line("--timeout=3") == (None, 3.0)
    for bad in ("x", "0 1", "--timeout", "--timeout soon"):
        with pytest.raises(ValueError, match="usage"):
            parse_line(bad)
    from nbtrain.magics import RankMagics  # IPython's parser: %%ranks? shows this help
    assert "-t SECONDS, --timeout SECONDS" in RankMagics.ranks.__doc__
    shown = repr(PerRank({0: "a\nb", 1: None, 2: "c"}))
    assert shown == "[rank 0] a\n         b\n[rank 2] c"


def test_import_nbtrain_does_not_import_ipython():
    """Workers import nbtrain; only %load_ext nbtrain brings in IPython (nbtrain.magics)."""
    import subprocess
    import sys

    code = "import sys, nbtrain; print('IPython' in sys.modules, 'nbtrain.magics' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False False", done.stderr


def test_closing_the_pool_stops_its_background_run(pool):
    run = pool.launch(sleeper, background=True, dashboard=False)
    deadline = time.monotonic() + 20
    while run.status != "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pool.close()
    assert run.done and run.status == "stopped"
    assert pool.closed


def test_an_interrupt_as_a_launch_goes_out_stops_the_run_and_the_pool_goes_on(pool,
                                                                              monkeypatch):
    """The interrupt arrives in the instant the launch command reaches the ranks, before
    the run follows them: it is taken once the run does, and stops the run as an
    interrupt in the wait would (it used to leave the ranks running, unfollowed)."""
    assert pool.run("rank") == {0: "0", 1: "1"}
    begin = type(pool.channel).begin

    def begin_then_interrupt(self, *args, **kwargs):
        op = begin(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.05)  # Python runs its handler between bytecodes
        return op

    # Python's own handler, as in a kernel (a shell's `cmd &` inherits SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(type(pool.channel), "begin", begin_then_interrupt)
        with pytest.raises(KeyboardInterrupt, match="the run was stopped"):
            pool.launch(sleeper, dashboard=False)
    finally:
        signal.signal(signal.SIGINT, outer)
        monkeypatch.undo()
    run = nbtrain.last_run()
    assert run.done and run.status == "stopped"
    assert pool.run("rank") == {0: "0", 1: "1"} and pool.started == 1


def test_a_rank_is_quiet_while_it_sleeps_without_cpu_time():
    """The stuck-rank test reads /proc/<pid>/stat: the main thread's state and the
    process's CPU ticks (gloo's polling thread costs a tick now and then)."""
    readings = {}
    quiet = Quiet(read=lambda pid: readings.get(pid))
    tick = Quiet.TICK_S
    readings[1] = ("S", 100)
    assert quiet.observe(1, 10.0) == 0.0  # the first look starts the clock
    readings[1] = ("S", 101)
    assert quiet.observe(1, 10.2) == pytest.approx(0.2)  # a poll's tick is allowed
    readings[1] = ("R", 101)
    assert quiet.observe(1, 10.3) == 0.0  # running: it may still answer
    readings[1] = ("S", 101)
    assert quiet.observe(1, 10.5) == pytest.approx(0.2)
    readings[1] = ("S", 101 + int(0.2 / tick))  # asleep when looked at, but it worked
    assert quiet.observe(1, 10.7) == 0.0
    assert quiet.observe(2, 10.7) == 0.0  # no /proc entry (gone, or not Linux)


def test_quiet_tells_a_sleeping_process_from_a_working_one():
    import subprocess
    import sys

    asleep = subprocess.Popen([sys.executable, "-c", "import time; print('in', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE)
    working = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        asleep.stdout.readline()  # past its start: sleeping from here on
        if not os.path.exists(f"/proc/{asleep.pid}/stat"):
            pytest.skip("no /proc here: the pool waits INTERRUPT_GRACE_S instead")
        quiet, seen, worked = Quiet(), {}, []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = time.monotonic()
            seen = {p.pid: quiet.observe(p.pid, now) for p in (asleep, working)}
            worked.append(seen[working.pid])
            if seen[asleep.pid] >= 0.4:
                break
            time.sleep(0.05)
        assert seen[asleep.pid] >= 0.4 and set(worked) == {0.0}, (seen, worked)
    finally:
        for p in (asleep, working):
            p.kill()
            p.wait()
        asleep.stdout.close()


def test_a_pool_that_cannot_start_says_why_not_that_a_process_was_closed(tmp_path):
    """A spawned pool made at a script's import: its ranks fail while starting (they import
    the script again). The error is the pool's, naming the ranks, with their own reason
    printed above it; it used to be a ValueError ('process object is closed') from
    killing the process group of a rank already reaped."""
    import subprocess
    import sys

    script = tmp_path / "at_import.py"
    script.write_text("import nbtrain\n"
                      "pool = nbtrain.RankPool(devices=2, accelerator='cpu', "
                      "start_method='spawn')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert "RankCellError: rank 0 failed" in done.stderr, done.stderr[-2000:]
    assert "process object is closed" not in done.stderr
    assert 'Put the launch under `if __name__ == "__main__":`' in done.stderr


def test_links_are_the_tcp_connections_between_the_ranks_only():
    """What a pool shuts down to free a stuck rank: each rank's TCP connections to another
    rank (here this process, rank 0, and a child, rank 1), not its listening sockets nor
    its connections to a process outside the pool."""
    import socket
    import subprocess
    import sys

    from nbtrain.launch.following.links import links

    if not os.path.exists(f"/proc/{os.getpid()}/net/tcp"):
        pytest.skip("no /proc here: a stuck rank's peers only destroy their group")
    script = ("import socket, sys, time\n"
              "if sys.argv[1] == 'listen':\n"
              "    s = socket.create_server(('127.0.0.1', 0))\n"
              "    print(s.getsockname()[1], flush=True)\n"
              "    c, _ = s.accept()\n"
              "else:\n"
              "    c = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
              "    print(c.fileno(), flush=True)\n"
              "time.sleep(60)\n")
    listener = socket.create_server(("127.0.0.1", 0))
    outsider = subprocess.Popen([sys.executable, "-c", script, "listen"], stdout=subprocess.PIPE)
    rank1 = subprocess.Popen([sys.executable, "-c", script, str(listener.getsockname()[1])],
                             stdout=subprocess.PIPE)
    try:
        to_outsider = socket.create_connection(("127.0.0.1", int(outsider.stdout.readline())))
        accepted, _ = listener.accept()
        their_fd = int(rank1.stdout.readline())
        assert links({0: os.getpid(), 1: rank1.pid}) == {0: (accepted.fileno(),),
                                                          1: (their_fd,)}
        assert links({}) == {}
        to_outsider.close()
        accepted.close()
    finally:
        for p in (outsider, rank1):
            p.kill()
            p.wait()
        listener.close()


class _Handle:
    """What a PoolOp reads of a rank's handle, for the decision test: its signals are
    taken out of the op, and would reach only a sleeping child of the test."""

    def __init__(self, rank, pid):
        self.rank, self.pid = rank, pid


@pytest.mark.parametrize("idle_peer", [True, False])
def test_a_stuck_cpu_rank_is_freed_by_an_idle_peer_and_a_gpu_rank_is_not(monkeypatch,
                                                                         idle_peer):
    """The decision a pool takes for a rank that does not answer an interrupt, driven by
    hand (a fake clock, ranks seen asleep): on CPU ranks the idle peers are told to leave
    the group and the stuck rank gets FREE_S to reply (the pool is ended at once when
    no peer is idle, and after FREE_S if it stays busy); on GPU ranks nobody is told,
    and the pool is ended after INTERRUPT_GRACE_S."""
    import subprocess
    import sys

    from nbtrain.launch.pool import op as pool_op

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for cpu in (True, False):
            _decide(monkeypatch, pool_op, _Handle(0, child.pid), cpu, idle_peer)
    finally:
        child.kill()
        child.wait()


def _decide(monkeypatch, pool_op, handle, cpu: bool, idle_peer: bool) -> None:
    killed, told = [], []

    def drop_group(busy):
        told.append(set(busy))
        return {1} if idle_peer and len(told) == 1 else set()

    op = pool_op.PoolOp([handle], print, None, lambda: killed.append(True),
                        watch_cpu=cpu, drop_group=drop_group)
    try:
        monkeypatch.setattr(op.watch, "ask_stacks", lambda ranks: None)
        monkeypatch.setattr(op, "_interrupt", lambda now: None)
        monkeypatch.setattr(op, "_asleep", lambda now: cpu)  # GPU ranks are not watched
        op.stop_requested = "interrupted"
        op._advance(0.0)  # the teardown begins, and (no stacks to wait for) interrupts
        assert op.interrupted_at == 0.0
        op._advance(pool_op.STUCK_S)  # asleep since: stuck
        if not cpu:
            assert told == [] and killed == [] and not op.freed
            op._advance(pool_op.INTERRUPT_GRACE_S)
            assert killed == [True] and op.killed == [0]
            return
        assert op.freed == [0] and told == [{0}] and op.stuck
        if not idle_peer:  # nobody to free it
            assert killed == [True] and op.killed == [0] and not op.dropped
            return
        assert killed == [] and op.dropped == {1}
        op._advance(pool_op.STUCK_S + pool_op.FREE_S / 2)  # still waiting for it
        assert killed == [] and told[-1] == {0}
        op._advance(pool_op.STUCK_S + pool_op.FREE_S + 0.01)  # it never replied
        assert killed == [True] and op.killed == [0]
    finally:
        op.watch.close(end_ranks=False)


def test_what_ranks_write_as_their_group_starts_again_is_not_the_cells_output():
    """After a stuck rank was freed, what the ranks print as their group starts again
    goes to stderr; a display or a bar goes where it goes. (gloo's "[Gloo] Rank N is
    connected to ..." line, which the Kaggle leg found in notebook 03's checked output,
    the watch drops for every run: test_stacks.)"""
    from nbtrain.launch.pool.channel import _quieter

    seen = []
    emit = _quieter(lambda *line: seen.append(line))
    emit(0, "out", "a warning of the user's own")
    emit(1, "out-live", "epoch 0:  50%")
    assert seen == [(0, "err", "a warning of the user's own"), (1, "out-live", "epoch 0:  50%")]
