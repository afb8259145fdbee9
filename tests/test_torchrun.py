"""The same function under torchrun: two agents on localhost act as two nodes (c10d
rendezvous), each process runs ``train(ctx)`` in-process as its rank, and the trained
model matches a 2-rank ``launch()`` from the kernel."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from workloads import ckpt_train, train

import nbtrain

pytestmark = pytest.mark.usefixtures("no_leftovers")

TESTS = pathlib.Path(__file__).resolve().parent
JOB = TESTS / "torchrun_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS),
                                         env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_agents(args: list[str], env: dict[str, str], nodes: int = 2,
               timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``nodes`` torchrun agents on localhost, one process each, meeting by c10d. Agent 0
    hosts the rendezvous store (torchrun would guess: every agent here matches the host)."""
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
         "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         f"--node-rank={n}", f"--rdzv-conf=is_host={int(n == 0)}", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True) for n in range(nodes)]
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while time.monotonic() < deadline:
            codes = [agent.poll() for agent in agents]
            if all(code is not None for code in codes):
                break
            if any(code not in (None, 0) for code in codes):
                # The others now wait in torchrun's exit barrier (300 s): do not.
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > 15:
                    break
            time.sleep(0.1)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return [subprocess.CompletedProcess(a.args, a.returncode, *a.communicate())
            for a in agents]


def check_agents(agents) -> None:
    """Every agent succeeded: a rank that aborts at exit (SIGABRT) or any other failure
    fails the test."""
    codes = [a.returncode for a in agents]
    assert codes == [0, 0], f"agents exited with {codes}: {[a.stderr[-3000:] for a in agents]}"


@pytest.mark.parametrize("strategy", [
    "ddp", "fsdp",
    pytest.param("deepspeed_stage_3", marks=pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="needs nbtrain[deepspeed]")),
])
def test_two_torchrun_nodes_train_what_launch_trains(strategy, tmp_path):
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    agents = run_agents([str(JOB), strategy, str(tmp_path)], job_env())
    check_agents(agents)
    left = (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) - shm
    assert not left, f"the job left files in /dev/shm: {sorted(left)}"
    # rank 0 got the Run, rank 1 None
    assert (tmp_path / "rank0.txt").read_text() == "Run"
    assert (tmp_path / "rank1.txt").read_text() == "NoneType"
    got = torch.load(tmp_path / "run.pt")
    assert got["first"] == [0, 1]  # an earlier launch() in the same script
    assert got["status"] == "done" and got["seed"] == 7
    assert [r["rank"] for r in got["results"]] == [0, 1]
    assert [r["env_rank"] for r in got["results"]] == ["0", "1"]
    assert got["ranks"] == [0, 1]  # every rank's history, gathered to rank 0
    assert got["loss_steps"] == {0: list(range(8)), 1: list(range(8))}
    assert [row["steps"] for row in got["summary"]] == [8, 8]

    local = nbtrain.launch(train, devices=2, accelerator="cpu", strategy=strategy, seed=7,
                           dashboard=False)
    full, expected = got["results"][0]["full"], local.result["full"]
    assert set(full) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{strategy}: {name} differs from launch()")
    assert [r["loss"] for r in got["results"]] == pytest.approx(
        [r["loss"] for r in local.results], rel=1e-5)

    # a checkpoint written by torchrun's ranks, resumed by torchrun's ranks, ends where
    # 8 uninterrupted steps under launch() end
    assert [r["first"] for r in got["resumed"]] == [4, 4]
    assert got["own"] == [(0, 2, 0), (1, 2, 0)]  # one process per node: local rank 0
    whole = nbtrain.launch(ckpt_train, devices=2, accelerator="cpu", strategy=strategy,
                           telemetry=False, dashboard=False)
    for name, value in whole.result["full"].items():
        torch.testing.assert_close(got["resumed"][0]["full"][name], value, rtol=1e-5,
                                   atol=1e-6, msg=f"{strategy}: resumed {name} differs")


def test_nbtrain_run_reads_the_function_and_its_arguments():
    from nbtrain.scaleout import command

    assert command.function_args(["3", "'x'", "lr=3e-4", "name=tiny", "dims=(2, 4)"]) == (
        [3, "x"], {"lr": 3e-4, "name": "tiny", "dims": (2, 4)})
    with pytest.raises(ValueError, match="positional arguments come before"):
        command.function_args(["lr=1", "3"])
    argv = [f"{TESTS / 'workloads.py'}:train", "lr=0.1", "--nproc-per-node", "2", "--nnodes",
            "2", "--rdzv-endpoint", "10.0.0.1:29500", "--attach", "h:1:secret",
            "--max-restarts", "1", "--tee=3", "--log-dir", "logs", "--local-ranks-filter",
            "0", "--master-addr", "head", "--strategy", "fsdp"]
    mine, passed = command.split_argv(argv)
    cmd = command.torchrun_command(mine, passed)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    # torchrun's options reach it unchanged, in order; nbtrain's go to the ranks
    assert cmd[3:cmd.index("-m", 3)] == [
        "--rdzv-backend=c10d", "--rdzv-id=nbtrain", "--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500",
        "--max-restarts", "1", "--tee=3", "--log-dir", "logs", "--local-ranks-filter", "0",
        "--master-addr", "head"]
    assert cmd[cmd.index("nbtrain"):] == ["nbtrain", "_rank", argv[0], "lr=0.1",
                                          "--strategy", "fsdp"]
    assert "secret" not in " ".join(cmd)  # the token goes by environment, not argv
    # nothing given: one process on this node
    alone = command.torchrun_command(*command.split_argv([argv[0]]))
    assert alone[3:5] == ["--nproc-per-node=1", "--standalone"]
    for wrong, message in ((["--module"], "would replace"), (["--frobnicate"], "neither"),
                           (["--max-restarts"], "needs a value")):
        with pytest.raises(SystemExit, match=message):
            command.split_argv([argv[0], *wrong])


@pytest.mark.parametrize("target, message", [
    ("missing.py:train", "no file"), ("workloads.py:nope", "defines no 'nope'"),
    ("workloads.py", "is not FILE.py:FUNCTION")])
def test_nbtrain_run_refuses_a_wrong_target_before_torchrun(target, message):
    done = subprocess.run([sys.executable, "-m", "nbtrain", "run", target], cwd=TESTS,
                          env=job_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr


def one_rank(target: str, *args: str, attach: str, timeout: float = 120,
             wait=None) -> subprocess.CompletedProcess:
    """What torchrun runs for ``nbtrain run``, as a 1-rank job (its environment set by
    hand: no agent, so it starts in a few seconds). ``wait``, given, is called while the
    job runs."""
    env = job_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()), NBTRAIN_ATTACH=attach)
    job = subprocess.Popen([sys.executable, "-m", "nbtrain", "_rank", f"{target}", *args,
                            "--accelerator", "cpu"], cwd=TESTS, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        if wait is not None:
            wait()
        out, err = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def test_a_watched_job_streams_its_run_and_a_failure_arrives_as_worker_error(capsys):
    with nbtrain.listen(dashboard="text") as watch:  # outside a kernel: lines on stderr
        done = one_rank("workloads.py:train", attach=watch.address)
        assert done.returncode == 0, done.stderr[-3000:]
        bad = one_rank("workloads.py:fail_on", "raise", "rank=0", attach=watch.address)
        assert bad.returncode != 0 and "bad batch on purpose" in bad.stderr
        good, failed = watch.wait(2, timeout=30)
    assert good.status == "done" and good.rank_status == {0: "done"}
    assert [s for s, _ in good.history.metric("loss", 0)] == list(range(16))  # 1 rank: all data
    assert good.summary().ranks[0].steps == 16 and good.summary().ranks[0].memory["params"] > 0
    assert str(good.summary()) in done.stdout  # the job's own summary, printed by rank 0
    with pytest.raises(nbtrain.RunStoppedError, match="stay with its job"):
        _ = good.results
    shown = capsys.readouterr().err
    assert "nbtrain is listening on 127.0.0.1:" in shown
    assert "nbtrain ddp ×1: done | step 16" in shown, shown
    assert failed.status == "failed"
    with pytest.raises(nbtrain.WorkerError, match="ValueError: bad batch on purpose"):
        failed.wait()


@pytest.mark.parametrize("address, why", [
    ("no-such-host.invalid:4000:0123", "could not attach to no-such-host.invalid:4000"),
    ("wrong-token", "could not attach to 127.0.0.1:"),
])
def test_a_job_that_cannot_attach_says_so_once_and_trains(address, why):
    with nbtrain.listen(dashboard=False) as watch:
        if address == "wrong-token":
            address = watch.address.rsplit(":", 1)[0] + ":" + "0" * 32
        done = one_rank("workloads.py:train", attach=address)
        assert done.returncode == 0, done.stderr[-3000:]
        assert watch.runs == []
        if "wrong" in why or "127.0.0.1" in why:
            assert watch.refused == 1
    lines = [line for line in done.stderr.splitlines() if "nbtrain: could not attach" in line]
    assert len(lines) == 1 and why in lines[0], done.stderr[-3000:]
    assert "0" * 32 not in done.stderr  # the token is not written to the log
    assert "start=torchrun: done" in done.stdout  # it trained


def test_a_listener_that_goes_away_mid_run_leaves_the_job_training(tmp_path):
    gate = tmp_path / "gate"
    watch = nbtrain.listen(dashboard=False)

    def close_after_first_event():
        deadline = time.monotonic() + 60
        while not (watch.runs and len(watch.runs[0].history)):
            assert time.monotonic() < deadline, "the job never attached"
            time.sleep(0.05)
        watch.close()
        gate.touch()

    done = one_rank("workloads.py:paced", str(gate), attach=watch.address,
                    wait=close_after_first_event)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "start=torchrun: done" in done.stdout
    assert "lost the listener" in done.stderr
    assert watch.runs[0].status == "stopped"  # no longer watched; the job finished anyway


@pytest.mark.kernel
def test_the_notebook_watches_a_two_node_torchrun_job_live(kernel_clean):
    """nbtrain.listen() in a real ipykernel; `nbtrain run --attach` on two c10d agents."""
    kernel = kernel_clean
    listen_cell = kernel.submit("watch = nbtrain.listen()")
    reply = kernel.collect(listen_cell)
    assert reply.error is None, reply.error
    assert any("nbtrain is listening on 127.0.0.1:" in d.get("text/plain", "")
               for d in reply.displays)
    reply = kernel.run(f"""
        import os, signal, socket, subprocess, sys, tempfile
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "nbtrain", "run", "workloads.py:train", "--strategy",
               "fsdp", "--accelerator", "cpu", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-endpoint", f"127.0.0.1:{{port}}", "--attach", watch.address,
               "--max-restarts", "1", "--monitor-interval", "0.5"]  # torchrun's own
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [{str(TESTS.parent)!r}, os.environ.get("PYTHONPATH", "")]))
        logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
        agents = [subprocess.Popen(cmd + ["--rdzv-conf", f"is_host={{int(n == 0)}}"],
                                   stdout=logs[n], stderr=subprocess.STDOUT, text=True,
                                   env=env, start_new_session=True)
                  for n in range(2)]
        try:
            for a in agents:
                a.wait(timeout=150)
        finally:
            for a in agents:
                if a.poll() is None:
                    os.killpg(a.pid, signal.SIGKILL)
                    a.wait()
            outs = []
            for log in logs:
                log.seek(0)
                outs.append(log.read())
                log.close()
        run, = watch.wait(1, timeout=60)
        """, timeout=300)
    assert reply.error is None, (reply.error["evalue"], kernel.value("[o[-3000:] for o in outs]"))
    assert kernel.value("[a.returncode for a in agents]") == [0, 0], kernel.value(
        "[o[-3000:] for o in outs]")
    assert kernel.value("(run.status, run.rank_status, run.start_method, run.world_size)") == (
        "done", {0: "done", 1: "done"}, "torchrun", 2)
    assert kernel.value("{r: [s for s, _ in run.history.metric('loss', r)] for r in (0, 1)}") \
        == {0: list(range(8)), 1: list(range(8))}
    steps, times, params = kernel.value(
        "[s.steps for s in run.summary().ranks], "
        "[s.step_time is not None for s in run.summary().ranks], "
        "[s.memory.get('params', 0) > 0 for s in run.summary().ranks]")
    assert steps == [8, 8] and times == [True, True] and params == [True, True]
    # the job's own summary (printed by rank 0, on whichever agent it ran) is the same
    assert kernel.value("any(str(run.summary()) in out for out in outs)") is True
    # the run's view showed in the cell that called listen(), not in the one running
    shown = kernel.late_displays.get(listen_cell, [])
    assert any("train" in str(d) and "fsdp" in str(d) for d in shown), shown
    kernel.run("watch.close()")


@pytest.mark.parametrize("runner", ["nbtrain run", "torchrun"])
def test_a_torchrun_restart_goes_on_from_checkpoint_every(runner, tmp_path):
    """`--max-restarts 1`: torchrun's agent starts both ranks again after rank 1's SIGKILL
    at step 20; ctx.checkpoint_every finds its own last checkpoint (the agent knows none)
    and the job ends with an uninterrupted run's weights. Through `nbtrain run`, and
    through torchrun itself running a script that calls launch() (its agent's store then
    serves every attempt: the ranks meet under a prefix of their attempt's)."""
    script = tmp_path / "job.py"
    script.write_text("import sys, nbtrain\nfrom workloads import every_train\n"
                      "kw = eval(sys.argv[1])\n"
                      "nbtrain.launch(every_train, accelerator='cpu', seed=1, **kw)\n")

    def job(name: str, **extra) -> dict:
        out = tmp_path / f"{name}.pt"
        kw = dict(path=str(tmp_path / name), out=str(out), **extra)
        restarts = ["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval",
                    "0.2"]
        if runner == "nbtrain run":
            cmd = [sys.executable, "-m", "nbtrain", "run",
                   f"{TESTS / 'workloads.py'}:every_train",
                   *[f"{k}={v!r}" for k, v in kw.items()], "--accelerator", "cpu",
                   "--seed", "1", *restarts]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *restarts,
                   str(script), repr(kw)]
        done = subprocess.run(cmd, env=job_env(), capture_output=True, text=True,
                              timeout=240, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(out)

    whole = job("whole")
    restarted = job("restarted", die_at=20)
    assert restarted["first"] == 18 and whole["first"] == 0
    for name, value in whole["full"].items():
        torch.testing.assert_close(restarted["full"][name], value, rtol=1e-5, atol=1e-6)


def test_killing_nbtrain_run_leaves_no_rank(tmp_path):
    """A notebook that SIGKILLs the `nbtrain run` it started (a subprocess's timeout)
    kills torchrun's agent itself (`nbtrain run` becomes the agent: no middle process),
    and the ranks, each in a session of its own, end when their agent is gone instead of
    waiting in the job forever, as the OOM killer taking the agent would leave them."""
    import psutil

    command = subprocess.Popen(
        [sys.executable, "-m", "nbtrain", "run", f"{TESTS / 'workloads.py'}:wait_forever",
         f"folder={str(tmp_path)!r}", "--accelerator", "cpu", "--nproc-per-node", "2"],
        env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("rank*.pid"))) < 2:
        assert command.poll() is None and time.monotonic() < deadline, command.stderr.read()
        time.sleep(0.1)
    ranks = [psutil.Process(int(p.read_text())) for p in tmp_path.glob("rank*.pid")]
    agent = psutil.Process(command.pid)
    assert "torch.distributed.run" in " ".join(agent.cmdline())  # no middle process
    assert all(r.ppid() == command.pid for r in ranks)
    agent.kill()
    command.wait(10)
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"ranks left after their agent died: {[r.pid for r in alive]}"
    said = command.stderr.read()  # the ranks wrote to the stderr they inherited
    assert said.count(f"torchrun's agent (pid {command.pid}) is gone") == 2, said[-2000:]
