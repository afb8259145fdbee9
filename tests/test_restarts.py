"""launch(max_restarts=N): a rank that dies does not end the training. The same Run goes
on from the last checkpoint ctx.save completed, on the same devices; a user's exception
is not retried; nothing is left behind."""

from __future__ import annotations

import pytest
import torch
from workloads import ckpt_train, every_train, fail_on

import nbtrain
from nbtrain.strategies import deepspeed
from nbtrain.telemetry.events import Restart

pytestmark = pytest.mark.usefixtures("no_leftovers")

STEPS = 16
KW = dict(steps=STEPS, save_every=4, devices=2, accelerator="cpu", dashboard=False)
# DeepSpeed comes with the extra (the hosted-stack legs run without it)
STRATEGIES = ["ddp", "fsdp", *(["deepspeed_stage_2"] if deepspeed.available() else [])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return {s: nbtrain.launch(ckpt_train, path=str(tmp_path_factory.mktemp(s) / "ck"),
                              strategy=s, **KW) for s in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_trains_the_same(
        strategy, uninterrupted, tmp_path):
    """Rank 1 SIGKILLed at step 10 of 16 (as the OOM killer would): the run starts
    again from the checkpoint of step 7 and ends with an uninterrupted run's weights."""
    path = str(tmp_path / "ck")
    run = nbtrain.launch(ckpt_train, path=path, strategy=strategy, die_at=10,
                         max_restarts=2, **KW)
    assert run.status == "done"
    [attempt] = run.attempts
    assert attempt.cause.startswith("rank 1 was killed by SIGKILL")
    assert attempt.resume == path and attempt.step is not None and attempt.step >= 7
    assert run.results[0]["first"] == 8  # the step after the checkpoint of step 7
    want = uninterrupted[strategy].results[0]["full"]
    for name, value in want.items():
        torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{strategy}: {name} differs after the restart")
    # one Run: the history goes on, with the restart in it, and the summary says so
    [restart] = run.history.events("restart")
    assert isinstance(restart, Restart) and restart.attempt == 1 and "SIGKILL" in restart.cause
    steps = [s for s, _ in run.history.metric("loss", 0)]
    assert steps[-1] == STEPS - 1 and sorted(set(steps)) == list(range(STEPS))
    events = run.history.events()
    after = [e.step for e in events[events.index(restart):] if e.kind == "metric"]
    assert after[0] == 8  # the second attempt's first step: the one after the checkpoint
    assert "restarted 1 time" in str(run.summary())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_hung_on_the_default_group_is_ended_at_collective_timeout_and_restarted(
        strategy, tmp_path):
    """Rank 1 stops answering at step 20: rank 0's next collective on the run's own
    process group (DDP's all-reduce, FSDP's all-gather) times out after
    ``collective_timeout`` (3 s here; 600 s by default), the attempt ends and the next
    one goes on from checkpoint_every's save of step 18 to an uninterrupted run's
    weights. Each rank draws from a generator seeded its own way (and dropout)."""
    kw = dict(strategy=strategy, own_seeds=True, devices=2, accelerator="cpu",
              dashboard=False)
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), **kw)
    path = str(tmp_path / "b")
    run = nbtrain.launch(every_train, path, die_at=20, die_by="hang", max_restarts=1,
                         collective_timeout=3, timeout=300, **kw)
    assert run.status == "done", run.error
    [attempt] = run.attempts
    # ended by the group's own timeout, the 3 s given (gloo names it), not the 600 s default
    assert attempt.cause.startswith("rank 0") and "Timed out waiting 3000ms" in attempt.cause, \
        attempt.cause
    assert attempt.resume == path and run.results[0]["first"] == 18
    _same_weights(run, whole, strategy)


def test_collective_timeout_is_checked_and_a_pool_says_where_it_is_set():
    with pytest.raises(ValueError, match="collective_timeout=0 must be a positive"):
        nbtrain.launch(ckpt_train, collective_timeout=0, **KW)
    with nbtrain.RankPool(devices=2, accelerator="cpu") as pool, \
            pytest.raises(ValueError, match=r"RankPool\(timeout=...\)"):
        pool.launch(ckpt_train, collective_timeout=5)


@pytest.fixture(scope="module")
def every_uninterrupted(tmp_path_factory):
    return {s: nbtrain.launch(every_train, str(tmp_path_factory.mktemp(s) / "ck"),
                              strategy=s, devices=2, accelerator="cpu", dashboard=False)
            for s in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_every_resumes_the_step_the_data_and_the_random_streams(
        strategy, every_uninterrupted, tmp_path):
    """ctx.checkpoint_every(6) with a shuffled ctx.dataloader over 3 epochs (48 steps)
    and noise drawn every step; rank 1 SIGKILLed at step 20. The restart goes on from
    step 18 (epoch 1, batch 2, each rank's generators as they were), and every loss after
    it and the final weights are the uninterrupted run's."""
    path = str(tmp_path / "ck")
    run = nbtrain.launch(every_train, path, strategy=strategy, die_at=20, max_restarts=1,
                         devices=2, accelerator="cpu", dashboard=False)
    [attempt] = run.attempts
    assert "SIGKILL" in attempt.cause and attempt.resume == path
    assert run.results[0]["first"] == 18 and run.results[0]["note"] == "fresh"
    whole = every_uninterrupted[strategy]
    for rank in (0, 1):
        want = dict(whole.history.metric("loss", rank))
        got = dict(run.history.metric("loss", rank))
        assert sorted(got) == list(range(48))
        assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in range(18, 48)), \
            f"{strategy}: rank {rank}'s losses after the restart differ"
    for name, value in whole.results[0]["full"].items():
        torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{strategy}: {name} differs after the restart")


def test_once_an_epoch_code_runs_once_for_each_epoch_across_a_restart(tmp_path):
    """``for epoch in loader.epochs(3)`` with an LR scheduler stepped at each epoch's end
    and saved by checkpoint_every: rank 1 SIGKILLed at step 20 (epoch 1); the restart
    loops over epochs 1 and 2 only, so the scheduler steps three times in all, and the
    weights are the uninterrupted run's (a loop over range(3) would step it five)."""
    kw = dict(per_epoch=True, devices=2, accelerator="cpu", dashboard=False)
    whole = nbtrain.launch(every_train, str(tmp_path / "whole"), **kw)
    run = nbtrain.launch(every_train, str(tmp_path / "ck"), die_at=20, max_restarts=1, **kw)
    assert whole.results[0]["ends"] == [0, 1, 2] and run.results[0]["ends"] == [1, 2]
    assert run.results[0]["first"] == 18
    assert run.results[0]["lr"] == whole.results[0]["lr"] == 1e-2 * 0.5 ** 3
    for name, value in whole.results[0]["full"].items():
        torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{name} differs after the restart")


def test_what_a_killed_rank_logged_before_its_checkpoint_reaches_the_kernel(
        monkeypatch, tmp_path):
    """Every rank puts its telemetry on the wire when a checkpoint is written: rank 1,
    SIGKILLed at step 20 with a sender that would not have sent for half a minute, still
    delivered every loss and step time up to the checkpoint of step 18; the restart
    replays the rest.
    (CI once lost two steps this way, a sender's 50 ms tick behind.)"""
    from nbtrain.telemetry.client import TelemetryClient

    init = TelemetryClient.__init__

    def slow(self, *args, **kwargs):  # the ranks fork from here and keep it
        kwargs["flush_interval"] = 30.0
        init(self, *args, **kwargs)

    monkeypatch.setattr(TelemetryClient, "__init__", slow)
    run = nbtrain.launch(every_train, str(tmp_path / "ck"), strategy="ddp", die_at=20,
                         max_restarts=1, devices=2, accelerator="cpu", dashboard=False,
                         start_method="fork")
    assert run.results[0]["first"] == 18
    for rank in (0, 1):
        assert sorted(dict(run.history.metric("loss", rank))) == list(range(48)), rank
        # every step's time too, the step the checkpoint ended included (steps 18 and 19
        # twice: the restart replays them)
        assert {e.step for e in run.history.events("step", rank)} == set(range(48)), rank


def _same_weights(got, want, what):
    for name, value in want.results[0]["full"].items():
        torch.testing.assert_close(got.results[0]["full"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{what}: {name} differs after the restart")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_save_of_the_users_own_is_never_the_restarts_point(strategy, tmp_path):
    """Beside checkpoint_every(6), the function saves the model alone every 4 steps
    (an export, a best model: ctx.save without resume=True); rank 1 dies at step 20,
    just after such a save (step 19). The restart goes on from checkpoint_every's save
    of step 18, never from the model-only one (which once failed the restart, or would
    have trained again from step 0), and ends with the uninterrupted run's weights.
    Each rank draws from a generator seeded its own way (and dropout)."""
    kw = dict(strategy=strategy, own_seeds=True, devices=2, accelerator="cpu",
              dashboard=False)
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), snapshot=str(tmp_path / "s1"),
                           **kw)
    path, snapshot = str(tmp_path / "b"), str(tmp_path / "s2")
    run = nbtrain.launch(every_train, path, snapshot=snapshot, die_at=20, max_restarts=1,
                         **kw)
    [attempt] = run.attempts
    assert attempt.resume == path and run.results[0]["first"] == 18
    events = run.history.events()
    before = [e for e in events[:events.index(run.history.events("restart")[0])]
              if e.kind == "checkpoint"]
    assert before[-1].path == snapshot and not before[-1].resumes  # the newest: passed over
    _same_weights(run, whole, strategy)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_with_telemetry_off_a_restart_still_goes_on_from_its_checkpoint(strategy, tmp_path):
    """telemetry=False: no metrics, steps or memory reach the kernel, but the reports
    of checkpoint_every's saves do, so the restart goes on from step 18, not step 0."""
    kw = dict(strategy=strategy, own_seeds=True, devices=2, accelerator="cpu",
              dashboard=False, telemetry=False)
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), **kw)
    path = str(tmp_path / "b")
    run = nbtrain.launch(every_train, path, die_at=20, max_restarts=1, **kw)
    [attempt] = run.attempts
    assert attempt.resume == path and run.results[0]["first"] == 18
    kinds = {e.kind for e in run.history.events()}  # (a rank's printed lines are "output")
    assert "checkpoint" in kinds and not kinds & {"metric", "step", "memory", "comm",
                                                  "lifecycle"}, kinds
    _same_weights(run, whole, f"{strategy}, telemetry off")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gradient_accumulation_resumes_in_phase(strategy, tmp_path):
    """ctx.accumulate(model, 4) with checkpoint_every(6): a save falls due at step 18,
    between two micro-batches of one optimizer step, and is written at step 20, right
    after the optimizer step; rank 1 dies at step 22. The restart goes on from step 20
    with no gradient lost and its micro-steps in phase: the uninterrupted run's weights
    (ranks seeded their own ways, dropout, a shuffled loader over 3 epochs)."""
    kw = dict(strategy=strategy, accumulate=4, own_seeds=True, devices=2,
              accelerator="cpu", dashboard=False)
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), **kw)
    path = str(tmp_path / "b")
    run = nbtrain.launch(every_train, path, die_at=22, max_restarts=1, **kw)
    assert run.attempts[0].resume == path and run.results[0]["first"] == 20
    saved = [e.step for e in run.history.events("checkpoint")]
    assert all((step + 1) % 4 == 0 for step in saved), saved  # after optimizer steps
    _same_weights(run, whole, strategy)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp16_loss_scaling_goes_on_with_its_scale(strategy, tmp_path):
    """fp16 on CPU ranks: the scaler skips the steps whose scaled gradients overflow and
    halves its scale. checkpoint_every keeps the scale and the count, so the restart
    skips the uninterrupted run's steps, no others, and ends with its weights."""
    from nbtrain import strategies

    chosen = strategies.get(strategy, mixed_precision="fp16")
    kw = dict(strategy=chosen, own_seeds=True, devices=2, accelerator="cpu",
              dashboard=False)
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), **kw)
    run = nbtrain.launch(every_train, str(tmp_path / "b"), die_at=20, max_restarts=1, **kw)
    assert run.results[0]["first"] == 18
    # the steps the uninterrupted run skipped (0 and 40), counted on from the restart
    assert run.history.metric("skipped_steps", 0) == whole.history.metric("skipped_steps", 0)
    _same_weights(run, whole, f"{strategy} fp16")


def test_a_crash_in_native_code_is_not_retried():
    """A SIGSEGV is the rank's own code faulting: a restart would replay the same steps
    and crash again, so the run fails at once with the rank's stack."""
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(fail_on, "segfault", devices=2, accelerator="cpu", dashboard=False,
                       max_restarts=2)
    assert info.value.exc_type == "SIGSEGV" and "restarted" not in str(info.value)
    assert nbtrain.last_run().attempts == []


def test_timeout_bounds_the_whole_run_restarts_included(tmp_path):
    """Each attempt dies at its step 3, after 1.5 s of steps, and there are restarts for
    ten more: timeout=6 ends the run after about 6 s, not 6 s per attempt."""
    import time

    began = time.monotonic()
    with pytest.raises((nbtrain.RunTimeoutError, nbtrain.WorkerError)):
        nbtrain.launch(ckpt_train, die_at=3, die_by="SIGKILL", max_restarts=10, timeout=6,
                       **{**KW, "save_every": 0, "sleep": 0.5})
    run = nbtrain.last_run()
    assert time.monotonic() - began < 6 + 15  # the deadline, then teardown's generous bound
    assert len(run.attempts) < 10


def test_the_collective_timeout_leaves_the_restarts_their_time():
    from nbtrain.restarts import collective_timeout

    assert collective_timeout(None, 0) == collective_timeout(None, 3) == 600
    assert collective_timeout(100, 0) == 100 and collective_timeout(20, 0) == 60
    assert collective_timeout(900, 2) == 300  # a third of the run for each attempt
    assert collective_timeout(100, 2) == 60 and collective_timeout(7200, 1) == 600


def test_the_restart_rule_reads_how_a_rank_failed_not_its_names():
    """Each way a rank ends is typed where the kernel saw it (``outcome.Ending``); the rule
    reads that, never an exception's type name or a message."""
    from types import SimpleNamespace

    from nbtrain.launch.following.failures import Failure, exit_failure, reported_failure
    from nbtrain.outcome import Ending, Teardown
    from nbtrain.restarts import retry_cause
    from nbtrain.wire import RankFailure

    def reported(kind, message, interrupted=False):
        return reported_failure(1, RankFailure(1, kind, "builtins", message, "", ""),
                                interrupted).ending

    assert exit_failure(1, -9).ending is Ending.KILLED
    assert exit_failure(1, -15).ending is Ending.KILLED
    assert exit_failure(1, -11).ending is Ending.CRASHED
    assert exit_failure(1, 3).ending is Ending.EXITED
    assert reported("ValueError", "bad value") is Ending.RAISED
    assert reported("RuntimeError", "[../gloo/transport] Connection closed by peer") \
        is Ending.COMMUNICATION
    assert reported("RuntimeError", "Detected mismatch between collectives on ranks") \
        is Ending.MISMATCH
    assert reported("KeyboardInterrupt", "", interrupted=True) is Ending.INTERRUPTED

    def outcome(failure, teardown=None):
        return SimpleNamespace(crash=None, teardown_cause=teardown,
                               root_failure=lambda: failure)

    def failure(kind, ending):
        return Failure(1, kind, f"rank 1 ended ({kind})", "", 0.0, ending=ending)

    retried = {e for e in Ending if retry_cause(outcome(failure("SIGKILL", e)))}
    assert retried == {Ending.KILLED, Ending.EXITED, Ending.NEVER_JOINED,
                       Ending.COMMUNICATION, Ending.INTERRUPTED}
    assert retry_cause(outcome(failure("X", Ending.KILLED))) == "rank 1 ended (X)"
    for teardown in (Teardown.STOP, Teardown.TIMEOUT, Teardown.REMOTE):
        assert retry_cause(outcome(failure("SIGKILL", Ending.KILLED), teardown)) is None
    assert retry_cause(outcome(failure("SIGKILL", Ending.KILLED), Teardown.FAILURE))


def test_checkpoint_every_in_a_loop_without_a_loader(tmp_path):
    """A hand-written loop (``ctx.step = step`` at the top of each step, batches drawn
    from the generator): saved every 6 steps, resumed from 18 exactly."""
    kw = dict(hand=True, devices=2, accelerator="cpu", dashboard=False)
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), **kw)
    run = nbtrain.launch(every_train, str(tmp_path / "b"), die_at=20, max_restarts=1, **kw)
    assert run.results[0]["first"] == 18
    for name, value in whole.results[0]["full"].items():
        torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5, atol=1e-6)


def test_a_rank_that_exits_without_returning_is_restarted(tmp_path):
    run = nbtrain.launch(ckpt_train, path=str(tmp_path / "ck"), die_at=6, die_by="exit",
                         max_restarts=1, **KW)
    assert run.status == "done" and len(run.attempts) == 1
    assert "exited with code 0 before returning" in run.attempts[0].cause


def test_the_users_own_exception_is_not_retried(tmp_path):
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(ckpt_train, path=str(tmp_path / "ck"), die_at=6, die_by="raise",
                       max_restarts=3, **KW)
    err = info.value
    assert (err.rank, err.exc_type) == (1, "ValueError")
    assert "the user's own error at step 6" in err.message
    assert "restarted" not in str(err)
    assert nbtrain.last_run().attempts == []


def test_when_restarts_run_out_the_error_names_every_attempt(tmp_path):
    """Without checkpoints every attempt starts from step 0 and dies again."""
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(ckpt_train, die_at=3, die_by="SIGKILL", max_restarts=1,
                       **{**KW, "save_every": 0})
    text = str(info.value)
    assert info.value.exc_type == "SIGKILL"
    assert "The run was restarted 1 time" in text
    # ("at step N" only when a rank's events reached the kernel before the kill: timing)
    assert "attempt 1 ended" in text and "restarted from the start" in text
    assert len(nbtrain.last_run().attempts) == 1


def test_max_restarts_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match="max_restarts=-1"):
        nbtrain.launch(ckpt_train, max_restarts=-1, devices=2, accelerator="cpu")
    with pytest.raises(ValueError, match="max_restarts"):
        nbtrain.launch(ckpt_train, max_restarts=True, devices=2, accelerator="cpu")


@pytest.mark.kernel
def test_in_a_kernel_the_dashboard_marks_the_restart_and_nothing_is_left(kernel_clean,
                                                                          tmp_path):
    """The issue's case in a real kernel: rank 1 SIGKILLed at step 20 of 48 (a shuffled
    loader, ctx.checkpoint_every(5)), two restarts allowed; the run ends done with the
    uninterrupted weights, its figure marks one restart with its cause, and no process
    stays (kernel_clean checks); then the same under fsdp and a DeepSpeed stage. The
    first run also accumulates gradients over 2 batches, saves a model-only snapshot
    every 4 steps (the newest save when rank 1 dies) and seeds each rank its own way."""
    k = kernel_clean
    reply = k.run(f"""
        import nbtrain, torch
        from workloads import every_train
        kw = dict(every=5, devices=2, strategy="ddp")
        edges = dict(accumulate=2, own_seeds=True, snapshot={str(tmp_path / 'snap')!r})
        run = nbtrain.launch(every_train, {str(tmp_path / 'a')!r}, die_at=20,
                             max_restarts=2, **kw, **edges)
        ref = nbtrain.launch(every_train, {str(tmp_path / 'b')!r}, dashboard=False, **kw,
                             **edges)
        print("status", run.status, len(run.attempts), run.attempts[0].step)
        print("same", all(torch.equal(run.results[0]["full"][n], v)
                          for n, v in ref.results[0]["full"].items()))
        from nbtrain.ui.figures import build_figure
        from nbtrain.ui.state import LiveState
        fig = build_figure(LiveState.from_run(run))  # what the view ends with, and the report
        print("marks", [t.hovertemplate for t in fig.data if t.name == "restart 1"])
        for strategy in {STRATEGIES[1:]!r}:  # the sharded ones, without the dashboard
            kw.update(strategy=strategy, dashboard=False)
            run = nbtrain.launch(every_train, {str(tmp_path / 'c')!r} + strategy,
                                 die_at=20, max_restarts=2, **kw)
            ref = nbtrain.launch(every_train, {str(tmp_path / 'd')!r} + strategy, **kw)
            print(strategy, len(run.attempts), all(
                torch.allclose(run.results[0]["full"][n], v, rtol=1e-5, atol=1e-6)
                for n, v in ref.results[0]["full"].items()))
        """, timeout=300)
    assert reply.error is None, reply.error
    assert "status done 1" in reply.stdout and "same True" in reply.stdout, reply.stdout
    step = int(reply.stdout.split("status done 1 ")[1].split()[0])
    # the last step a rank reported before the kill: rank 0 goes on through step 20, a
    # micro-step without a collective (accumulating over 2), to step 21's all-reduce
    assert 19 <= step <= 21
    assert "attempt 1 ended at step" in reply.stderr and "SIGKILL" in reply.stderr
    marks = reply.stdout.split("marks ")[1]
    assert "restart 1 after step" in marks and "SIGKILL" in marks, marks
    for strategy in STRATEGIES[1:]:
        assert f"{strategy} 1 True" in reply.stdout, reply.stdout


@pytest.mark.kernel
def test_in_a_kernel_from_the_fork_server_exits_restart_and_exceptions_do_not(kernel_clean,
                                                                             tmp_path):
    """From the fork server, in a real kernel: a rank that exits 0 without returning is
    restarted; the user's own exception is raised at once, not retried; the server
    survives both and serves the next launch (kernel_clean: nothing else is left)."""
    reply = kernel_clean.run(f"""
        import nbtrain
        from nbtrain.launch.starting import forkserver
        from workloads import ckpt_train
        kw = dict(steps=12, save_every=4, devices=2, dashboard=False,
                  start_method="forkserver")
        run = nbtrain.launch(ckpt_train, path={str(tmp_path / 'a')!r}, die_at=6,
                             die_by="exit", max_restarts=1, **kw)
        server = forkserver.running_pid()
        print("exit:", run.status, len(run.attempts), "before returning" in
              run.attempts[0].cause)
        try:
            nbtrain.launch(ckpt_train, path={str(tmp_path / 'b')!r}, die_at=6,
                           die_by="raise", max_restarts=3, **kw)
        except nbtrain.WorkerError as err:
            print("raised:", err.exc_type, err.rank, len(nbtrain.last_run().attempts))
        again = nbtrain.launch(ckpt_train, path={str(tmp_path / 'c')!r}, **kw)
        print("server:", server is not None and forkserver.running_pid() == server,
              again.status)
        """, timeout=180)
    assert reply.error is None, reply.error
    out = reply.stdout
    assert "exit: done 1 True" in out and "raised: ValueError 1 0" in out, out
    assert "server: True done" in out, out


@pytest.mark.kernel
def test_in_a_kernel_a_rank_hung_in_a_collective_is_restarted(kernel_clean, tmp_path):
    """Rank 1 stops answering; rank 0's all-reduce times out (a group with a 3 s
    timeout): every rank of the attempt is ended and the next one finishes."""
    reply = kernel_clean.run(f"""
        import nbtrain
        from workloads import hang_once
        run = nbtrain.launch(hang_once, {str(tmp_path / 'hung')!r}, devices=2,
                             max_restarts=1, dashboard=False)
        print("status", run.status, run.results, run.attempts[0].cause)
        """, timeout=120)
    assert reply.error is None, reply.error
    assert "status done [2.0, 2.0] rank 0:" in reply.stdout, reply.stdout
    assert "Timed out" in reply.stdout


def test_a_pool_run_restarts_on_new_workers(uninterrupted, tmp_path):
    """pool.launch(max_restarts=...): the dead rank's workers are replaced (the pool heals)
    and the run goes on from its checkpoint, on the same pool."""
    with nbtrain.RankPool(devices=2, accelerator="cpu") as pool:
        kw = {k: v for k, v in KW.items() if k not in ("devices", "accelerator")}
        run = pool.launch(ckpt_train, path=str(tmp_path / "ck"), die_at=10, max_restarts=1,
                          **kw)
        assert run.status == "done" and len(run.attempts) == 1 and pool.started == 2
        for name, value in uninterrupted["ddp"].results[0]["full"].items():
            torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5,
                                       atol=1e-6)
        assert pool.run("rank") == {0: "0", 1: "1"}  # and the pool goes on


def test_the_picker_passes_max_restarts_on(tmp_path):
    picker = nbtrain.StrategyPicker(ckpt_train, devices=2, accelerator="cpu", display=False,
                                    path=str(tmp_path / "ck"), steps=STEPS, save_every=4,
                                    die_at=10, max_restarts=1)
    run = picker.start("ddp")
    run.wait(120)
    assert run.status == "done" and len(run.attempts) == 1
