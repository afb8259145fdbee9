"""The same function under torchrun: two agents on localhost act as two nodes (c10d
rendezvous), each process runs ``train(ctx)`` in-process as its rank, and the trained
model matches a 2-rank ``launch()`` from the kernel."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest
import torch
from workloads import train

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
    """``nodes`` torchrun agents on localhost, one process each, meeting by c10d."""
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
         "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         f"--node-rank={n}", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True) for n in range(nodes)]
    done = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return done


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_torchrun_nodes_train_what_launch_trains(strategy, tmp_path):
    agents = run_agents([str(JOB), strategy, str(tmp_path)], job_env())
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-3000:]
    # rank 0 got the Run, rank 1 None
    assert (tmp_path / "rank0.txt").read_text() == "Run"
    assert (tmp_path / "rank1.txt").read_text() == "NoneType"
    got = torch.load(tmp_path / "run.pt")
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


def test_nbtrain_run_reads_the_function_and_its_arguments():
    from nbtrain.launch import command

    assert command.function_args(["3", "'x'", "lr=3e-4", "name=tiny", "dims=(2, 4)"]) == (
        [3, "x"], {"lr": 3e-4, "name": "tiny", "dims": (2, 4)})
    with pytest.raises(ValueError, match="positional arguments come before"):
        command.function_args(["lr=1", "3"])
    argv = [f"{TESTS / 'workloads.py'}:train", "lr=0.1", "--nproc-per-node", "2", "--nnodes",
            "2", "--rdzv-endpoint", "10.0.0.1:29500", "--attach", "h:1:secret"]
    cmd = command.torchrun_command(command.parser().parse_intermixed_args(argv), argv)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--rdzv-endpoint=10.0.0.1:29500" in cmd and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("nbtrain"):] == ["nbtrain", "_rank", argv[0], "lr=0.1",
                                          "--nproc-per-node", "2", "--nnodes", "2",
                                          "--rdzv-endpoint", "10.0.0.1:29500"]
    assert "secret" not in " ".join(cmd)  # the token goes by environment, not argv


@pytest.mark.parametrize("target, message", [
    ("missing.py:train", "no file"), ("workloads.py:nope", "defines no 'nope'"),
    ("workloads.py", "is not FILE.py:FUNCTION")])
def test_nbtrain_run_refuses_a_wrong_target_before_torchrun(target, message):
    done = subprocess.run([sys.executable, "-m", "nbtrain", "run", target], cwd=TESTS,
                          env=job_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr
