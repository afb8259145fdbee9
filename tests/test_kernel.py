"""The launcher inside a real ipykernel, driven by jupyter_client as Jupyter drives it:
its stdout is a zmq stream and an interrupt is a SIGINT to the kernel process (group)."""

from __future__ import annotations

import re
import time

import pytest
from conftest import wait_no_descendants

pytestmark = pytest.mark.kernel

CELL = """
import os, signal, time
import torch, torch.distributed as dist
import nbtrain

SCALE = 7

class Acc:
    def __init__(self, v):
        self.v = v

def helper(x):
    return x * SCALE

def cell_fn(ctx, k):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    print(f"hello from rank {ctx.rank}")
    return Acc(helper(k) + t.item())

def failing(ctx):
    dist.barrier()
    if ctx.rank == 1:
        raise ZeroDivisionError("rank one divides by zero")
    dist.barrier()

def stepping(ctx):
    for i in range(10**9):
        ctx.log(i=i)
        if i == 100:
            print("stepped", flush=True)
        time.sleep(0.005)

def sleepy(ctx):
    print("started", flush=True)
    while True:
        time.sleep(0.1)

handler_before = repr(signal.getsignal(signal.SIGINT))
"""


@pytest.fixture(scope="module")
def k(kernel):
    reply = kernel.run(CELL)
    assert reply.error is None, reply.error
    return kernel


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_cell_defined_function_runs_and_returns(k, kernel_clean, start_method):
    reply = k.run(f"""
        run = nbtrain.launch(cell_fn, 2, devices=2, start_method="{start_method}")
        print("values", [r.v for r in run.results], run.start_method)
    """)
    assert reply.error is None, reply.error
    assert f"values [15.0, 15.0] {start_method}" in reply.stdout  # 2*7 + (0 + 1)
    assert "[rank 0] hello from rank 0" in reply.stdout
    assert "[rank 1] hello from rank 1" in reply.stdout


def test_failing_rank_raises_worker_error_in_the_cell(k, kernel_clean):
    reply = k.run("nbtrain.launch(failing, devices=2)")
    assert reply.ename == "WorkerError"
    assert "rank 1 failed with ZeroDivisionError: rank one divides by zero" in reply.error["evalue"]
    text = "\n".join(reply.error["traceback"])
    assert "[rank 1]" in text and "failing" in text
    assert not wait_no_descendants(k.pid, timeout=2.0)


def _plain(reply) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(reply.error["traceback"]))


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_worker_traceback_names_the_cell_and_shows_once(k, kernel_clean, start_method):
    reply = k.run(f"nbtrain.launch(failing, devices=2, dashboard=False, "
                  f"start_method='{start_method}')")
    assert reply.ename == "WorkerError"
    text = _plain(reply)
    # the worker's frame is named as IPython names cells, with its source (spawn too)
    assert re.search(r"\[rank 1\]   Cell In\[\d+\], line \d+, in failing\n"
                     r"\[rank 1\]     raise ZeroDivisionError", text), text
    assert "ipykernel_" not in text
    assert len(re.findall(r"\[rank 1\]\s+Cell In\[\d+\], line \d+, in failing", text)) == 1
    # and where rank 0 was when it was ended, waiting for rank 1 (when it said so before
    # gloo told it of rank 1's exit)
    at = re.search(r"rank 0: stopped by nbtrain, at (.*)", text)
    assert at is None or re.fullmatch(r"Cell In\[\d+\], line \d+, in failing: dist.barrier\(\)",
                                      at.group(1)), text
    assert "nbtrain/launch" not in text and "run.py" not in text  # no kernel-side internals
    # the launching line (IPython 7 may name the frame <cell line: 0>)
    assert re.search(r"Cell In\[\d+\], line 1, in <(module|cell line: \d+)>", text), text


def test_a_traceback_the_view_shows_is_not_repeated(k, kernel_clean):
    reply = k.run("nbtrain.launch(failing, devices=2, dashboard='static')")
    assert reply.ename == "WorkerError"
    text = _plain(reply)
    assert "the whole traceback: in the run's view above" in text
    # where it failed in the cell, named once (besides where rank 0 was)
    assert len(re.findall(r"(?<!at )Cell In\[\d+\], line \d+, in failing", text)) == 1, text
    assert "Traceback (most recent call last)" in text
    assert text.count("Traceback (most recent call last)") == 1  # the worker's is in the view
    # the view's red box reads the history: the cell is named there too
    detail = k.value("[e.detail for e in nbtrain.last_run().history.events('lifecycle', 1)"
                     " if e.state == 'failed'][0]")
    assert re.search(r"Cell In\[\d+\], line \d+, in failing", detail), detail


def test_a_hang_and_a_native_crash_name_the_cells_lines(k, kernel_clean):
    """Where each rank waited when the run timed out, and the line a rank ran when it
    died in native code, named as IPython names cells, with their source."""
    k.run("""
        def waits(ctx):
            if ctx.rank == 0:
                dist.barrier()  # rank 1 never comes
            time.sleep(60)

        def crashes(ctx):
            import ctypes
            if ctx.rank == 1:
                ctypes.string_at(0)
            dist.barrier()
    """)
    reply = k.run("nbtrain.launch(waits, devices=2, timeout=3, dashboard=False)")
    assert reply.ename == "RunTimeoutError", reply.error
    text = _plain(reply)
    assert re.search(r"rank 0: still running, at Cell In\[\d+\], line 3, in waits: "
                     r"dist.barrier\(\)  # rank 1 never comes", text), text
    assert re.search(r"rank 1: still running, at Cell In\[\d+\], line 4, in waits: "
                     r"time.sleep\(60\)", text), text
    reply = k.run("nbtrain.launch(crashes, devices=2, dashboard=False)")
    assert reply.ename == "WorkerError", reply.error
    text = _plain(reply)
    assert "rank 1 was killed by SIGSEGV (signal 11) in native code" in text
    assert re.search(r"\[rank 1\]   Cell In\[\d+\], line 9, in crashes\n"
                     r"\[rank 1\]     ctypes.string_at\(0\)", text), text
    assert not wait_no_descendants(k.pid, timeout=2.0)


def test_a_rank_still_running_after_the_others_is_named_at_its_line(k, kernel_clean):
    """A rank still running after the others returned (an NCCL hang looks like this):
    its cell, line and source in the run's output, not faulthandler's whole dump."""
    k.run("from nbtrain.launch.following import late\nlate.STRAGGLER_S = 0.5")
    defined = k.run("""
        def uneven(ctx):
            if ctx.rank == 1:
                time.sleep(2.5)
            return ctx.rank
    """)
    try:
        reply = k.run("nbtrain.launch(uneven, devices=2, dashboard=False).results")
    finally:
        k.run("late.STRAGGLER_S = 30.0")
    assert reply.error is None, reply.error
    assert re.search(rf"\[rank 1\] nbtrain: rank 1 is still running \d+ s after rank 0 "
                     rf"returned; where it is now:\n\[rank 1\]   Cell In\[{defined.execution_count}"
                     r"\], line 3, in uneven\n\[rank 1\]     time.sleep\(2.5\)\n", reply.stderr), \
        reply.stderr
    assert "Thread 0x" not in reply.stderr


@pytest.mark.parametrize("how", ["group", "pid"])
def test_interrupt_ends_every_worker_and_the_kernel_goes_on(k, kernel_clean, how):
    msg = k.submit("nbtrain.launch(sleepy, devices=2)")
    k.collect(msg, timeout=60, until="[rank 0] started")
    k.collect(msg, timeout=60, until="[rank 1] started")
    workers = [p for p in __import__("psutil").Process(k.pid).children() if p.is_running()]
    assert len(workers) >= 2
    t = time.monotonic()
    k.interrupt_group() if how == "group" else k.interrupt_pid()
    reply = k.collect(msg, timeout=30)
    assert reply.ename == "KeyboardInterrupt"
    assert time.monotonic() - t < 3.0
    assert not wait_no_descendants(k.pid, timeout=0.5), "workers or zombies left"
    # the kernel's SIGINT handler is what it was, and the next launch works
    assert k.value("repr(signal.getsignal(signal.SIGINT)) == handler_before") is True
    reply = k.run("print([r.v for r in nbtrain.launch(cell_fn, 1, devices=2).results])")
    assert reply.error is None and "[8.0, 8.0]" in reply.stdout, reply


def test_last_run_gives_back_an_interrupted_run(k, kernel_clean):
    msg = k.submit("run2 = nbtrain.launch(stepping, devices=2, dashboard=False)")
    k.collect(msg, timeout=60, until="[rank 0] stepped")
    k.collect(msg, timeout=60, until="[rank 1] stepped")
    k.interrupt_group()
    reply = k.collect(msg, timeout=30)
    assert reply.ename == "KeyboardInterrupt"
    assert "nbtrain.last_run() returns it" in reply.error["evalue"]
    text = "\n".join(reply.error["traceback"])
    assert "threading.py" not in text, text  # short: the cell and launch(), nothing more
    assert not wait_no_descendants(k.pid, timeout=2.0)
    got = k.value("""(
        'run2' in globals(), nbtrain.last_run().status, nbtrain.last_run().fn_name,
        [len(nbtrain.last_run().history.metric('i', r)) >= 50 for r in (0, 1)])""")
    assert got == (False, "stopped", "stepping", [True, True])


def test_twenty_launches_in_a_row_leave_nothing_behind(k, kernel_clean):
    reply = k.run("""
        import gc, psutil
        me = psutil.Process()
        def snapshot():
            gc.collect()
            conns = [c for c in me.net_connections(kind="inet")]
            return {"threads": me.num_threads(), "fds": me.num_fds(),
                    "listening": len([c for c in conns if c.status == "LISTEN"]),
                    "connections": len(conns), "children": len(me.children(recursive=True))}
        env_before = dict(os.environ)
        nbtrain.launch(cell_fn, 0, devices=2)  # warm up: anything created once is not a leak
        time.sleep(0.2)
        before = snapshot()
        values = [nbtrain.launch(cell_fn, i, devices=2).results[0].v for i in range(20)]
        # ipykernel gives every thread that prints a zmq pipe (an eventfd) and closes the
        # pipes of finished threads every 10 s: wait for that before counting.
        for _ in range(30):
            time.sleep(1)
            after = snapshot()
            if all(after[k] <= before[k] for k in before):
                break
        print("ok", values == [7.0 * i + 1 for i in range(20)])
        grew = {k: (before[k], after[k]) for k in before if after[k] > before[k]}
        print("grew", grew if grew else "nothing", before, after)
        print("env", dict(os.environ) == env_before)
    """, timeout=300)
    assert reply.error is None, reply.error
    assert "ok True" in reply.stdout
    assert "grew nothing" in reply.stdout, reply.stdout
    assert "env True" in reply.stdout


WARM = """
import sys
from torch import nn

def first_step(ctx):
    # What a worker imports from its start to the end of its first training step: a
    # forked worker of a warm kernel imports next to nothing (torch._dynamo, which the
    # first optimizer pulls in with ~800 modules, is already there).
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    for x, y in ctx.dataloader(data, batch_size=16):
        ctx.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        break
    new = set(sys.modules) - KERNEL_MODULES
    return len(new), sorted(m for m in new if m.startswith("torch._dynamo"))[:5]
"""


def test_import_stays_light():
    """Warming up is the first launch's work, not ``import nbtrain``'s."""
    import subprocess
    import sys

    code = "import sys, nbtrain; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_a_kernel_pays_the_first_launchs_imports_between_cells(monkeypatch):
    """In a kernel, what the first launch would import is imported while the kernel waits
    for the next cell, on its main thread: not in the import cell, with no thread left for
    a fork to copy. In a Jupyter server's notebook, where the dashboard will be the widget
    one, plotly.js is sent to the page then too (elsewhere nothing is: test_ui)."""
    from kernel import Kernel

    monkeypatch.setenv("JPY_SESSION_NAME", "/tmp/untitled.ipynb")  # as jupyter_server sets
    kernel = Kernel(startup="import sys, threading, torch")
    try:
        kinds = "sorted(type(t).__name__ for t in threading.enumerate())"
        threads = kernel.value(kinds)
        assert kernel.value("(__import__('nbtrain'), 'torch._dynamo' in sys.modules)[1]") is False
        deadline = time.monotonic() + 60
        while not kernel.value("'torch._dynamo' in sys.modules"):
            assert time.monotonic() < deadline, "the kernel never warmed while idle"
            time.sleep(0.2)
        new = list(kernel.value(kinds))
        for kind in threads:
            new.remove(kind)
        # pyzmq's own, to send plotly.js's 5 MB without a copy (as the first dashboard's
        # sending always started it): blocked in a receive, nothing a fork could copy held
        assert set(new) <= {"GarbageCollectorThread"}, new
        assert kernel.value("sys.modules['nbtrain.ui.livechart']._LOADER is not None")
        code = "import nbtrain\ndef one(ctx):\n    return ctx.rank\n"
        assert kernel.value(code + "nbtrain.launch(one, devices=2, accelerator='cpu').results") \
            == [0, 1]
        assert not wait_no_descendants(kernel.pid)
    finally:
        kernel.shutdown()


def test_launches_start_warm(kernel_clean):
    """The kernel pays once for what every forked worker would import on every launch."""
    kernel = kernel_clean
    assert kernel.run(WARM).error is None
    for launch in range(3):
        count, dynamo = kernel.value("""
            KERNEL_MODULES = set(sys.modules)
            nbtrain.launch(first_step, devices=2, accelerator="cpu").results[0]
        """)
        if launch:  # the first launch's count holds what the kernel itself imported
            assert dynamo == [] and count < 40, (count, dynamo)  # cold: ~845, torch._dynamo
    assert kernel.value("'torch._dynamo' in sys.modules")


def test_many_four_rank_starts_in_a_kernel_never_hang(k, kernel_clean):
    """benchmarks/start_stress.py, small: a forked rank once hung at start about once in
    50 four-rank starts in a kernel (a lock copied held from the kernel's store thread)."""
    import os
    import sys
    import textwrap

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import start_stress

    assert k.run(textwrap.dedent(start_stress.SETUP)).error is None
    said = []
    counts = start_stress.count(k, 30, list(start_stress.CELLS), devices=4, deadline=90,
                                say=said.append)
    assert sum(c["starts"] for c in counts.values()) == 30
    assert not any(c["hung"] or c["failed"] for c in counts.values()), "\n".join(said)


def test_the_kernel_stays_busy_while_a_launch_blocks(k, kernel_clean):
    """A widget frontend's control and subshell requests are answered busy-then-idle
    while the cell runs; the status must go back to busy for the running cell."""
    msg_id = k.submit("run = nbtrain.launch(stepping, devices=2, timeout=4, dashboard=False)")
    k.collect(msg_id, timeout=60, until="stepped")  # the ranks train: the cell blocks
    request = k.kc.session.msg("kernel_info_request")
    k.kc.control_channel.send(request)
    statuses, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        msg = k.kc.get_iopub_msg(timeout=30)
        if msg["msg_type"] == "status":
            parent = msg["parent_header"].get("msg_id")
            statuses.append(("cell" if parent == msg_id else "control"
                             if parent == request["header"]["msg_id"] else "other",
                             msg["content"]["execution_state"]))
            if statuses[-1] == ("cell", "idle"):
                break
    control_idle = statuses.index(("control", "idle"))
    assert statuses[control_idle + 1] == ("cell", "busy"), statuses
    assert statuses[-1] == ("cell", "idle"), statuses
