"""SLURM: the environments ``launch()`` reads (unit tests, always), and the real thing on
a one-node cluster (``.ci/slurm-up`` starts one; CI does): ``srun -n 2`` runs the same
function as ``launch(devices=2)`` and trains the same weights, and ``nbtrain.submit``
from a real kernel is watched live, returns its results, names a failing rank and
cancels with ``.stop()``, leaving no job and no process."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import psutil
import pytest
import torch
from workloads import train

import nbtrain
from nbtrain.scaleout import clusters

TESTS = pathlib.Path(__file__).resolve().parent
JOB = TESTS / "torchrun_job.py"


# -- what launch() reads (no cluster needed) -------------------------------------------
def test_a_slurm_hostlist_names_its_first_host():
    assert clusters.first_host("vm") == "vm"
    assert clusters.first_host("gpu[03-05,09],cpu1") == "gpu03"
    assert clusters.first_host("cpu1,gpu[03-05]") == "cpu1"
    assert clusters.first_host("node[7]-ib") == "node7-ib"
    assert clusters.first_host("rack[1-2]-node[01-04]") == "rack1-node01"
    assert clusters.tasks_on_node("4(x2),3", 0) == 4
    assert clusters.tasks_on_node("4(x2),3", 2) == 3
    with pytest.raises(ValueError, match="tasks per node"):
        clusters.tasks_on_node("four", 0)


# SLURM's hostlist grammar, with what `scontrol show hostnames` prints for each
HOSTLISTS = {
    "vm": ["vm"],
    "gpu[03-05,09],cpu1": ["gpu03", "gpu04", "gpu05", "gpu09", "cpu1"],
    "rack[1-2]-node[01-02]": ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
    "n[8-11]": ["n8", "n9", "n10", "n11"],
    "n[08-11]": ["n08", "n09", "n10", "n11"],
    "a[1,3],b,c[007]": ["a1", "a3", "b", "c007"],
    "n[1-2],m[3]": ["n1", "n2", "m3"],
}


def scontrol_hostnames(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames`` where SLURM is installed and configured (the one-node
    cluster CI starts), else None."""
    if not shutil.which("scontrol"):
        return None
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                          text=True, timeout=30)
    if "configuration" in done.stderr:  # installed, not configured
        return None
    assert done.returncode == 0, done.stderr  # a case SLURM would not write
    return done.stdout.split()


@pytest.mark.parametrize("nodelist", HOSTLISTS)
def test_a_slurm_hostlist_expands_as_slurm_expands_it(nodelist):
    assert list(clusters.expand_hostlist(nodelist)) == HOSTLISTS[nodelist]
    slurm = scontrol_hostnames(nodelist)
    assert slurm is None or slurm == HOSTLISTS[nodelist]


@pytest.mark.parametrize("bad", ["n[1-", "n[a-b]", "n]1["])
def test_a_hostlist_slurm_would_not_write_is_refused(bad):
    with pytest.raises(ValueError, match="node list"):
        list(clusters.expand_hostlist(bad))


SRUN_STEP = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
             "SLURM_STEP_NODELIST": "gpu[12-13]", "SLURM_JOB_ID": "4242"}


def test_an_srun_step_is_read_as_torchrun_would_set_it():
    name, env = clusters.detect(SRUN_STEP)
    assert name == "slurm"
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu12"}
    other_job = clusters.detect({**SRUN_STEP, "SLURM_JOB_ID": "4243"})[1]
    assert env["MASTER_PORT"] != other_job["MASTER_PORT"]  # two jobs on one node
    assert 15000 <= int(env["MASTER_PORT"]) < 51000
    given = {**SRUN_STEP, "MASTER_PORT": "29500"}
    assert clusters.adopt(given) == "slurm" and given["MASTER_PORT"] == "29500"  # kept
    assert given["RANK"] == "5"


@pytest.mark.parametrize("env", [
    {k: v for k, v in SRUN_STEP.items() if k != "SLURM_STEP_ID"},  # the sbatch script
    {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"},  # a notebook's step
    {**SRUN_STEP, "NBTRAIN_WORKER": "1"},  # nbtrain's own worker on a SLURM node
    {},
])
def test_what_is_not_a_rank_starts_workers_as_anywhere(env):
    assert clusters.detect(env) is None
    assert clusters.adopt(env) is None and "RANK" not in env


def test_lsf_and_kubeflow_are_read_too(tmp_path):
    rankfile = tmp_path / "ranks"
    rankfile.write_text("batch1\ncompute7\ncompute7\ncompute8\n")
    name, env = clusters.detect({"JSM_NAMESPACE_RANK": "2", "JSM_NAMESPACE_SIZE": "3",
                                 "JSM_NAMESPACE_LOCAL_RANK": "0", "LSB_JOBID": "77",
                                 "LSB_DJOB_RANKFILE": str(rankfile)})
    assert name == "lsf" and (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == (
        "2", "3", "compute7")
    name, env = clusters.detect({"KUBERNETES_PORT": "tcp://10.0.0.1:443", "RANK": "1",
                                 "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0",
                                 "MASTER_PORT": "23456"})
    assert name == "kubeflow" and (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1")


def test_submit_checks_its_arguments_before_anything_is_submitted():
    pytest.importorskip("submitit")
    with pytest.raises(ValueError, match="devices=0: give a positive number of ranks"):
        nbtrain.submit(train, devices=0)
    with pytest.raises(ValueError, match="give nodes= and devices="):
        nbtrain.submit(train, slurm={"ntasks-per-node": 4})
    with pytest.raises(ValueError, match="slurm time='two hours'"):
        nbtrain.submit(train, slurm={"time": "two hours"})
    with pytest.raises(TypeError, match="takes no argument 'lr2'"):
        nbtrain.submit(train, lr2=1.0)


# -- on a real cluster -------------------------------------------------------------------
def _cluster_up() -> str | None:
    """Why there is no usable cluster here, or None."""
    if shutil.which("srun") is None:
        return ("needs SLURM: apt-get install -y slurm-wlm munge, then .ci/slurm-up "
                "(a one-node cluster)")
    done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if done.returncode != 0 or not any(s.startswith(("idle", "mix", "alloc"))
                                       for s in done.stdout.split()):
        return "SLURM is installed but no node is up: run .ci/slurm-up"
    return None


needs_cluster = pytest.mark.skipif(_cluster_up() is not None, reason=str(_cluster_up()))


def _no_jobs() -> bool:
    done = subprocess.run(["squeue", "-h"], capture_output=True, text=True)
    return done.stdout.strip() == ""


@needs_cluster
def test_srun_tasks_train_what_launch_trains(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS),
                                         env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable,
                           str(JOB), "ddp", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "rank0.txt").read_text() == "Run"  # rank 0 got the run ...
    assert (tmp_path / "rank1.txt").read_text() == "NoneType"  # ... the other None
    got = torch.load(tmp_path / "run.pt")
    assert got["status"] == "done" and got["ranks"] == [0, 1]
    assert [r["env_rank"] for r in got["results"]] == ["0", "1"]
    local = nbtrain.launch(train, devices=2, accelerator="cpu", strategy="ddp", seed=7,
                           dashboard=False)
    for name, value in local.result["full"].items():
        torch.testing.assert_close(got["results"][0]["full"][name], value, rtol=1e-5,
                                   atol=1e-6, msg=f"{name} differs from launch()")
    assert [r["first"] for r in got["resumed"]] == [4, 4]  # checkpoint and resume in SLURM
    assert _no_jobs()


SUBMIT_CELL = """
import os, time, torch, torch.distributed as dist
import nbtrain

class Scaled:
    def __init__(self, v):
        self.v = v

FACTOR = 3

def job(ctx, k, steps=6, pause=0.05):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    for i in range(steps):
        ctx.log(loss=1.0 / (i + 1))
        time.sleep(pause)
    return Scaled(FACTOR * k + t.item())

def failing(ctx):
    dist.barrier()
    if ctx.rank == 1:
        raise KeyError("rank one lost its key")
    dist.barrier()
"""


@needs_cluster
def test_a_job_submitted_from_the_notebook_is_watched_and_returns(kernel_clean, tmp_path):
    kernel = kernel_clean
    assert kernel.run(SUBMIT_CELL).error is None
    folder = str(tmp_path / "jobs")
    reply = kernel.run(f"""
        run = nbtrain.submit(job, 2, devices=2, folder={folder!r})  # its dashboard here
        print("first", run.status)
        values = [r.v for r in run.wait(timeout=180)]
        print("values", values, run.status, run.start_method)
    """, timeout=240)
    assert reply.error is None, reply.error
    assert "first queued" in reply.stdout or "first running" in reply.stdout, reply.stdout
    assert "values [9.0, 9.0] done slurm" in reply.stdout, reply.stdout
    # every rank's events reached the notebook, live, and its dashboard in the cell
    assert kernel.value("{r: len(run.history.metric('loss', r)) for r in (0, 1)}") == \
        {0: 6, 1: 6}
    view = kernel.value("[(type(s).__name__, s.state.status, sorted({r for _, r in s.state.metrics})) "
                        "for s in run._sinks.sinks if hasattr(s, 'state')]")
    assert view and view[0][1:] == ({0: "done", 1: "done"}, [0, 1]), view
    assert reply.displays, "the run's view showed in the cell"
    logs = kernel.value("run.remote['logs']")
    assert all(pathlib.Path(p).parent == pathlib.Path(folder) for p in logs), logs
    assert _no_jobs()

    # a failing rank: named, with its traceback, the job ended
    reply = kernel.run(f"nbtrain.submit(failing, devices=2, folder={folder!r}, "
                       "dashboard=False).wait(timeout=180)", timeout=240)
    assert reply.ename == "WorkerError", reply.error
    assert "rank 1 failed with KeyError: 'rank one lost its key'" in reply.error["evalue"]
    assert "[rank 1]" in "\n".join(reply.error["traceback"])
    assert _no_jobs()

    # stop() cancels the job: no job in the queue, no process of it left
    reply = kernel.run(f"""
        run = nbtrain.submit(job, 1, steps=100000, pause=0.1, devices=2, folder={folder!r})
        while (run.last_step or 0) < 3:
            time.sleep(0.2)
        run.stop(timeout=60)
        print("stopped", run.status)
    """, timeout=240)
    assert reply.error is None, reply.error
    assert "stopped stopped" in reply.stdout
    deadline = time.monotonic() + 30
    while not _no_jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _no_jobs()
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if "submitit" in " ".join(p.info["cmdline"] or ())]
    assert not left, left


@needs_cluster
def test_the_guides_submit_example_runs_as_pasted(tmp_path, no_leftovers):
    import re

    readme = (TESTS.parent / "README.md").read_text()
    first = re.search(r"^```python\n(.*?)^```", readme, re.S | re.M).group(1)
    definitions = first.split("\nrun = nbtrain.launch")[0]  # the model, data and train
    guide = (TESTS.parent / "docs" / "guide.md").read_text()
    section = guide[guide.index("## From the notebook to a SLURM cluster"):]
    example = re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)
    script = tmp_path / "example.py"
    script.write_text(definitions + "\n" + example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ,
                                                          "NBTRAIN_DASHBOARD": "off"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] in ("queued", "running"), lines
    assert lines[1].startswith("[{'loss':"), lines  # both ranks' results
    assert "nbtrain-jobs" in lines[2], lines
    assert _no_jobs()
