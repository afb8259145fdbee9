"""RankPool and %%ranks inside a real ipykernel, driven by jupyter_client as Jupyter
drives it: cells on every rank or some, state across cells, what a failure, an interrupt
or a killed rank leaves, runs on warm workers, and a close that leaves nothing."""

from __future__ import annotations

import re
import time

import psutil
import pytest
from conftest import wait_no_descendants

pytestmark = pytest.mark.kernel

SETUP = """
%load_ext nbtrain
import os, signal, time
import torch
from torch import nn
import nbtrain
"""


@pytest.fixture(scope="module")
def k(kernel):
    reply = kernel.run(SETUP)
    assert reply.error is None, reply.error
    return kernel


@pytest.fixture
def pool(k, kernel_clean):
    """A fork pool of 2 CPU ranks in the kernel, closed after the test."""
    reply = k.run('pool = nbtrain.RankPool(devices=2, accelerator="cpu", start_method="fork")')
    assert reply.error is None, reply.error
    try:
        yield k
    finally:
        k.run("pool.close()")


def workers(k) -> list[psutil.Process]:
    return [p for p in psutil.Process(k.pid).children() if p.is_running()]


def test_ranks_runs_on_every_rank_or_some_and_keeps_names(pool):
    k = pool
    reply = k.run("%%ranks\nx = torch.tensor([float(rank + 1)])\nprint('world', world_size)")
    assert reply.error is None, reply.error
    assert "[rank 0] world 2" in reply.stdout and "[rank 1] world 2" in reply.stdout
    reply = k.run("%%ranks\ndist.all_reduce(x)\nprint('sum', x.item(), device)")
    assert "[rank 0] sum 3.0 cpu" in reply.stdout and "[rank 1] sum 3.0 cpu" in reply.stdout
    reply = k.run("%%ranks 1\nprint('only', rank)")
    assert reply.error is None, reply.error
    assert "[rank 1] only 1" in reply.stdout and "[rank 0]" not in reply.stdout
    reply = k.run("%%ranks 0,1\nprint('both', rank)")
    assert "[rank 0] both 0" in reply.stdout and "[rank 1] both 1" in reply.stdout
    # pulled to the notebook (tensors on CPU) and pushed from it
    assert k.value("[t.item() for t in pool.pull('x')]") == [3.0, 3.0]
    assert k.run("pool.push(scale=10)").error is None
    reply = k.run("%%ranks\nprint('scaled', x.item() * scale)")
    assert "[rank 0] scaled 30.0" in reply.stdout


def test_last_expression_is_shown_per_rank(pool):
    k = pool
    reply = k.run("%%ranks\ny = rank * 2\ny + 1")
    assert reply.error is None, reply.error
    assert reply.results == ["[rank 0] 1\n[rank 1] 3"]
    reply = k.run("%%ranks\nz = 1")  # no trailing expression: nothing shown
    assert reply.results == [] and reply.error is None
    reply = k.run("%%ranks\ntorch.ones(2, 2) * rank")
    assert "[rank 1] tensor([[1., 1.]," in reply.results[0]


def test_an_exception_shows_every_failing_rank_then_the_next_cell_works(pool):
    k = pool
    assert k.run("%%ranks\nkeep = rank + 100").error is None
    reply = k.run("%%ranks\nif rank == 1:\n    raise ValueError('one is bad')\nprint('fine', rank)")
    assert reply.ename == "RankCellError"
    text = "\n".join(reply.error["traceback"])
    assert "[rank 1] ValueError: one is bad" in text
    # named as IPython names the cell, its lines counted from the magic's
    assert (f"[rank 1]   Cell In[{reply.execution_count}], line 3, in <module>\n"
            "[rank 1]     raise ValueError('one is bad')") in text, text
    bad = k.run("%%ranks\nx = 1\nfor :\n")  # said once, as IPython says one
    assert bad.ename == "CellSyntaxError", bad.error
    assert bad.error["traceback"][:2] == [f"  Cell In[{bad.execution_count}], line 3",
                                          "    for :"], bad.error
    assert bad.error["traceback"][-1] == "SyntaxError: invalid syntax", bad.error
    assert "[rank 0] fine 0" in reply.stdout
    reply = k.run("%%ranks\nraise KeyError(rank)")
    text = "\n".join(reply.error["traceback"])
    assert "[rank 0] KeyError: 0" in text and "[rank 1] KeyError: 1" in text
    reply = k.run("%%ranks\nprint('still', keep)")
    assert reply.error is None, reply.error
    assert "[rank 0] still 100" in reply.stdout and "[rank 1] still 101" in reply.stdout


@pytest.mark.parametrize("how", ["group", "pid"])
def test_an_interrupt_stops_the_cell_on_every_rank_and_the_pool_goes_on(pool, how):
    k = pool
    assert k.run("%%ranks\nkeep = rank").error is None
    pids = {p.pid for p in workers(k)}
    msg = k.submit("%%ranks\nimport time\nprint('looping', flush=True)\n"
                   "while True:\n    time.sleep(0.05)")
    k.collect(msg, timeout=30, until="[rank 0] looping")
    k.collect(msg, timeout=30, until="[rank 1] looping")
    t = time.monotonic()
    k.interrupt_group() if how == "group" else k.interrupt_pid()
    reply = k.collect(msg, timeout=30)
    assert time.monotonic() - t < 3.0
    assert reply.ename == "KeyboardInterrupt"
    said, where = reply.error["evalue"].split("\n")
    assert said == "interrupted on rank(s) [0, 1]; the pool is still usable"
    # where they were as they were interrupted (at the sleep, or between two)
    assert re.fullmatch(r"where the ranks were: (ranks? [01, ]+ at Cell In\[\d+\], line "
                        r"[45], in <module>: (time.sleep\(0.05\)|while True:)(; )?)+", where), where
    assert {p.pid for p in workers(k)} == pids  # the same workers, state kept
    reply = k.run("%%ranks\nprint('after', keep)")
    assert "[rank 0] after 0" in reply.stdout and "[rank 1] after 1" in reply.stdout


def test_an_interrupt_with_a_rank_stuck_in_a_collective_frees_it_and_keeps_the_pool(pool):
    """Rank 0 waits in a barrier rank 1 never reaches: the interrupt stops rank 1, which
    then leaves the process group to free rank 0; the same workers go on, names kept."""
    k = pool
    assert k.run("%%ranks\nkeep = rank + 1").error is None
    pids = {p.pid for p in workers(k)}
    msg = k.submit("%%ranks\nimport time\nprint('in', flush=True)\n"
                   "if rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(3600)")
    k.collect(msg, timeout=30, until="[rank 0] in")
    k.collect(msg, timeout=30, until="[rank 1] in")
    t = time.monotonic()
    k.interrupt_group()
    reply = k.collect(msg, timeout=30)
    assert time.monotonic() - t < 6.0
    assert reply.ename == "KeyboardInterrupt"
    said = reply.error["evalue"]
    assert said.startswith("interrupted on rank(s) [0, 1]; the pool is still usable\n"
                           "rank 0 was stuck in a collective the other ranks never joined; "
                           "the pool freed it"), said
    assert re.search(r"where the ranks were: rank 0 at Cell In\[\d+\], line 5, in "
                     r"<module>: dist.barrier\(\); rank 1 at Cell In\[\d+\], line 7, in "
                     r"<module>: time.sleep\(3600\)", said), reply.error
    assert {p.pid for p in workers(k)} == pids  # the same workers
    reply = k.run("%%ranks\nt = torch.ones(1) * keep\ndist.all_reduce(t)\nprint('sum', t.item())")
    assert "[rank 0] sum 3.0" in reply.stdout and "[rank 1] sum 3.0" in reply.stdout, reply
    assert "restarting" not in reply.stderr


def test_a_hung_collective_with_timeout_is_named(pool):
    k = pool
    t = time.monotonic()
    reply = k.run("%%ranks --timeout 1\nif rank == 0:\n    dist.barrier()")
    assert reply.ename == "RunTimeoutError"
    assert "ranks still running: 0 (finished: 1)" in reply.error["evalue"]
    assert re.search(rf"rank 0: still running, at Cell In\[{reply.execution_count}\], line 3, "
                     r"in <module>: dist.barrier\(\)", "\n".join(reply.error["traceback"])), \
        reply.error
    assert time.monotonic() - t < 10
    assert "the pool freed it by starting its process group again" in reply.error["evalue"]
    reply = k.run("%%ranks\nprint('on', rank)")  # the same pool goes on
    assert "[rank 0] on 0" in reply.stdout and "restarting" not in reply.stderr


def test_a_killed_rank_is_replaced_and_the_next_cell_runs(pool):
    """In a real kernel: a rank killed while the pool waits (as the OOM killer would) is
    named in one line, and the next %%ranks cell runs on new workers."""
    k = pool
    assert k.run("%%ranks\nkeep = 1").error is None
    victim = k.value("pool.status[1]['pid']")
    psutil.Process(victim).kill()
    deadline = time.monotonic() + 10
    # until its death is known (a fork server's child: once the server says so)
    while k.value("pool.workers.handles[1].process.exitcode is None"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    reply = k.run("%%ranks\nprint('back', rank)")
    assert reply.error is None, reply.error
    assert "[rank 0] back 0" in reply.stdout and "[rank 1] back 1" in reply.stdout
    assert "restarting the pool's 2 workers (rank 1 died (SIGKILL))" in reply.stderr


TRAIN = """
def make_data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(128, 32, generator=g),
                                          torch.randint(0, 4, (128,), generator=g))

def train(ctx, lr):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = ctx.setup(model, opt)
    for x, y in ctx.dataloader(make_data(), batch_size=16):
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step(); opt.zero_grad()
        ctx.log(loss=loss)
    print("trained", ctx.rank)
    return round(loss.item(), 6)
"""


def test_pool_launch_twice_on_spawned_workers(k, kernel_clean):
    assert k.run(TRAIN).error is None
    reply = k.run("""
        cold = nbtrain.launch(train, 1e-3, devices=2, accelerator="cpu", dashboard=False)
        spawn_pool = nbtrain.RankPool(devices=2, accelerator="cpu", start_method="spawn")
        first = spawn_pool.launch(train, 1e-3, dashboard=False)
        second = spawn_pool.launch(train, 1e-2, dashboard=False)
        print("same", first.results == cold.results, first.results != second.results)
        print("events", len(second.history.metric("loss", rank=0)), second.status)
        print("started", spawn_pool.started)
    """, timeout=300)
    try:
        assert reply.error is None, reply.error
        assert "same True True" in reply.stdout
        assert "events 4 done" in reply.stdout and "started 1" in reply.stdout
        assert reply.stdout.count("[rank 0] trained 0") == 3
        other = k.run("print(nbtrain.launch(train, 1e-2, devices=2, dashboard=False).results"
                      " == second.results)")
        assert "True" in other.stdout, other
    finally:
        k.run("spawn_pool.close()")


def test_an_interrupted_pool_launch_leaves_the_pool_usable(pool):
    k = pool
    assert k.run(TRAIN).error is None
    assert k.run("""
        def sleepy(ctx):
            print("started", flush=True)
            while True:
                time.sleep(0.05)
    """).error is None
    pids = {p.pid for p in workers(k)}
    msg = k.submit("pool.launch(sleepy, dashboard=False)")
    k.collect(msg, timeout=30, until="[rank 0] started")
    k.collect(msg, timeout=30, until="[rank 1] started")
    t = time.monotonic()
    k.interrupt_group()
    reply = k.collect(msg, timeout=30)
    assert time.monotonic() - t < 3.0
    assert reply.ename == "KeyboardInterrupt"
    assert {p.pid for p in workers(k)} == pids
    reply = k.run("print('again', pool.launch(train, 1e-3, dashboard=False).status)")
    assert "again done" in reply.stdout, reply


def test_an_interrupt_while_the_pool_starts_leaves_nothing(k, kernel_clean):
    msg = k.submit('p = nbtrain.RankPool(devices=2, accelerator="cpu", start_method="spawn")')
    deadline = time.monotonic() + 30
    while len(workers(k)) < 2:  # spawned, still importing torch
        assert time.monotonic() < deadline
        time.sleep(0.05)
    k.interrupt_group()
    reply = k.collect(msg, timeout=30)
    assert reply.ename == "KeyboardInterrupt"
    assert not wait_no_descendants(k.pid, timeout=3.0)
    reply = k.run("""
        with nbtrain.RankPool(devices=2, accelerator="cpu", start_method="fork") as p:
            print(p.run("rank"))
    """)
    assert "{0: '0', 1: '1'}" in reply.stdout, reply


def test_close_leaves_no_process_thread_or_port(k, kernel_clean):
    assert k.run(TRAIN).error is None
    reply = k.run("""
        import gc, psutil
        me = psutil.Process()
        def snapshot():
            gc.collect()
            conns = me.net_connections(kind="inet")
            return {"threads": me.num_threads(), "fds": me.num_fds(),
                    "listening": len([c for c in conns if c.status == "LISTEN"]),
                    "connections": len(conns), "children": len(me.children(recursive=True))}
        # warm up: what is created once per kernel (imports, the first pool's helpers)
        with nbtrain.RankPool(devices=2, accelerator="cpu", start_method="fork") as p:
            p.run("1")
        time.sleep(0.2)
        before = snapshot()
        for _ in range(3):
            p = nbtrain.RankPool(devices=2, accelerator="cpu", start_method="fork")
            during = snapshot()
            p.run("t = torch.ones(1)\\ndist.all_reduce(t)")
            p.launch(train, 1e-3, dashboard=False)
            p.close()
        # ipykernel closes the zmq pipes of finished threads that printed every 10 s
        for _ in range(30):
            after = snapshot()
            if all(after[key] <= before[key] for key in before):
                break
            time.sleep(1)
        grew = {key: (before[key], after[key]) for key in before if after[key] > before[key]}
        # the store lives in rank 0: the kernel listens on nothing more for a pool
        print("during", during["children"], during["listening"] == before["listening"])
        print("grew", grew if grew else "nothing", before, after)
    """, timeout=300)
    assert reply.error is None, reply.error
    assert "during 2 True" in reply.stdout
    assert "grew nothing" in reply.stdout, reply.stdout
