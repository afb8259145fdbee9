"""What a user gets from ``pip install nbtrain`` alone, checked end to end.

CI runs this script in a new virtual environment that holds torch and nbtrain's runtime
dependencies only (``--runtime-only`` then insists that no test tool is installed), before
the dev extras go in. It is what caught nothing when numpy was missing: a 2-rank CPU run
that saves a checkpoint with ``ctx.save`` and loads it back (sharded and full), a
checkpoint read in this process, a plotly figure drawn from a tensor, and the dashboard's
figure built from a finished run. ``tests/test_fresh_env.py`` runs it in the suite too.

``--installed`` is for an install from the built wheel (CI's main and hosted-stack legs):
nbtrain must come from site-packages, not a checkout, and from there the demo runs and a
real Jupyter kernel (jupyter_client, which ipykernel brings) launches two ranks.

    python tests/fresh_env.py [--runtime-only] [--installed]
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile

import torch
from torch import nn

import nbtrain
from nbtrain import checkpoint


def train(ctx, path, load=False, full=False, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = ctx.setup(model, opt)
    state = {"model": model, "optimizer": opt, "step": -1}
    if load:
        ctx.load(path, state)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g, device=ctx.device)
        loss = model(x).pow(2).mean()
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
        state["step"] += 1
    if not load:
        ctx.save(path, state, full=full)
    return {"step": state["step"], "full": ctx.full_state_dict(model)}


def check_checkpoints(tmp: str) -> None:
    for strategy, full in (("ddp", False), ("fsdp", False), ("ddp", True)):
        path = f"{tmp}/{strategy}-{'full' if full else 'sharded'}"
        saved = nbtrain.launch(train, path, full=full, devices=2, accelerator="cpu",
                               strategy=strategy, dashboard=False)
        if not checkpoint.exists(path):
            raise SystemExit(f"ctx.save wrote nothing at {path}")
        loaded = nbtrain.launch(train, path, load=True, devices=2, accelerator="cpu",
                                strategy="fsdp" if strategy == "ddp" else "ddp",
                                dashboard=False)
        if loaded.result["step"] != saved.result["step"] + 4:
            raise SystemExit(f"{strategy}: the loaded run did not go on from step "
                             f"{saved.result['step']}: {loaded.result['step']}")
        plain = {"model": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
                 "step": -1}
        checkpoint.load(path, plain)  # in this process, no process group
        for name, value in saved.result["full"].items():
            torch.testing.assert_close(plain["model"].state_dict()[name], value)
        print(f"checkpoint {strategy} {'full' if full else 'sharded'}: saved at step "
              f"{saved.result['step']}, went on to {loaded.result['step']}, read here")
    return saved


def check_figures(run) -> None:
    import plotly.graph_objects as go

    from nbtrain.ui.figures import build_figure
    from nbtrain.ui.state import LiveState

    go.Figure(go.Bar(y=torch.arange(4.0))).to_json()  # plotly converts tensors via numpy
    build_figure(LiveState.from_run(run)).to_json()
    print("figures: a tensor bar chart and the dashboard figure of a finished run")


KERNEL_CELL = """
import nbtrain, torch
from torch import nn

def train(ctx):
    torch.manual_seed(0)
    model, opt = ctx.setup(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), 0.1))
    loss = model(torch.ones(8, 4, device=ctx.device)).pow(2).mean()
    ctx.backward(loss)
    ctx.log(loss=loss)
    return ctx.rank

run = nbtrain.launch(train, devices=2, accelerator="cpu")
print("ranks", run.results, "from", nbtrain.__file__)
"""


def check_installed(tmp: str) -> None:
    """The wheel's nbtrain, away from any checkout: its demo and a launch in a kernel."""
    import os
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.abspath(nbtrain.__file__).startswith(here + os.sep):
        raise SystemExit(f"--installed, but nbtrain comes from the checkout: {nbtrain.__file__}")
    report = os.path.join(tmp, "report.html")
    subprocess.run([sys.executable, "-m", "nbtrain", "demo", "--steps", "10", "--output",
                    report], cwd=tmp, check=True, timeout=600)
    if not os.path.getsize(report):
        raise SystemExit("the demo wrote an empty report")
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", cwd=tmp)
    try:
        out = []
        reply = client.execute_interactive(
            KERNEL_CELL, timeout=300,
            output_hook=lambda msg: out.append(msg["content"].get("text", "")))
        text = "".join(out)
        if reply["content"]["status"] != "ok" or "ranks [0, 1] from" not in text:
            raise SystemExit(f"a launch in a kernel failed: {reply['content']}\n{text}")
        if here in text.split(" from ", 1)[1]:
            raise SystemExit(f"the kernel imported the checkout's nbtrain: {text}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    print(f"installed: {os.path.dirname(nbtrain.__file__)}; the demo and a 2-rank launch in a "
          "real kernel ran from it")


def main(argv: list[str]) -> None:
    if "--runtime-only" in argv:
        extra = [m for m in ("pytest", "nbval", "nbclient", "jupyterlab")
                 if importlib.util.find_spec(m)]
        if extra:
            raise SystemExit(f"--runtime-only, but dev tools are installed: {extra}")
    torch.ones(2).numpy()  # torch finds numpy (its CPU wheel does not bring it)
    with tempfile.TemporaryDirectory() as tmp:
        run = check_checkpoints(tmp)
    check_figures(run)
    if "--installed" in argv:
        with tempfile.TemporaryDirectory() as tmp:
            check_installed(tmp)
    print("fresh environment: ok")


if __name__ == "__main__":
    main(sys.argv[1:])
