"""The fork server, in a real ipykernel: after CUDA was "touched" (simulated on CPU with a
fork check that says so, as the guard tests do), ``start_method="auto"`` starts ranks from
one warm server that lives as long as the kernel, restarts when killed, and leaves with
the kernel. Supervision, errors and interrupts are those of every other start method."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import fork_server, wait_no_descendants
from kernel import Kernel

pytestmark = pytest.mark.kernel

CELL = """
import os, signal, time, warnings
import torch, torch.distributed as dist
import nbtrain
from nbtrain.launch.starting import forkserver, guards

guards.FORK_CHECKS.append(lambda: "CUDA was initialised in this kernel (simulated)")

class Scaled:
    def __init__(self, v):
        self.v = v

FACTOR = 3

def train(ctx, k):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return Scaled(FACTOR * k + t.item()), os.environ.get("SET_AFTER"), os.getppid()

def failing(ctx):
    dist.barrier()
    if ctx.rank == 1:
        raise KeyError("rank one has no key")
    dist.barrier()

def shell_of_rank(ctx):
    import sys
    module = sys.modules.get("IPython.core.interactiveshell")
    made = module is not None and module.InteractiveShell.initialized()
    shell = module.InteractiveShell.instance() if made else None
    return (type(shell).__name__ if made else None, getattr(shell, "_nbtrain_publishes", False),
            getattr(shell, "_nbtrain_plain", None) == os.getppid())  # made in the server

def sleepy(ctx):
    print("started", flush=True)
    while True:
        time.sleep(0.1)
"""


def servers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children() if fork_server(p)]


@pytest.fixture(scope="module")
def k():
    kernel = Kernel(startup=CELL)
    try:
        yield kernel
    finally:
        pid = kernel.pid
        left = servers(pid)
        kernel.shutdown()
        # the server leaves with the kernel: nothing of it is left
        gone, alive = psutil.wait_procs(left, timeout=10)
        assert not alive, f"the fork server outlived its kernel: {alive}"


def test_after_cuda_the_default_starts_ranks_from_one_warm_server(k):
    reply = k.run("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = nbtrain.launch(train, 2, devices=2, dashboard=False)
        os.environ["SET_AFTER"] = "yes"  # set after the server started
        second = nbtrain.launch(train, 5, devices=2, dashboard=False)
        print("methods", first.start_method, second.start_method)
        print("warned", any("fork server" in str(w.message) for w in caught))
        print("values", [r[0].v for r in first.results], [r[0].v for r in second.results])
        print("env", [r[1] for r in first.results], [r[1] for r in second.results])
        print("parents", {r[2] for r in first.results} == {r[2] for r in second.results}
              == {forkserver.running_pid()})
    """)
    assert reply.error is None, reply.error
    assert "methods forkserver forkserver" in reply.stdout
    assert "warned True" in reply.stdout
    assert "values [9.0, 9.0] [18.0, 18.0]" in reply.stdout  # FACTOR * k + (1 + 2)
    assert "env [None, None] ['yes', 'yes']" in reply.stdout  # the kernel's environment now
    assert "parents True" in reply.stdout  # both launches: children of the one server
    assert len(servers(k.pid)) == 1
    left = wait_no_descendants(k.pid)
    assert not left, f"left behind: {[' '.join(p.cmdline())[:100] for p in left]}"


def test_a_kernels_ranks_take_the_shell_the_server_made_and_a_scripts_have_none(k, tmp_path):
    """The server makes a kernel's ranks' plain IPython shell once, before it forks
    (rank/server_shell); each rank only routes its displays through it. A script's server
    makes none: its ranks have no shell, as the script has none."""
    reply = k.run("print('shells', nbtrain.launch(shell_of_rank, devices=2, "
                  "dashboard=False).results)")
    assert reply.error is None, reply.error
    assert "shells [('InteractiveShell', True, True), ('InteractiveShell', True, True)]" \
        in reply.stdout
    script = tmp_path / "job.py"
    script.write_text(CELL.replace("guards.FORK_CHECKS.append", "_ = ") + textwrap.dedent("""
        if __name__ == "__main__":
            run = nbtrain.launch(shell_of_rank, devices=2, accelerator="cpu",
                                 start_method="forkserver", dashboard=False)
            print("shells", run.results)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shells [(None, False, False), (None, False, False)]" in done.stdout, done.stdout


def test_a_failing_rank_is_named_with_its_traceback(k):
    reply = k.run("nbtrain.launch(failing, devices=2, dashboard=False)")
    assert reply.ename == "WorkerError"
    assert "rank 1 failed with KeyError" in reply.error["evalue"]
    text = "\n".join(reply.error["traceback"])
    assert "[rank 1]" in text and "failing" in text
    left = wait_no_descendants(k.pid, timeout=5.0)
    assert not left, f"left behind: {[' '.join(p.cmdline())[:100] for p in left]}"


def test_an_interrupt_ends_the_ranks_and_leaves_the_server(k):
    msg = k.submit("nbtrain.launch(sleepy, devices=2)")
    k.collect(msg, timeout=120, until="[rank 0] started")
    k.collect(msg, timeout=60, until="[rank 1] started")
    server = servers(k.pid)[0]
    assert len(server.children()) == 2  # the ranks are the server's children
    k.interrupt_group()
    reply = k.collect(msg, timeout=30)
    assert reply.ename == "KeyboardInterrupt"
    left = wait_no_descendants(k.pid, timeout=5.0)
    assert not left, f"left behind: {[' '.join(p.cmdline())[:100] for p in left]}"
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    assert k.value("nbtrain.launch(train, 1, devices=2, dashboard=False).results[0][0].v") \
        == 6.0


def test_a_killed_server_is_started_again(k):
    old = k.value("forkserver.running_pid()")  # started by the tests above
    assert old is not None
    os.kill(old, 9)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(old) and psutil.Process(old).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    got = k.value("[r[0].v for r in nbtrain.launch(train, 1, devices=2, "
                  "dashboard=False).results], forkserver.running_pid()")
    assert got[0] == [6.0, 6.0]
    assert got[1] not in (None, old)
    assert [p.pid for p in servers(k.pid)] == [got[1]]
    left = wait_no_descendants(k.pid)
    assert not left, f"left behind: {[' '.join(p.cmdline())[:100] for p in left]}"


def test_stop_ends_the_server_and_a_pool_starts_it_again(k):
    reply = k.run("""
        forkserver.stop()
        print("after stop", forkserver.running_pid())
        with nbtrain.RankPool(devices=2, accelerator="cpu") as pool:
            print("pool", pool.start_method,
                  [r[0].v for r in pool.launch(train, 0, dashboard=False).results])
    """)
    assert reply.error is None, reply.error
    assert "after stop None" in reply.stdout
    assert "pool forkserver [3.0, 3.0]" in reply.stdout
    left = wait_no_descendants(k.pid)
    assert not left, f"left behind: {[' '.join(p.cmdline())[:100] for p in left]}"
