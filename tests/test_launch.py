"""Real two-process runs on CPU/gloo: correctness, failures, output, results."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn
from workloads import (
    chatty,
    collections_in_a_rank,
    fail_on,
    nested,
    out_of_memory,
    sleeper,
    train,
    train_single,
    unpicklable,
)

import nbtrain
from nbtrain.telemetry.events import Lifecycle

pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture(scope="module")
def single():
    return train_single()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_grad_op", "fsdp_hybrid"])
def test_strategies_train_what_one_process_trains(strategy, single):
    env_before = dict(os.environ)
    run = nbtrain.launch(train, devices=2, accelerator="cpu", strategy=strategy)
    assert dict(os.environ) == env_before  # nothing left in the kernel's environment
    assert run.status == "done" and run.done
    assert [r["rank"] for r in run.results] == [0, 1]
    assert [r["env_rank"] for r in run.results] == ["0", "1"]
    assert all(r["world_size"] == 2 and r["device"] == "cpu" for r in run.results)
    full = run.result["full"]
    assert run.results[1]["full"] == {}  # gathered on rank 0 only
    assert set(full) == set(single)
    for name, value in single.items():
        torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5,
                                   msg=f"{strategy}: {name} differs from 1-process training")
    if strategy == "ddp":
        for name, value in run.results[0]["local"].items():
            assert torch.equal(value, run.results[1]["local"][name]), f"replicas differ at {name}"
    # the history holds every rank's loss at every step
    for rank in (0, 1):
        assert [s for s, _ in run.history.metric("loss", rank)] == list(range(8))


def test_workers_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = nbtrain.launch(train, devices=2, accelerator="cpu")
    cores = len(os.sched_getaffinity(0))
    assert [r["threads"] for r in run.results] == [max(1, cores // 2)] * 2


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_ranks_collections_leave_what_it_started_with_alone(start_method):
    """A full collection walked a forked rank's copy of every kernel object, writing to
    each one's header: 150-250 ms in the middle of a step, every few dozen steps, and
    every page copied. While the function runs, what was there before is frozen; what
    the function makes is collected as usual, and the kernel's own collector is as it
    was. (A pool's worker unfreezes after each run: ``tests/test_pool.py``.)"""
    import gc

    objects = len(gc.get_objects())
    run = nbtrain.launch(collections_in_a_rank, devices=2, accelerator="cpu",
                         start_method=start_method, dashboard=False)
    for frozen, collected in run.results:
        if start_method == "fork":
            assert frozen >= objects * 0.9, (frozen, objects)
        assert frozen > 0 and collected >= 1
    assert gc.get_freeze_count() == 0


def test_spawn_runs_a_function_defined_in_place(single):
    # Defined here, not importable by name: under spawn it travels by value with the
    # class and constant it uses.
    scale = 3

    class Box:
        def __init__(self, v):
            self.v = v

    def local_train(ctx, k):
        return Box(ctx.rank * scale + k)

    run = nbtrain.launch(local_train, 10, devices=2, start_method="spawn")
    assert run.start_method == "spawn"
    assert [b.v for b in run.results] == [10, 13]


def test_aliases_pick_their_start_method():
    assert nbtrain.launch(fail_on, "none", devices=2, strategy="ddp_spawn").start_method == "spawn"
    assert nbtrain.launch(fail_on, "none", devices=2, strategy="ddp_notebook").start_method == "fork"
    with pytest.raises(ValueError, match="means start_method='fork'"):
        nbtrain.launch(fail_on, "none", devices=2, strategy="ddp_notebook", start_method="spawn")


def _failed_at(run) -> float:
    return min(e.t for e in run.history.events("lifecycle") if isinstance(e, Lifecycle)
               and e.state == "failed")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_raising_rank_ends_the_run(start_method):
    run = nbtrain.launch(fail_on, "raise", devices=2, start_method=start_method,
                         background=True)
    with pytest.raises(nbtrain.WorkerError) as info:
        run.wait(timeout=60)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert err.message == "bad batch on purpose"
    assert "[rank 1] Traceback" in err.traceback and "fail_on" in err.traceback
    assert "rank 0: stopped by nbtrain" in str(err)
    assert run.status == "failed" and run.rank_status == {0: "stopped", 1: "failed"}
    assert run.ended_at - _failed_at(run) < 2.0  # the other rank was ended promptly
    with pytest.raises(nbtrain.WorkerError):
        _ = run.results


def test_a_data_loader_workers_error_reads_as_its_own_and_where_it_was_raised():
    """torch raises it again in the rank with the worker's whole traceback as the
    message; the headline is the worker's exception, the traceback keeps all of it."""
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(fail_on, "loader", devices=2, dashboard=False)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert err.message == "sample 2 is corrupt (raised in DataLoader worker process 0)"
    assert "__getitem__" in err.traceback and "Original Traceback" in err.traceback
    assert str(err).startswith("rank 1 failed with ValueError: sample 2 is corrupt (raised")


@pytest.mark.parametrize("what", ["launch", "pool"])
def test_a_rank_that_launches_ranks_of_its_own_is_told_to_call_the_function(what):
    """It forked ranks of its own, whose process group met the run's: the error was an
    init_process_group complaint from a rank the user never meant to start."""
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(nested, what, devices=2, dashboard=False)
    err = info.value
    assert err.exc_type == "RuntimeError", str(err)
    who = "launch()" if what == "launch" else "RankPool()"
    assert err.message == (f"nbtrain's {who} was called in rank {err.rank} of 2: a rank "
                           "starts no ranks of its own. Call the function here instead (it "
                           "runs as this rank, in the run's process group), or launch it "
                           "from the notebook.")


def test_a_killed_rank_names_the_signal_and_the_likely_cause():
    t = time.monotonic()
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(fail_on, "sigkill", devices=2)
    assert time.monotonic() - t < 30
    err = info.value
    assert err.rank == 1 and err.exc_type == "SIGKILL"
    assert "out-of-memory" in str(err)


def test_a_crash_in_native_code_shows_the_line_each_rank_ran():
    """A segfault gives no Python exception: the rank's own stack (faulthandler, as it
    died) is its traceback, and the rank nbtrain ended says where it was waiting."""
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(fail_on, "segfault", devices=2, dashboard=False)
    err = info.value
    assert err.rank == 1 and err.exc_type == "SIGSEGV"
    assert err.message == "rank 1 was killed by SIGSEGV (signal 11) in native code"
    # as Python writes a traceback: from the user's function on, with its source lines
    assert re.search(r"\[rank 1\] Traceback \(most recent call last\):\n"
                     r'\[rank 1\]   File ".*workloads.py", line \d+, in fail_on\n'
                     r"\[rank 1\]     ctypes.string_at\(0\)", err.traceback), err.traceback
    assert "rank/worker.py" not in err.traceback and "Fatal Python error" not in err.traceback
    # rank 0 is ended where it waits for rank 1 (unless gloo told it first)
    assert len(err.others) == 1 and re.fullmatch(
        r"rank 0: (stopped by nbtrain(, at \S*workloads.py, line \d+, in fail_on: "
        r"dist.all_reduce\(t\).*)?|also failed with RuntimeError: .*gloo.*)",
        err.others[0]), err.others


def child_crashes(ctx):
    """A child of the rank (as a DataLoader worker would) dies of a segfault, writing its
    dump to the rank's stderr; the rank goes on."""
    subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                    "import ctypes; ctypes.string_at(0)"], check=False)
    print("the rank goes on", file=sys.stderr, flush=True)
    time.sleep(60)


def test_a_childs_crash_dump_is_shown_as_it_comes_and_the_rank_goes_on(capsys):
    """Not held back as the rank's own death: the dump and what follows reach the cell
    while the rank runs, in order."""
    run = nbtrain.launch(child_crashes, devices=2, dashboard=False, background=True)
    err, deadline = "", time.monotonic() + 60
    while err.count("the rank goes on") < 2 and time.monotonic() < deadline:
        err += capsys.readouterr().err
        time.sleep(0.05)
    assert not run.done
    run.stop()
    for rank in (0, 1):
        dump = err.index(f"[rank {rank}] Fatal Python error: Segmentation fault")
        assert dump < err.index(f"[rank {rank}] the rank goes on"), err
        assert f'[rank {rank}]   File "<string>", line 1 in <module>' in err


def test_ranks_that_run_different_collectives_are_told_so_and_not_restarted():
    run = nbtrain.launch(fail_on, "mismatch", devices=2, dashboard=False, max_restarts=1,
                         background=True)
    with pytest.raises(nbtrain.WorkerError) as info:
        run.wait(timeout=60)
    err = info.value  # gloo aborts the rank that received more than it expected
    assert err.rank == 0 and err.exc_type == "SIGABRT", str(err)
    assert "Is there a distributed collective mismatch in your code?" in err.message
    assert ", in fail_on" in err.traceback
    assert "ran different collectives at the same time" in err.hint
    # rank 1 was ended (where it waits, when it said), unless gloo told it first
    assert re.search(r"rank 1: (stopped by nbtrain|also failed with RuntimeError: .*gloo)",
                     str(err)), err.others
    assert "linecache" not in str(err) and "hosting.py" not in str(err)  # never ours
    assert run.attempts == []  # it would do it again


def test_a_collective_that_its_peers_never_ran_is_named_and_not_restarted():
    """Rank 1 runs one all_reduce more than rank 0, which returns: gloo says "connection
    closed by peer ... a remote worker crashing"; nbtrain says what happened."""
    run = nbtrain.launch(fail_on, "alone", devices=2, dashboard=False, max_restarts=1,
                         background=True)
    with pytest.raises(nbtrain.WorkerError) as info:
        run.wait(timeout=60)
    err = info.value
    assert err.rank == 1 and "rank 0: had finished" in str(err)
    assert err.hint.startswith("Rank 0 had returned when rank 1 waited in this collective: "
                               "rank 1 ran a collective that rank 0 did not")
    assert run.attempts == []


def test_a_rank_that_exits_without_returning():
    with pytest.raises(nbtrain.WorkerError, match="exited with code 3 before returning"):
        nbtrain.launch(fail_on, "exit", devices=2)


def test_a_script_that_spawns_at_import_is_told_to_guard_it(tmp_path):
    """Spawn imports the main script again in each worker; a script that launches at
    import gets told so by the worker and by the error, not just "exited with code 1"."""
    script = tmp_path / "train.py"
    script.write_text("import nbtrain\n\ndef train(ctx):\n    return ctx.rank\n\n"
                      "nbtrain.launch(train, devices=2, accelerator='cpu', "
                      "start_method='spawn', dashboard=False)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert done.returncode == 1
    assert "the script launches workers at import" in done.stderr  # from the worker
    assert "WorkerError: rank" in done.stderr and "exited with code 1" in done.stderr
    assert 'put the launch under `if __name__ == "__main__":`' in done.stderr.split(
        "WorkerError")[-1]  # the kernel's error says it too


def test_a_hang_ends_at_the_timeout_naming_the_ranks():
    t = time.monotonic()
    with pytest.raises(nbtrain.RunTimeoutError) as info:
        nbtrain.launch(fail_on, "hang", devices=2, timeout=3)
    assert 3 <= time.monotonic() - t < 15
    assert info.value.ranks == [0, 1]
    assert "ranks still running: 0, 1" in str(info.value)
    # where each one was: rank 1 in its own sleep, rank 0 in the collective that waits
    where = info.value.where
    assert re.fullmatch(r"\S*workloads.py, line \d+, in fail_on: time.sleep\(3600\)",
                        where[1]), where
    assert re.fullmatch(r"\S*workloads.py, line \d+, in fail_on: dist.all_reduce\(t\)  "
                        r"# the healthy ranks wait here for the failed one", where[0]), where
    assert "where they were:\n  rank 0: still running, at " in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).where == where


def test_background_run_can_be_waited_on_and_stopped():
    run = nbtrain.launch(sleeper, devices=2, background=True)
    assert not run.done and run.status in ("starting", "running")
    with pytest.raises(TimeoutError, match="still going"):
        run.wait(timeout=0.5)
    t = time.monotonic()
    run.stop()
    assert time.monotonic() - t < 3
    assert run.done and run.status == "stopped"
    with pytest.raises(nbtrain.RunStoppedError):
        _ = run.results
    assert run.wait() is None


def test_a_stopped_run_says_where_each_rank_was(capsys):
    """Stopping a run that seems hung (the stop button, an interrupt, run.stop()) says
    where its ranks were, ranks at the same line together."""
    run = nbtrain.launch(sleeper, devices=2, background=True, dashboard=False)
    seen, deadline = "", time.monotonic() + 60
    while seen.count("started") < 2 and time.monotonic() < deadline:
        seen += capsys.readouterr().out
        time.sleep(0.05)
    run.stop()
    assert run.status == "stopped"
    assert re.search(r"nbtrain: the run was stopped; where the ranks were: ranks 0, 1 at "
                     r"\S*workloads.py, line \d+, in sleeper: time.sleep\(seconds\)\n",
                     capsys.readouterr().err)


def test_output_reaches_the_kernel_labelled_and_whole(capsys):
    run = nbtrain.launch(chatty, devices=2)
    assert run.results == [50, 50]
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("[rank")]
    pieces = [line for line in lines if "-l" in line]
    assert len(pieces) == 100
    for line in pieces:
        match = re.fullmatch(r"\[rank (\d)\] r(\d)-l\d+-p0x{50}\|r\2-l\d+-p1x{50}\|"
                             r"r\2-l\d+-p2x{50}\|r\2-l\d+-p3x{50}", line)
        assert match and match.group(1) == match.group(2), line
    assert "[rank 0] no newline at the end" in out
    assert "[rank 1] to-stderr-1" in err


def test_results_that_cannot_travel_are_named():
    with pytest.raises(nbtrain.WorkerError, match=r"the result\['gen'\] of type generator"):
        nbtrain.launch(unpicklable, devices=2)


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(ValueError, match="devices=0"):
        nbtrain.launch(train, devices=0)
    with pytest.raises(ValueError, match="known strategies"):
        nbtrain.launch(train, devices=2, strategy="zero9")
    with pytest.raises(ValueError, match="nothing to offload"):
        nbtrain.launch(train, devices=2, accelerator="cpu", strategy="fsdp_offload")
    with pytest.raises(ValueError, match="timeout"):
        nbtrain.launch(train, devices=2, timeout=-1)
    with pytest.raises(TypeError, match="function to run"):
        nbtrain.launch("train", devices=2)
    with pytest.raises(TypeError, match="cannot send fail_on"):
        nbtrain.launch(fail_on, (i for i in range(3)), devices=2, start_method="spawn")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for 2 threads")
def test_forked_workers_do_not_hang_in_openmp():
    """Once the kernel ran a parallel op, a forked worker with >1 thread would hang."""
    script = """
import warnings, torch, nbtrain
def threads(ctx):
    (torch.ones(1 << 20) * 2).sum()          # a parallel region in the worker
    return torch.get_num_threads()
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    print("fresh", nbtrain.launch(threads, devices=1, timeout=60).result, len(w))
    torch.set_num_threads(2)
    (torch.ones(1 << 20) * 2).sum()          # now the kernel's OpenMP pool exists
    print("after", nbtrain.launch(threads, devices=1, timeout=60).result,
          any("OpenMP" in str(x.message) for x in w))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "NBTRAIN_DASHBOARD": "off"})
    assert done.returncode == 0, done.stderr
    cores = len(os.sched_getaffinity(0))
    assert f"fresh {cores} 0" in done.stdout
    assert "after 1 True" in done.stdout


def test_workers_exit_cleanly_run_after_run():
    """Regression: a worker used to hang at exit in the gloo process group's destructor
    (it joins its thread holding the GIL, the thread waits for the GIL). Workers now
    leave without running destructors."""
    from workloads import log_many

    for _ in range(6):
        run = nbtrain.launch(log_many, 30, devices=2, telemetry=False, timeout=60)
        assert run.results == [30, 30]


def test_a_rank_leaves_at_once_with_its_code_running_no_teardown():
    """What every rank's exit goes through: the code, and nothing of Python's teardown
    (atexit, destructors) runs: that teardown is what hung in gloo's destructor."""
    import multiprocessing

    from nbtrain.rank.worker import leave

    def child():
        import atexit

        atexit.register(lambda: os.write(1, b"teardown ran"))
        leave(3)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == 3


def test_cell_files_are_named_as_ipython_names_them(monkeypatch):
    """What the kernel does to a worker's traceback (in-kernel: tests/test_kernel.py)."""
    import linecache

    from nbtrain import errors

    monkeypatch.setattr(errors, "filename_map", lambda: {"/tmp/ipykernel_1/42.py": 7})
    linecache.cache["/tmp/ipykernel_1/42.py"] = (20, None, ["x = 1\n", "    1 // 0\n"],
                                                 "/tmp/ipykernel_1/42.py")
    try:
        text = ('Traceback (most recent call last):\n'
                '  File "<%%ranks In[9]>", line 3, in <module>\n'  # a %%ranks cell's
                '    train()\n'
                '  File "/tmp/ipykernel_1/42.py", line 2, in train\n'   # spawned: no source
                '  File "<ipython-input-4-5e3a>", line 1, in f\n'  # IPython 7's name
                '    g()\n'
                '  File "/lib/torch/x.py", line 5, in g\n'
                '    h()\n'
                'ZeroDivisionError: integer division or modulo by zero\n')
        assert errors.cell_names(text) == (
            'Traceback (most recent call last):\n'
            '  Cell In[9], line 3, in <module>\n'
            '    train()\n'
            '  Cell In[7], line 2, in train\n'
            '    1 // 0\n'
            '  Cell In[4], line 1, in f\n'
            '    g()\n'
            '  File "/lib/torch/x.py", line 5, in g\n'
            '    h()\n'
            'ZeroDivisionError: integer division or modulo by zero\n')
    finally:
        del linecache.cache["/tmp/ipykernel_1/42.py"]


@pytest.mark.parametrize("during, after", [(5, 5), (5, 6)])
def test_the_running_cell_is_the_one_its_result_names(monkeypatch, during, after):
    """IPython 9 counts In[n + 1] while cell n runs (7 and 8 still n): the running cell's
    number is the one its result carries, which %%ranks names its code by."""
    import types

    import IPython

    from nbtrain import cells

    shell = types.SimpleNamespace(execution_count=after, displayhook=types.SimpleNamespace(
        exec_result=types.SimpleNamespace(execution_count=during)))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    assert cells.current() == during
    shell.displayhook.exec_result = None  # between cells
    assert cells.current() == after


# -- starting and ending workers when interrupted ---------------------------------------
def test_an_interrupt_while_a_worker_starts_arrives_after_its_handle_is_kept():
    from nbtrain.launch.starting.launcher import interrupts_deferred

    # Python's own handler, as in a kernel: a process started in the background by a
    # non-interactive shell (`cmd &`) inherits SIGINT ignored, and then nothing is raised
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        kept = []
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.05)  # Python runs signal handlers between bytecodes
            kept.append("handle")
        assert kept == ["handle"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_an_interrupt_as_the_ranks_start_stops_the_run(monkeypatch):
    """An interrupt in the instant between the ranks' start and the run following them
    is taken once the run follows them, and stops it: no rank is left unfollowed."""
    from nbtrain.launch import start

    start_ranks = start.start_ranks

    def start_then_interrupt(*args, **kwargs):
        handles = start_ranks(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.05)  # Python runs its handler between bytecodes
        return handles

    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(start, "start_ranks", start_then_interrupt)
        with pytest.raises(KeyboardInterrupt, match="the run was stopped"):
            nbtrain.launch(sleeper, devices=2, accelerator="cpu", dashboard=False)
    finally:
        signal.signal(signal.SIGINT, outer)
    run = nbtrain.last_run()
    assert run.done and run.status == "stopped"


def test_kill_group_ends_a_worker_that_is_not_yet_its_own_group():
    """A spawned worker joins its own process group only once nbtrain's code runs in it;
    before that (importing torch) killpg finds no group, and the worker must still end."""
    from nbtrain.launch.following.watch import kill_group

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert os.getpgid(child.pid) == os.getpgid(0)  # still in ours, as after exec
        kill_group(child.pid, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
        kill_group(child.pid, signal.SIGKILL)  # reaped: its number is left alone
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_stopping_the_resource_tracker_never_hangs_on_a_leftover_holder():
    """multiprocess's tracker exits when every copy of its pipe closes; a process still
    holding one made ``_stop()`` wait forever in the kernel."""
    from multiprocess import resource_tracker

    from nbtrain.launch.starting.spawn import _stop_tracker

    tracker = resource_tracker.ResourceTracker()
    tracker.ensure_running()
    pid = tracker._pid
    holder = os.fork()
    if holder == 0:  # holds the tracker's pipe, as a worker left alive would
        time.sleep(60)
        os._exit(0)
    try:
        start = time.monotonic()
        _stop_tracker(tracker, timeout=1.0)
        assert time.monotonic() - start < 10
        assert tracker._fd is None and tracker._pid is None
        with pytest.raises(ChildProcessError):  # ended and reaped
            os.waitpid(pid, os.WNOHANG)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)


def takes_lr(ctx, lr=0.1):
    return (lr, ctx.strategy.name, ctx.strategy.mixed_precision,
            ctx.strategy.activation_checkpointing)


def test_strategy_options_given_to_launch_reach_the_strategy():
    run = nbtrain.launch(takes_lr, devices=2, strategy="fsdp", lr=0.5,
                         mixed_precision="bf16", activation_checkpointing="auto")
    assert run.results == [(0.5, "fsdp", "bf16", "auto")] * 2
    assert run.strategy.mixed_precision == "bf16"


def test_an_argument_that_fits_nowhere_fails_before_anything_starts():
    from conftest import descendants

    before = len(descendants(os.getpid()))
    with pytest.raises(TypeError, match=r"takes_lr\(ctx, lr=0\.1\) takes no argument 'wrap'.*"
                                        r"strategy 'ddp'.*activation_checkpointing"):
        nbtrain.launch(takes_lr, devices=2, strategy="ddp", wrap=(nn.Linear,))
    with pytest.raises(TypeError, match="cannot be called with"):
        nbtrain.launch(takes_lr, 1, 2, 3, devices=2)
    assert len(descendants(os.getpid())) == before


def test_sync_batchnorm_on_cpu_says_what_it_needs():
    with pytest.raises(ValueError, match="sync_batchnorm=True needs GPUs"):
        nbtrain.launch(takes_lr, devices=2, accelerator="cpu", sync_batchnorm=True)


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_function_written_for_torchrun_runs_as_it_is(start_method):
    from workloads import torchrun_style

    run = nbtrain.launch(torchrun_style, 2.0, devices=2, start_method=start_method,
                         dashboard=False)
    assert run.results == [(0, 2, 0), (1, 2, 1)]
    assert run.note is None  # the ranks trained together
    assert [len(run.history.events("step", r)) for r in (0, 1)] == [8, 8]


def test_a_function_written_for_torchrun_runs_on_a_pool_twice():
    from workloads import torchrun_style

    with nbtrain.RankPool(devices=2, accelerator="cpu") as pool:
        for _ in range(2):  # its destroy_process_group left the pool's group alone
            assert pool.launch(torchrun_style, dashboard=False).results == [(0, 2, 0),
                                                                            (1, 2, 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_running_out_of_memory_says_what_filled_it_and_what_would_help(strategy, no_leftovers):
    """A rank's OOM (torch's own error, injected here on CPU ranks) comes back with that
    rank's memory by category at that moment and the remedies ranked by what each would
    save there: under ddp, sharding first (AdamW's state is half of it); under fsdp,
    which already shards, not that."""
    with pytest.raises(nbtrain.WorkerError) as caught:
        nbtrain.launch(out_of_memory, devices=2, accelerator="cpu", strategy=strategy,
                       dashboard=False)
    err = caught.value
    assert err.rank == 1 and err.exc_type == "OutOfMemoryError", err
    assert err.hint.startswith(f"nbtrain: rank 1 ran out of memory on cpu under {strategy}.")
    assert err.hint in str(err)  # shown with the error
    held = dict(re.findall(r"(parameters|gradients|optimizer state) [\d.]+ [KMG]B \((\d+)%\)",
                           err.hint))
    assert set(held) == {"parameters", "gradients", "optimizer state"}, err.hint
    assert 45 <= int(held["optimizer state"]) <= 55, held  # AdamW: two moments per parameter
    remedies = err.hint.split("What would help here, the most first:\n", 1)[1].splitlines()
    if strategy == "ddp":
        assert remedies[0].startswith("  - strategy='fsdp': each of the 2 ranks holds 1/2 "
                                      "of the parameters"), remedies
    else:
        assert not any("strategy='fsdp':" in line for line in remedies), remedies


def test_a_gpu_out_of_memory_ranks_the_remedies_by_what_each_saves(monkeypatch):
    """The CUDA side with fakes for the allocator: 8 GB of model state under ddp on 2
    ranks and 6 GB of activations; sharding saves most, then offload, then recomputing
    activations, a smaller batch, half precision."""
    import types

    from nbtrain import strategies
    from nbtrain.rank import oom

    gb = 1 << 30
    monkeypatch.setattr(oom, "memory_by_category", lambda model, opts, device: {
        "params": 2 * gb, "grads": 2 * gb, "optimizer": 4 * gb})
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 14 * gb)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 14.5 * gb)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=15 * gb))
    ctx = types.SimpleNamespace(rank=1, world_size=2, device=torch.device("cuda", 1),
                                strategy=strategies.get("ddp"), _model=nn.Linear(1, 1),
                                _optimizers=[])
    hint = oom.diagnose(ctx)
    assert "activations and temporaries 6 GB (43%)" in hint, hint
    assert "allocator: 14 GB allocated, peak 14.5 GB, of 15 GB on the device" in hint
    order = [line.split(":")[0].split("=")[0].strip(" -") for line in hint.splitlines()
             if line.startswith("  - ")]
    assert order == ["strategy", "strategy", "activation_checkpointing", "a smaller batch per "
                     "rank (activations grow with it", "mixed_precision"], hint
    assert "strategy='fsdp'" in hint.split("\n  - ")[1] and "about 4 GB less" in hint


def test_a_parameter_named_like_a_launch_option_is_told_it_gets_nothing(no_leftovers):
    """def train(ctx, seed=0): launch(train, seed=42) seeds the ranks; train's own seed
    stays 0. Said, since it looks like the function got it."""
    def train_with_seed(ctx, seed=0, timeout=None):
        return seed, timeout

    with pytest.warns(RuntimeWarning, match=r"seed=42 is launch\(\)'s own option, so "
                                            r"train_with_seed's parameter 'seed' does not "
                                            r"receive it \(train_with_seed keeps its default "
                                            r"0\)"):
        run = nbtrain.launch(train_with_seed, devices=1, accelerator="cpu", seed=42,
                             dashboard=False)
    assert run.result == (0, None) and run.seed == 42
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # nothing passed under those names: nothing said
        assert nbtrain.launch(train_with_seed, devices=1, accelerator="cpu",
                              dashboard=False).result == (0, None)
    assert not [w for w in caught if "own option" in str(w.message)]


def exits(ctx, code):
    if ctx.rank == 1:
        sys.exit(code)
    return ctx.rank


def test_sys_exit_0_is_a_rank_returning_and_another_code_a_failure_that_says_what_to_do():
    assert nbtrain.launch(exits, devices=2, code=0, dashboard=False).results == [0, None]
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(exits, devices=2, code=3, dashboard=False)
    assert info.value.rank == 1
    assert "the function called sys.exit(3)" in str(info.value)
    assert "raising an exception" in str(info.value)
