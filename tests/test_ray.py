"""``nbtrain.submit(engine=nbtrain.Ray(...))`` on a real Ray cluster of three nodes on this
machine (``ray.cluster_utils.Cluster``, one CPU each, small object stores; one cluster
for the module): ranks placed one per node train to the weights ``launch(devices=2)``
gives under ddp and fsdp while their events reach the run; a node removed mid-run
restarts the ranks from the checkpoint, to an uninterrupted run's weights; a failing
rank fails the run with its traceback; a stop ends every rank; a bad address or a
request the cluster cannot hold fails at submit; nothing stays on the cluster or on this
machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from conftest import descendants
from torch import nn
from workloads import ckpt_train

import nbtrain

ray = pytest.importorskip("ray")
MB = 2**20
CKPT = dict(steps=16, save_every=4, devices=2, dashboard=False)


def train(ctx, fail_on: int | None = None, sleep: float = 0.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                          torch.randint(0, 2, (64,), generator=g))
    for _ in range(200 if sleep else 1):
        for x, y in ctx.dataloader(data, batch_size=4):
            if ctx.rank == fail_on:
                raise ValueError("bad batch on purpose")
            loss = nn.functional.cross_entropy(model(x), y)
            ctx.backward(loss)
            opt.step()
            opt.zero_grad()
            ctx.log(loss=loss)
            time.sleep(sleep)
    state = ctx.full_state_dict(model)
    return {k: v.clone() for k, v in state.items()} if ctx.rank == 0 else ctx.rank


def test_a_bad_address_fails_at_submit_at_once():
    # nbtrain's probe answers (its message), not ray.init's minute of retries
    with pytest.raises(ConnectionError, match="no Ray cluster answers"):
        nbtrain.submit(train, devices=2, engine=nbtrain.Ray("127.0.0.1:1"))
    assert not ray.is_initialized()


def test_ray_clients_server_that_dies_at_its_start_is_started_again(monkeypatch):
    """Ray Client's proxy forks one server per client; now and then the child dies at
    once ("Starting Ray client server failed", seen in CI): the connection is tried again,
    and after CLIENT_TRIES the error says where the server's log is. Any other refusal
    is Ray's own, raised as it is."""
    from nbtrain.scaleout import ray as engine

    failed = ConnectionAbortedError(
        "Initialization failure from server:\nRuntimeError: Starting Ray client server "
        "failed. See ray_client_server_23000.err for detailed logs.")
    calls = []

    def init(**kwargs):
        calls.append(kwargs["address"])
        if calls.count("local") < engine.CLIENT_TRIES or outcome == "never":
            raise failed if outcome != "other" else ConnectionAbortedError("version mismatch")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 3.0})
    outcome = "at last"
    assert engine._connect(nbtrain.Ray("local")) == {"CPU": 3.0}
    assert calls == ["local", "shutdown", "local", "shutdown", "local"]
    calls.clear()
    outcome = "never"
    with pytest.raises(ConnectionError, match=r"did not start in 3 tries \(RuntimeError: "
                       r"Starting.*session_latest/logs"):
        engine._connect(nbtrain.Ray("local"))
    assert calls.count("local") == engine.CLIENT_TRIES
    calls.clear()
    outcome = "other"
    with pytest.raises(ConnectionAbortedError, match="version mismatch"):
        engine._connect(nbtrain.Ray("local"))
    assert calls == ["local"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """What ``launch(devices=2)`` gives, computed before Ray joins this process (a fork of
    a process connected to Ray left Ray's next call hanging: see decisions.md)."""
    return {**{s: nbtrain.launch(train, devices=2, accelerator="cpu", strategy=s,
                                 dashboard=False).results for s in ("ddp", "fsdp")},
            "ckpt": nbtrain.launch(ckpt_train, path=str(tmp_path_factory.mktemp("w") / "ck"),
                                   accelerator="cpu", **CKPT).results[0]["full"]}


@pytest.fixture(scope="module")
def cluster(local):
    from ray.cluster_utils import Cluster

    before = {p.pid for p in descendants(os.getpid())}
    with socket.socket() as s:  # Ray Client's server, for a notebook outside the cluster
        s.bind(("127.0.0.1", 0))
        client_port = s.getsockname()[1]
    nodes = Cluster(initialize_head=True,
                    head_node_args={"num_cpus": 1, "object_store_memory": 80 * MB,
                                    "ray_client_server_port": client_port})
    nodes.client_address = f"ray://127.0.0.1:{client_port}"
    for _ in range(2):  # three nodes: two ranks, and room for one that loses its node
        nodes.add_node(num_cpus=1, object_store_memory=80 * MB)
    ray.init(address=nodes.address, include_dashboard=False, log_to_driver=False)
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        deadline = time.monotonic() + 15
        while (left := [p for p in descendants(os.getpid()) if p.pid not in before]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in left:
            p.kill()
        assert not left, f"the Ray cluster left processes: {[p.pid for p in left]}"


def alive_ranks() -> list:
    """The rank and relay actors the cluster's control store still has alive (read from
    it, as the state API would, without Ray's dashboard)."""
    actors = ray._private.state.actors()
    return [a for a in actors.values()
            if a["ActorClassName"] in ("_Rank", "Relay") and a["State"] != "DEAD"]


def gone(timeout: float = 15.0) -> bool:
    """No rank's actor alive and no placement group left on the cluster."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["state"] != "REMOVED"]
        if not alive_ranks() and not groups:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_on_two_nodes_train_as_launch_does(cluster, local, strategy):
    run = nbtrain.submit(train, devices=2, strategy=strategy, dashboard=False,
                         engine=nbtrain.Ray(placement="STRICT_SPREAD"))
    run.wait(timeout=180)
    assert run.status == "done"
    assert len(set(run.remote["nodes"])) == 2  # a rank on each node
    for name, value in local[strategy][0].items():
        assert torch.allclose(run.results[0][name], value, atol=1e-6), name
    assert run.results[1] == 1
    for rank in (0, 1):  # every rank's steps reached the run live
        assert len(list(run.history.events("step", rank))) == 8
    assert gone()


def test_a_failing_rank_fails_the_run_with_its_traceback(cluster):
    run = nbtrain.submit(train, 1, devices=2, dashboard=False, engine=nbtrain.Ray())
    with pytest.raises(nbtrain.WorkerError) as info:
        run.wait(timeout=180)
    assert info.value.rank == 1 and "bad batch on purpose" in str(info.value)
    assert "train" in info.value.traceback
    assert run.status == "failed"
    assert gone()


def test_stop_ends_every_rank_and_leaves_nothing(cluster):
    run = nbtrain.submit(train, sleep=0.05, devices=2, dashboard=False, engine=nbtrain.Ray())
    deadline = time.monotonic() + 120
    while not list(run.history.events("step", 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(run.history.events("step", 1)), "the ranks never started training"
    asked = time.monotonic()
    run.stop()
    while not run.done and time.monotonic() - asked < 30:
        time.sleep(0.1)
    assert run.done and run.status == "stopped"
    assert gone(timeout=10)  # nothing left on the cluster (a teardown deadline)


def test_through_a_relay_the_notebook_sees_every_rank_live_without_being_dialled(cluster):
    """Ray(relay=True): the ranks attach to an actor on the cluster, not to this kernel
    (its listen_host is an address nothing routes to); their steps still reach the run
    while it trains, and a stop leaves no rank and no relay."""
    engine = nbtrain.Ray(placement="STRICT_SPREAD", relay=True, listen_host="192.0.2.1")
    run = nbtrain.submit(train, sleep=0.05, devices=2, dashboard=False, engine=engine)
    deadline = time.monotonic() + 120
    while not list(run.history.events("step", 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not run.done and list(run.history.events("step", 0)), "no step arrived live"
    assert run.remote["relayed"]
    run.stop()
    run.wait(timeout=30)
    assert run.status == "stopped"
    assert gone(timeout=10)


def test_a_notebook_on_ray_client_trains_and_watches_through_the_relay(cluster, local):
    """A kernel that is not on the cluster (a laptop): Ray Client's address, the relay by
    default; ddp's weights as launch() gives them, every rank's steps in the run."""
    code = f"""
import sys, torch, nbtrain
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_ray import train
run = nbtrain.submit(train, devices=2, dashboard=False,
                     engine=nbtrain.Ray({cluster.client_address!r}, placement="STRICT_SPREAD"))
run.wait(timeout=180)
torch.save({{"status": run.status, "relayed": run.remote["relayed"], "results": run.results,
            "steps": [len(list(run.history.events("step", r))) for r in (0, 1)]}}, sys.argv[1])
"""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "client.pt")
        done = subprocess.run([sys.executable, "-c", code, out], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        got = torch.load(out, weights_only=False)
    assert got["status"] == "done" and got["relayed"] and got["steps"] == [8, 8]
    for name, value in local["ddp"][0].items():
        assert torch.allclose(got["results"][0][name], value, atol=1e-6), name
    assert gone()


def test_a_request_the_cluster_cannot_hold_fails_at_submit(cluster):
    with pytest.raises(ValueError, match="cannot hold 4 ranks"):
        nbtrain.submit(train, devices=4, engine=nbtrain.Ray(), dashboard=False)
    with pytest.raises(TypeError, match="nbtrain.Ray"):
        nbtrain.submit(train, devices=2, engine="ray")
    with pytest.raises(ValueError, match="placement"):
        nbtrain.Ray(placement="ANYWHERE")


def test_importing_nbtrain_imports_no_ray():
    import subprocess
    import sys

    code = "import sys, nbtrain; nbtrain.Ray(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"  # Ray (the nbtrain[ray] extra) loads at submit


def test_a_lost_node_restarts_the_ranks_from_the_checkpoint(cluster, local, tmp_path):
    run = nbtrain.submit(ckpt_train, path=str(tmp_path / "ck"), sleep=0.3, max_restarts=1,
                         engine=nbtrain.Ray(placement="STRICT_SPREAD"), **CKPT)
    deadline = time.monotonic() + 120
    while not run.checkpoints and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.checkpoints, "no checkpoint before the node went"
    head = cluster.head_node.node_id
    lost = next(n for n in cluster.worker_nodes if n.node_id in run.remote["nodes"]
                and n.node_id != head)
    cluster.remove_node(lost)
    run.wait(timeout=180)
    assert run.status == "done"
    [attempt] = run.attempts
    assert "Ray worker died" in attempt.cause and attempt.resume
    assert lost.node_id not in run.remote["nodes"]  # the second attempt placed elsewhere
    assert run.results[0]["first"] % 4 == 0 and run.results[0]["first"] > 0
    for name, value in local["ckpt"].items():
        torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{name} differs after the restart")
    assert len(run.history.events("restart")) == 1
    assert gone()
    cluster.add_node(num_cpus=1, object_store_memory=80 * MB)  # the next test's room
