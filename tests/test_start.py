"""How ranks start: rank 0 hosts the rendezvous store (never the kernel, whose forks
would copy a store thread's held locks), and a rank that never joins is named with
where it waits instead of hanging the cell."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from workloads import fail_on

import nbtrain
from nbtrain.launch.following import late
from nbtrain.rank import worker

pytestmark = pytest.mark.usefixtures("no_leftovers")


def _thread_names() -> list[str]:
    """Every thread of this process as the OS names it: native ones too (c10d's store
    server is ``pt_tcpstore_uv``)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


def test_the_launching_process_runs_no_store_while_ranks_start():
    runs = [nbtrain.launch(fail_on, "none", devices=4, accelerator="cpu", background=True,
                           dashboard=False) for _ in range(2)]
    during = _thread_names()
    pool = nbtrain.RankPool(devices=2, accelerator="cpu")
    try:
        with_pool = _thread_names()
        assert pool.run("dist.get_world_size()") == {0: "2", 1: "2"}
    finally:
        pool.close()
    for run in runs:
        assert run.wait() == [0, 1, 2, 3]  # fail_on returns the rank
    assert not [n for n in during + with_pool if n.startswith("pt_tcpstore")], during


def _stuck_before_joining(spec, control, commands):
    """Rank 1 never reaches the store (as a rank holding a copied lock would)."""
    if spec.rank == 1:
        threading.Event().wait()
    return _REAL_INIT(spec, control, commands)


_REAL_INIT = worker.init_distributed


def test_a_rank_that_never_joins_is_named_with_where_it_waits(monkeypatch):
    monkeypatch.setattr(late, "JOIN_TIMEOUT_S", 2.0)
    monkeypatch.setattr(worker, "init_distributed", _stuck_before_joining)  # forked: inherited
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(fail_on, "none", devices=3, accelerator="cpu", start_method="fork",
                       timeout=60, dashboard=False)
    err = info.value
    assert (err.rank, err.exc_type) == (1, "StartTimeout")
    assert "did not join the process group within 2 s" in err.message
    assert "(joined: none)" in err.message  # rank 0 and 2 wait in the group's start for it
    assert "_stuck_before_joining" in err.traceback  # its stack says where it waits
    assert "Launch again" in str(err)


def test_a_pool_rank_that_never_joins_fails_the_start(monkeypatch):
    monkeypatch.setattr(late, "JOIN_TIMEOUT_S", 2.0)
    monkeypatch.setattr(worker, "init_distributed", _stuck_before_joining)
    from nbtrain.rank import pool_worker

    monkeypatch.setattr(pool_worker, "init_distributed", _stuck_before_joining)
    with pytest.raises(nbtrain.WorkerError, match="rank 1 did not join") as info:
        nbtrain.RankPool(devices=2, accelerator="cpu", start_method="fork")
    assert "_stuck_before_joining" in str(info.value)


def late_rank(ctx):
    if ctx.rank == 1:
        time.sleep(3)
    return ctx.rank


def test_a_rank_still_running_after_the_others_returned_is_named(monkeypatch, capsys):
    monkeypatch.setattr(late, "STRAGGLER_S", 0.5)
    run = nbtrain.launch(late_rank, devices=2, accelerator="cpu", dashboard=False)
    assert run.results == [0, 1]  # named, not ended
    err = capsys.readouterr().err
    assert "[rank 1] nbtrain: rank 1 is still running" in err and "after rank 0 returned" in err
    # its function's frames from the stack it wrote, as a traceback shows them: not the
    # whole dump (helper threads, the kernel's frames a fork copied)
    line = late_rank.__code__.co_firstlineno + 2
    assert re.search(r'\[rank 1\] nbtrain: rank 1 is still running \d+ s after rank 0 '
                     r'returned; where it is now:\n'
                     rf'\[rank 1\]   File "\S+test_start.py", line {line}, in late_rank\n'
                     r"\[rank 1\]     time.sleep\(3\)\n", err), err
    assert "Thread 0x" not in err and "popen_fork" not in err, err


def returns_at_once(ctx):
    return ctx.rank


def test_ranks_that_return_at_once_never_fail_a_peer_still_joining():
    """Without a barrier at the end of the start, a rank whose function has no collective
    could return and exit while a peer was still connecting its gloo group, which then
    failed with "Connection closed by peer" (1 start in 300 on a busy 2-core machine,
    start_stress.py --kinds quick --busy 4). Here 100 such starts on a busy machine."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2)]
    try:
        for _ in range(100):
            run = nbtrain.launch(returns_at_once, devices=4, accelerator="cpu",
                                 background=True, dashboard=False)
            run.wait()
            assert run.results == [0, 1, 2, 3]
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def test_a_run_option_is_defined_once_and_taken_alike_everywhere():
    """Each field of ``RunOptions`` is a keyword of launch(), pool.launch(), scaling(),
    submit() and the StrategyPicker with the field's default (where the entry point does
    not decide it itself), documented in their help, and reaches the ``Request``: a new
    option is one field, and an entry point that forgot it fails here."""
    import dataclasses
    import inspect

    from nbtrain.launch import options, start
    from nbtrain.launch.pool.ranks import RankPool
    from nbtrain.scaleout.slurm import submit
    from nbtrain.ui.picker import StrategyPicker

    fields = dataclasses.fields(options.RunOptions)
    takers = {"launch": nbtrain.launch, "pool.launch": RankPool.launch,
              "scaling": nbtrain.scaling, "submit": submit, "picker": StrategyPicker.__init__}
    for who, api in takers.items():
        params = inspect.signature(api).parameters
        assert list(params)[-1] == "kwargs", who  # the function's own keywords last
        for f in fields:
            if f.name in api.run_options:
                assert params[f.name].default == f.default, (who, f.name)
                assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY, (who, f.name)
            else:  # decided by the entry point itself
                assert f.name not in params, (who, f.name)
        assert options.MARK not in (api.__doc__ or ""), who
    assert set(nbtrain.launch.run_options) == set(options.NAMES)
    assert set(RankPool.launch.run_options) == set(options.NAMES) - {"collective_timeout"}
    for f in fields:
        assert f"        {f.name}: " in nbtrain.launch.__doc__, f.name
    given, own = options.split("launch()", dict(timeout=5.0, seed=3, max_restarts=2,
                                                 background=True, lr=0.1))
    assert own == {"lr": 0.1}
    request = start.check("launch()", lambda ctx, lr: None, (), own, given)
    assert (request.timeout, request.seed, request.max_restarts, request.background,
            request.kwargs) == (5.0, 3, 2, True, {"lr": 0.1})
    assert {f.name for f in fields} <= {f.name for f in dataclasses.fields(start.Request)}


def test_an_option_an_entry_point_decides_itself_fails_with_its_reason(tmp_path):
    from nbtrain.scaleout.slurm import submit

    with pytest.raises(ValueError, match="two launches one after the other"):
        nbtrain.scaling(lambda ctx: None, devices=2, accelerator="cpu", background=True)
    with pytest.raises(ValueError, match=r"slurm=\{'time'"):
        submit(lambda ctx: None, timeout=60, folder=tmp_path)
    with pytest.raises(ValueError, match="timeout=-1 must be a positive"):
        nbtrain.scaling(lambda ctx: None, devices=2, accelerator="cpu", timeout=-1)
    with pytest.raises(TypeError, match="background='yes'"):
        nbtrain.launch(lambda ctx: None, accelerator="cpu", background="yes")


class _CountingStream:
    """A kernel's ``sys.stdout`` as far as a fork sees it: flushes are counted."""

    def __init__(self):
        self.flushes = 0

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        self.flushes += 1


# a spawned child's code: whether it imported the kernel's side of nbtrain
_CHILD = ("import os, sys; "
          "os._exit(7 if 'nbtrain.launch.starting.launcher' in sys.modules else 3)")


@pytest.mark.parametrize("method, package", [("fork", "multiprocessing"),
                                             ("spawn", "multiprocess")])
def test_a_rank_starts_without_flushing_the_kernels_streams(monkeypatch, method, package):
    """multiprocessing flushes sys.stdout and sys.stderr before each start: in a kernel,
    a round trip to ipykernel's IOPub thread each, for text no rank writes (a rank takes
    fds 1 and 2 as it starts and ends with os._exit). The launchers' processes are the
    package's otherwise: the same state once started, the same exit, and a spawned child
    unpickles the package's own process class, not one from the kernel's side."""
    import importlib

    from nbtrain.launch.starting import launchers

    launcher = launchers.make(method)
    if method == "spawn":
        launcher._count()  # the resource tracker it starts is stopped at its close
    out, err = _CountingStream(), _CountingStream()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    ours = launcher._context.Process(target=exec, args=(_CHILD,))
    theirs = importlib.import_module(package).get_context(method).Process(
        target=exec, args=(_CHILD,))
    try:
        ours.start()
        assert (out.flushes, err.flushes) == (0, 0)
        theirs.start()
        assert (out.flushes, err.flushes) == (1, 1)  # what the package does: what we skip
    finally:
        for process in (ours, theirs):
            if process.pid is not None:
                process.join(60)
        launcher.close()
    # a fork is a copy of this process; a spawned child imported nothing of the kernel's
    assert ours.exitcode == theirs.exitcode == (7 if method == "fork" else 3)
    assert sorted(vars(ours._popen)) == sorted(vars(theirs._popen))


def test_a_fork_server_child_unpickles_the_packages_own_process_class():
    from multiprocess import context, reduction

    from nbtrain.launch.starting.launcher import unflushed

    process = unflushed("multiprocess", "forkserver", "popen_forkserver",
                        keeps_fds=True).Process(target=exec, args=("",))
    context.set_spawning_popen(process)  # what the process's start pickles it inside
    try:
        again = reduction.ForkingPickler.loads(reduction.ForkingPickler.dumps(process))
    finally:
        context.set_spawning_popen(None)
    assert type(again) is context.ForkServerProcess and again._args == ("",)
