"""DeepSpeed ZeRO under Lightning's names (``deepspeed``, ``deepspeed_stage_1`` ...
``deepspeed_stage_3_offload``), run through nbtrain's ``ctx``.

``ctx.setup(model, opt)`` hands both to ``deepspeed.initialize`` and returns its engine
(an ``nn.Module``: call it as the model) and an optimizer whose ``step()`` is the
engine's step and whose ``zero_grad()`` the engine's; ``ctx.backward(loss)`` is the
engine's backward. The training function does not change.

The config is nbtrain's defaults with the user's own (``config=``, a dict or a JSON
path) merged over them: the stage, offload of the optimizer (stages 1-3) and of the
parameters (stage 3) to CPU memory, Lightning's bucket sizes (2e8; DeepSpeed's 5e8 makes
stage 3 allocate 2 GB up front), a torch optimizer allowed as it is (with offload too:
``zero_force_ds_cpu_optimizer`` off, so no native Adam is compiled). ``bf16`` computes
under ``torch.autocast`` with fp32 weights, as nbtrain's other strategies do
(DeepSpeed's ``torch_autocast``). DeepSpeed's shared-memory all-reduce op, which only its
own launcher uses and which costs a 100 s C++ build on first use, is turned off.

``ctx.accumulate`` and ``ctx.no_backward_sync`` move DeepSpeed's gradient-accumulation
boundary (stage 1 reduces once, at the last micro-step; stages 2 and 3 reduce-scatter
every backward, keeping only their partition). ``ctx.clip_grad_norm_`` returns the norm
of the whole model's reduced gradients, read from DeepSpeed's partitions, and DeepSpeed's
step clips with it. ``ctx.save``/``ctx.load`` write and read torch's keys (those of a
DDP/FSDP model and its optimizer), gathered from and scattered to DeepSpeed's
partitions one parameter at a time, so checkpoints move between DeepSpeed, the other
strategies and a plain model. fp16 is refused at setup (its loss scaling is not wired;
bf16 is). ``ctx.init_module()`` gives the values plain construction gives; the model is
materialised whole on each rank before DeepSpeed partitions it (stage 3's ``zero.Init``,
which never holds it whole, is not used yet).

The rooms: ``strategy`` (options, config, the hooks ``ctx`` calls), ``optimizer`` (the
optimizer the function holds), ``state`` (memory and state dicts read from DeepSpeed's
partitions), ``runtime`` (importing DeepSpeed, its native ops, releasing it).
"""

from .optimizer import EngineOptimizer, is_engine
from .runtime import INSTALL, MINIMUM, available, import_deepspeed, installed_version, release
from .strategy import BUCKET, STAGE3_ORDER, DeepSpeed, merge

__all__ = ["BUCKET", "INSTALL", "MINIMUM", "STAGE3_ORDER", "DeepSpeed", "EngineOptimizer",
           "available", "import_deepspeed", "installed_version", "is_engine", "merge",
           "release"]
