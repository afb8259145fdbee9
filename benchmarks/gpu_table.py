"""The guide's table on the GPUs you have: memory and step time per sharding mode, through
nbtrain beside the same loop in plain torch.

Rows: DDP (nbtrain's: gradients as views into the all-reduce buckets); DDP as torch
builds it by default (buckets beside the gradients); NO_SHARD-like (FSDP2 on a replicate x 1 mesh: every rank keeps everything, as
FSDP1's NO_SHARD did); SHARD_GRAD_OP (``fsdp_grad_op``); FULL_SHARD (``fsdp``); FULL_SHARD
with activation checkpointing of every block; FULL_SHARD with CPU offload. Every row runs
on all visible GPUs (one is enough: sharding then saves nothing, but checkpointing and
offload still do). Both columns run the same training loop on the same model; they
differ only in who wraps the model: ``ctx.setup`` under ``nbtrain.launch``, or torch's
``DistributedDataParallel`` / ``fully_shard`` / ``checkpoint_wrapper`` called by hand in
processes started with ``torch.multiprocessing``.

  peak:   torch.cuda.max_memory_allocated on rank 0 from the fourth step on: DDP rebuilds
          its buckets once, at the second step, and NCCL may hold the old ones (a
          gradient-sized copy) for a step or two after; seen on an H100 under plain torch
          and nbtrain alike, in some runs and not others, so it is left out of both
  step:   median seconds per step on rank 0 (synchronised), after the first

    python benchmarks/gpu_table.py [--width 2048] [--depth 8] [--batch 8] [--seq 512]
    python benchmarks/gpu_table.py --accelerator cpu --width 256 --depth 2   # a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_ladder import Block, Model  # noqa: E402  (the same transformer-like blocks)

import nbtrain  # noqa: E402

# row -> (nbtrain strategy name, its options, how plain torch wraps the model)
ROWS = {
    "DDP": ("ddp", {}, "ddp"),
    "DDP, torch's default": ("ddp", {"gradient_as_bucket_view": False}, "ddp_default"),
    "NO_SHARD-like": ("fsdp_hybrid", {"shard_size": 1}, "no_shard"),
    "SHARD_GRAD_OP": ("fsdp_grad_op", {}, "grad_op"),
    "FULL_SHARD": ("fsdp", {}, "full"),
    "FULL_SHARD + AC": ("fsdp", {"activation_checkpointing": (Block,)}, "full_ac"),
    "FULL_SHARD + offload": ("fsdp_offload", {}, "offload"),
}


PEAK_FROM = 3  # the step the peak is measured from (see the docstring)


def loop(model, opt, args, device, rank: int) -> dict:
    """The training loop both columns run: steps, synchronised timing, allocator peak."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch * args.seq, args.width, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch * args.seq,), generator=g).to(device)
    cuda = device.type == "cuda"
    times = []
    for step in range(args.steps):
        if step == PEAK_FROM and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return {"step_s": statistics.median(times[1:]),
            "peak": torch.cuda.max_memory_allocated(device) if cuda else None}


# -- through nbtrain -----------------------------------------------------------------------
def nbtrain_train(ctx, args):
    torch.manual_seed(0)
    model = Model(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = ctx.setup(model, opt)
    return loop(model, opt, args, ctx.device, ctx.rank)


def run_nbtrain(row: str, args, accelerator: str, devices: int) -> dict:
    name, options, _ = ROWS[row]
    strategy = nbtrain.strategies.get(name, **options)
    # This process asked CUDA for the table's header: fork is unsafe, and nbtrain would
    # say so in a warning per row; asking for the fork server is what a user would do.
    method = "forkserver" if torch.cuda.is_initialized() else "auto"
    run = nbtrain.launch(nbtrain_train, args, devices=devices, accelerator=accelerator,
                         strategy=strategy, dashboard=False, telemetry=False,
                         start_method=method)
    return run.result


# -- plain torch ---------------------------------------------------------------------------
def wrap_plain(model: nn.Module, how: str, device: torch.device, world: int) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if how in ("ddp", "ddp_default"):
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model.to(device), device_ids=ids,
                                                   gradient_as_bucket_view=how == "ddp")
    if how == "full_ac":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    options = {"reshard_after_forward": how != "grad_op"}
    if how == "offload":
        options["offload_policy"] = CPUOffloadPolicy()
    else:
        model = model.to(device)
    if how == "no_shard":
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh(device.type, (world, 1),
                                           mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, **options)
    return fully_shard(model, **options)


def plain_worker(rank: int, world: int, port: int, how: str, args, out: str) -> None:
    cuda = args.accelerator == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = wrap_plain(Model(args.width, args.depth), how, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    result = loop(model, opt, args, device, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    # Leave as nbtrain's ranks do, without the interpreter's teardown: gloo's threads can
    # still hold finished work whose tensors need the GIL while Python finalises, and the
    # process aborts ("terminate called without an active exception", seen once in CI).
    # Teardown is not what this table measures.
    sys.stdout.flush()
    os._exit(0)


def run_plain(row: str, args, devices: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(plain_worker, args=(devices, port, ROWS[row][2], args, out),
                           nprocs=devices, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--devices", type=int, default=0, help="0: every visible GPU")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        metavar="ROW", help=f"rows to run (default: all of {list(ROWS)})")
    args = parser.parse_args()
    cuda = args.accelerator == "cuda"
    if cuda and torch.cuda.device_count() == 0:  # NVML count: CUDA stays uninitialised
        sys.exit("no CUDA GPU is visible; for a dry run use --accelerator cpu")
    devices = args.devices or (torch.cuda.device_count() if cuda else 2)
    n = sum(p.numel() for p in Model(args.width, args.depth).parameters())
    gb = 2 ** 30
    print(f"{devices} x {torch.cuda.get_device_name(0) if cuda else 'CPU process'}; "
          f"{n / 1e6:.0f}M parameters, AdamW fp32, batch {args.batch} x {args.seq} tokens; "
          f"torch {torch.__version__}; rank 0")
    print(f"{'row':<22}{'nbtrain peak':>13}{'torch peak':>11}{'nbtrain step':>14}"
          f"{'torch step':>11}{'step ratio':>11}")
    for row in args.rows:
        if row.endswith("offload") and not cuda:
            continue
        ours, theirs = run_nbtrain(row, args, args.accelerator, devices), run_plain(row, args,
                                                                                    devices)
        peaks = [f"{r['peak'] / gb:.2f} GB" if r["peak"] else "n/a" for r in (ours, theirs)]
        print(f"{row:<22}{peaks[0]:>13}{peaks[1]:>11}{ours['step_s']:>13.3f}s"
              f"{theirs['step_s']:>10.3f}s{ours['step_s'] / theirs['step_s']:>11.2f}",
              flush=True)
    print("Formula per rank (ZeRO, Adam fp32): DDP 16Ψ (torch's default: 20Ψ from backward to "
          "the step); SHARD_GRAD_OP 4Ψ + 12Ψ/N; FULL_SHARD "
          "16Ψ/N; plus activations (checkpointing keeps only each block's input).")


if __name__ == "__main__":
    main()
