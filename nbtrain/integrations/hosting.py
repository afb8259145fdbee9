"""Code written for other launchers, run in a worker as it is.

A function written for torchrun, ``notebook_launcher`` or a framework (a transformers
``Trainer``, an accelerate loop, a Lightning ``Trainer``) brings its own habits. While it
runs in a worker (``hosted``), nbtrain makes them work, and restores everything after:

- **Its own process group.** nbtrain has started the rank's process group before the
  function runs (the supervisor, ``ctx`` and telemetry need it), so the function's own
  ``dist.init_process_group("gloo" | "nccl" | ...)`` with the env:// defaults joins it
  instead of failing with "initialize the default process group twice": one group, not
  two. ``dist.destroy_process_group()`` at its end leaves the group to nbtrain, which
  ends it with the worker (gloo's destructor could wait forever on a thread that needs
  the GIL: 7 launches in 14 hung there). Both are replaced where the function can reach
  them: in ``torch.distributed``, and as names it imported into its own globals (the
  PyTorch tutorial's ``from torch.distributed import init_process_group``).
- **A worker, not a notebook.** A forked worker inherits the kernel's ``sys.ps1``, and
  Lightning then refuses its DDP strategies ("not compatible with an interactive
  environment"): the worker is not interactive, so ``sys.ps1`` goes and Lightning's
  ``_IS_INTERACTIVE`` reads False. accelerate's shared state copied from the kernel (a
  loop tried there first) would make every rank train alone at world size 1: it is
  reset, so accelerate sets itself up again from the rank's environment. A kernel that
  imported transformers' ``Trainer`` gave every rank its notebook progress table (the
  choice is made at that import): only rank 0 draws it, the others take the terminal's
  progress callback, which draws on the world's process zero only.
- **The dashboard without a line of the function changed** (``observe``): steps from
  every optimizer step (torch's global step hook), memory by category from the
  optimizers' parameters, gradients and state, and the loss as the value
  ``backward()`` is called on (unscaled when a ``GradScaler`` scaled it). Frameworks'
  own logged metrics come through ``nbtrain.integrations``.
- **Whether the ranks trained together**: the collectives each rank issued on the
  run's group and the optimizer steps it took are reported (``wire.Activity``); the
  kernel tells a run whose ranks all stepped without a single collective so at the end.
"""

from __future__ import annotations

import contextlib
import inspect
import sys


@contextlib.contextmanager
def hosted(fn, ctx, observe_steps: bool):
    """Around the user's function in a worker; yields a dict filled with the activity
    (collectives on the run's group, optimizer steps) when the block ends."""
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    activity: dict[str, int] = {}
    undo: list = []
    try:
        _own_process_group(fn, ctx, undo)
        _not_interactive(undo)
        _one_progress_table(ctx.rank, undo)
        _reset_accelerate()
        steps = [0]

        def count(optimizer, args, kwargs):
            steps[0] += 1

        handle = register_optimizer_step_post_hook(count)
        undo.append(handle.remove)
        if ctx._recorder is not None:  # for nbtrain.integrations' callbacks
            from ..telemetry import active

            active.set_logger(lambda step, values: ctx._recorder.log(
                ctx.step if step is None else step, values))
            undo.append(lambda: active.set_logger(None))
        if observe_steps and ctx._recorder is not None:
            observe(ctx, undo)
        before = _sequence(dist)
        yield activity
        activity["collectives"] = max(0, _sequence(dist) - before)
        activity["optimizer_steps"] = steps[0]
    finally:
        for restore in reversed(undo):
            with contextlib.suppress(Exception):
                restore()


def _sequence(dist) -> int:
    """How many collectives were issued so far on the groups that span every rank: the
    default group and any a framework made of all ranks (DeepSpeed's data-parallel
    group); 0 without a process group."""
    if not dist.is_initialized():
        return 0
    try:
        world = dist.get_world_size()
        groups = list(dist.distributed_c10d._world.pg_map)
        return sum(int(g._get_sequence_number_for_group()) for g in groups
                   if g.size() == world)
    except Exception:
        return 0


# -- the function's own process group ---------------------------------------------------
def _own_process_group(fn, ctx, undo: list) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    init, destroy = c10d.init_process_group, c10d.destroy_process_group
    world = ctx.world_size
    on_cuda = ctx.device.type == "cuda"

    signature = inspect.signature(init)

    def init_process_group(*args, **kwargs):
        if not dist.is_initialized():
            return init(*args, **kwargs)
        given = signature.bind_partial(*args, **kwargs).arguments
        world_size, rank = given.get("world_size", -1), given.get("rank", -1)
        if world_size not in (-1, None, world) or rank not in (-1, None, ctx.rank):
            raise ValueError(
                f"init_process_group(world_size={world_size}, rank={rank}) inside "
                f"nbtrain.launch: this is rank {ctx.rank} of {world}. nbtrain started the "
                "process group already; leave out world_size and rank (or pass the ones "
                "of the run: RANK and WORLD_SIZE are set in the environment).")
        backend = str(given.get("backend") or "").lower()
        if "nccl" in backend and not on_cuda:
            raise RuntimeError(
                f"init_process_group({given['backend']!r}) on a CPU run: NCCL needs GPUs. "
                "Use 'gloo' here, or launch with accelerator='cuda'.")
        return None  # the run's group is the default group already

    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None  # the run's group: nbtrain ends it with the worker
        return destroy(group)

    replaced = {init: init_process_group, destroy: destroy_process_group}
    for module in (dist, c10d):
        for name, original in (("init_process_group", init),
                               ("destroy_process_group", destroy)):
            if getattr(module, name, None) is original:
                setattr(module, name, replaced[original])
                undo.append(lambda m=module, n=name, o=original: setattr(m, n, o))
    target = getattr(fn, "fn", fn)  # CallWithoutCtx holds the user's function
    namespace = getattr(target, "__globals__", None)
    if isinstance(namespace, dict):
        for name, value in list(namespace.items()):
            if value is init or value is destroy:
                namespace[name] = replaced[value]
                undo.append(lambda n=name, o=value: namespace.__setitem__(n, o))


# -- a worker, not a notebook -----------------------------------------------------------
def _not_interactive(undo: list) -> None:
    if hasattr(sys, "ps1"):
        ps1 = sys.ps1
        del sys.ps1
        undo.append(lambda: setattr(sys, "ps1", ps1))
    if "lightning" not in sys.modules and "pytorch_lightning" not in sys.modules:
        return  # the scan below costs ~10 ms in a kernel's thousands of modules
    for name, module in list(sys.modules.items()):
        if (name.startswith(("lightning", "pytorch_lightning"))
                and getattr(module, "_IS_INTERACTIVE", False) is True):
            module._IS_INTERACTIVE = False
            undo.append(lambda m=module: setattr(m, "_IS_INTERACTIVE", True))


def _one_progress_table(rank: int, undo: list) -> None:
    trainer = sys.modules.get("transformers.trainer")
    chosen = getattr(trainer, "DEFAULT_PROGRESS_CALLBACK", None)
    if rank == 0 or getattr(chosen, "__name__", "") != "NotebookProgressCallback":
        return
    from transformers.trainer_callback import ProgressCallback

    trainer.DEFAULT_PROGRESS_CALLBACK = ProgressCallback
    undo.append(lambda: setattr(trainer, "DEFAULT_PROGRESS_CALLBACK", chosen))


def _reset_accelerate() -> None:
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    with contextlib.suppress(Exception):
        state.AcceleratorState._reset_state(reset_partial_state=True)
    with contextlib.suppress(Exception):
        state.GradientState._reset_state()


# -- the dashboard for code that never touches ctx -------------------------------------
def observe(ctx, undo: list) -> None:
    """Steps, memory and loss from what any training loop does (see the module
    docstring)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    recorder = ctx._recorder
    recorder.adopt_start()

    def after_step(optimizer, args, kwargs):
        recorder.adopt(optimizer, args, kwargs)

    handle = register_optimizer_step_post_hook(after_step)
    undo.append(handle.remove)

    backward = torch.Tensor.backward

    def logged_backward(self, *args, **kwargs):
        if self.numel() == 1 and self.requires_grad:
            loss = getattr(self, "_nbtrain_unscaled", self)
            recorder.log(recorder.steps_taken, {"loss": loss})
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = logged_backward
    undo.append(lambda: setattr(torch.Tensor, "backward", backward))

    scale = torch.amp.GradScaler.scale

    def remembered_scale(self, outputs):
        scaled = scale(self, outputs)
        if isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor):
            with contextlib.suppress(Exception):
                scaled._nbtrain_unscaled = outputs
        return scaled

    torch.amp.GradScaler.scale = remembered_scale
    undo.append(lambda: setattr(torch.amp.GradScaler, "scale", scale))
