"""Code written for other tools, run from a cell unchanged: a torchrun-style DDP function
(its own init_process_group and destroy_process_group), a transformers Trainer, an
accelerate loop (also after one try in the kernel) and a Lightning Trainer, each with
``nbtrain.launch(fn, devices=2)`` in a real kernel, against one process (Lightning:
against its own ddp_notebook), with steps, memory and loss on the dashboard."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.kernel
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

SETUP = '''
import os, tempfile, time
import torch, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed import init_process_group, destroy_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import nbtrain

g = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))

def one_process(batch_size=16):
    """The same linear regression in one process: each step the union of the ranks'
    batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(DATA, batch_size=batch_size):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    return model.weight.detach()

def shown(run):
    """What the dashboard got from each rank: steps, memory samples, loss points."""
    return {r: (len(run.history.events("step", r)), len(run.history.events("memory", r)),
                len(run.history.metric("loss", r))) for r in range(run.world_size)}
'''

TORCHRUN = '''
def main():                                  # as in the PyTorch DDP tutorial
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA, shuffle=False))
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    weight = model.module.weight.detach().clone()
    world = dist.get_world_size()
    destroy_process_group()
    return {"world": world, "weight": weight}
'''


@pytest.fixture(scope="module")
def k(kernel):
    reply = kernel.run(SETUP + TORCHRUN)
    assert reply.error is None, reply.error
    return kernel


def run_ok(k, code: str, timeout: float = 240, stderr: list | None = None) -> str:
    reply = k.run(code, timeout=timeout)
    assert reply.error is None, (reply.error["ename"], reply.error["evalue"], reply.stderr[-3000:])
    if stderr is not None:
        stderr.append(reply.stderr)
    return reply.stdout


def test_a_torchrun_style_function_runs_unchanged(k, kernel_clean):
    out = run_ok(k, '''
        run = nbtrain.launch(main, devices=2)
        print("world", [r["world"] for r in run.results])
        print("same", all(torch.allclose(r["weight"], one_process(), atol=1e-6) for r in run.results))
        print("shown", shown(run), run.note)
    ''')
    assert "world [2, 2]" in out and "same True" in out, out
    assert "shown {0: (4, 1, 4), 1: (4, 1, 4)} None" in out, out


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_scripts_main_with_argparse_and_sys_exit_runs_as_without_arguments(
        k, kernel_clean, start_method):
    """A kernel's command line (``-f .../kernel-....json``) made argparse exit with 2 in
    every rank; the ranks now see the kernel's program alone, as a script run without
    arguments, unless a cell set ``sys.argv``; ``sys.exit(0)`` ending ``main()`` is
    success, as under torchrun, and any other code says what to do."""
    out = run_ok(k, f'''
        import argparse, sys

        def script_main():
            parser = argparse.ArgumentParser()
            parser.add_argument("--lr", type=float, default=0.1)
            args = parser.parse_args()
            print("lr", args.lr)
            sys.exit(0)

        kept = list(sys.argv)
        print("defaults", nbtrain.launch(script_main, devices=2, dashboard=False,
                                         start_method={start_method!r}).results)
        sys.argv = ["train.py", "--lr", "0.5"]
        try:
            nbtrain.launch(script_main, devices=2, dashboard=False, start_method={start_method!r})
        finally:
            sys.argv = kept

        def strict():
            parser = argparse.ArgumentParser()
            parser.add_argument("--steps", type=int, required=True)
            return parser.parse_args().steps

        try:
            nbtrain.launch(strict, devices=2, dashboard=False, start_method={start_method!r})
        except nbtrain.WorkerError as err:
            print("failed", err.rank is not None, "sys.exit(2)" in str(err),
                  "parse_args([" in str(err))
    ''')
    assert "defaults [None, None]" in out, out
    assert out.count("] lr 0.1") == 2 and out.count("] lr 0.5") == 2, out
    assert "failed True True True" in out, out


def test_twenty_reruns_of_it_never_hang_and_leave_nothing(k, kernel_clean):
    out = run_ok(k, '''
        t = time.monotonic()
        worlds = [r["world"] for _ in range(20) for r in nbtrain.launch(main, devices=2,
                  dashboard=False).results]
        print("worlds", set(worlds), len(worlds), f"{time.monotonic() - t:.1f}s")
    ''', timeout=300)
    assert "worlds {2} 40" in out, out


def test_a_transformers_trainer_runs_unchanged(k, kernel_clean):
    out = run_ok(k, '''
        import transformers as tf
        from nbtrain.integrations.transformers import NbtrainCallback

        def hf_main(batch=4, callbacks=None):
            torch.manual_seed(0)
            model = tf.GPT2LMHeadModel(tf.GPT2Config(
                n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
            ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
            data = [{"input_ids": r, "labels": r} for r in ids]
            args = tf.TrainingArguments(
                output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=4,
                use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                disable_tqdm=True)
            trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
            trainer.train()
            return {"world": args.world_size,
                    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}

        run = nbtrain.launch(hf_main, devices=2)
        alone = hf_main(batch=8)            # one process, the two ranks' batches at once
        print("world", [r["world"] for r in run.results])
        print("same", all(abs(a - b) < 1e-5 for a, b in zip(run.result["losses"], alone["losses"])),
              len(alone["losses"]))
        print("shown", shown(run))
        logged = nbtrain.launch(hf_main, 4, [NbtrainCallback()], devices=2)
        print("logged", sorted(n for n in ("grad_norm", "learning_rate")
                               if logged.history.metric(n, 1)))
    ''')
    assert "world [2, 2]" in out and "same True 4" in out, out
    assert "shown {0: (4, 1, 4), 1: (4, 1, 4)}" in out, out
    assert "logged ['grad_norm', 'learning_rate']" in out, out  # the one-line callback


def test_an_accelerate_loop_runs_unchanged_also_after_a_try_in_the_kernel(k, kernel_clean):
    out = run_ok(k, '''
        from accelerate import Accelerator

        def acc_main():
            accelerator = Accelerator(cpu=True)
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt, loader = accelerator.prepare(model, opt, DataLoader(DATA, batch_size=8))
            for x, y in loader:
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss); opt.step(); opt.zero_grad()
            return {"world": accelerator.num_processes,
                    "weight": accelerator.unwrap_model(model).weight.detach().clone()}

        print("kernel", acc_main()["world"])  # the usual first try, in the kernel
        run = nbtrain.launch(acc_main, devices=2)
        print("world", [r["world"] for r in run.results])
        print("same", all(torch.allclose(r["weight"], one_process(), atol=1e-6) for r in run.results))
        print("shown", shown(run), run.note)
    ''')
    assert "kernel 1" in out and "world [2, 2]" in out and "same True" in out, out
    assert "shown {0: (4, 1, 4), 1: (4, 1, 4)} None" in out, out


def test_a_lightning_trainer_runs_unchanged_as_its_ddp_notebook_does(k, kernel_clean):
    err = []
    out = run_ok(k, '''
        import lightning as L

        class Regression(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 2)
            def training_step(self, batch, i):
                x, y = batch
                loss = F.mse_loss(self.net(x), y)
                self.log("train_loss", loss)
                return loss
            def validation_step(self, batch, i):
                x, y = batch
                self.log("val_loss", F.mse_loss(self.net(x), y))
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        def pl_main(strategy="ddp", devices=2):
            L.seed_everything(0, verbose=False)
            trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                                max_epochs=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
            module = Regression()
            trainer.fit(module, DataLoader(DATA, batch_size=8), DataLoader(DATA, batch_size=16))
            return {"world": trainer.world_size, "weight": module.net.weight.detach().clone()}

        run = nbtrain.launch(pl_main, devices=2)
        own = pl_main("ddp_notebook")       # Lightning's own way from a notebook, in the kernel
        print("world", [r["world"] for r in run.results])
        print("same", all(torch.equal(r["weight"], own["weight"]) for r in run.results))
        print("shown", shown(run), run.note)
        print("its metric", len(run.history.metric("train_loss", 1)))
        print("its validation", run.history.metric("val_loss", 1)[-1][0])
        alone = nbtrain.launch(pl_main, "auto", "auto", devices=2)
        print("alone", [r["world"] for r in alone.results], alone.note is not None)
    ''', stderr=err)
    assert "world [2, 2]" in out and "same True" in out, out
    assert "shown {0: (4, 1, 4), 1: (4, 1, 4)} None" in out, out
    assert "its metric 4" in out, out  # self.log("train_loss"), through the entry point
    assert "its validation 3" in out, out  # the last epoch's, at its last step
    assert "alone [1, 1] True" in out, out  # devices="auto": each rank trained alone, said
    # Lightning's log lines from the ranks carry their rank (its handlers were the kernel's)
    # (ddp_notebook's own lines, from the kernel and its children, carry none)
    lines = [line for line in err[0].splitlines() if "GPU available" in line]
    labelled = [line for line in lines if line.startswith("[rank ")]
    assert len(lines) - len(labelled) == 1 and len(labelled) >= 2, lines  # 1: ddp_notebook's
