"""Mixed precision for ``nbtrain.plan()``'s rehearsal, on meta tensors.

torch's autocast has no meta device (``torch.autocast("meta")`` is refused, and a meta
tensor carries no CPU or CUDA autocast key), so the rehearsal casts as the run will, one
Python-level call at a time (a ``TorchFunctionMode``), inside the model's forward:

- ``"autocast"`` (ddp, zero1, DeepSpeed: the forward under ``torch.autocast``): the calls
  autocast runs in half precision get their floating inputs cast to it, those it runs in
  fp32 get fp32, by torch's own lists (``AT_FORALL_LOWER_PRECISION_FP`` and ``..._FP32``
  of ``ATen/autocast_mode.h`` for CUDA, and CPU's in ``autocast_mode.cpp``); a weight's
  cast is made once per forward and kept, as autocast's cache does (so it is saved for
  backward, and a run's activation probe counts it);
- ``"params"`` (FSDP's ``MixedPrecisionPolicy(param_dtype=...)``): the parameters are
  used in half precision and the forward's floating inputs are cast to it; the rest
  follows torch's type promotion. The half copies are leaves, as FSDP's unsharded
  parameters are (not activations; the planner counts them as gathered), and their
  gradients reach the fp32 parameters as fp32 (FSDP reduces in fp32). Norm layers with
  running statistics stay fp32 inside, as nbtrain's FSDP keeps them (``norms.py``).

A call is cast by its own name, as the model makes it: inside a Python-level function
torch's lists do not name, its calls are not seen (the mode is off while a call it saw
runs), so ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) is listed as
its linears are.

The forward's region is entered by the model's forward and by each checkpointed block's
(its recomputation in backward runs outside the first, and without this mode on the
stack: torch's checkpoint restores a real autocast's state there, not this one's; the
block's hooks enter it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_map

from .strategies import norms

# CUDA's lists (ATen/autocast_mode.h, the Python-level names of the ops they name)
CUDA_HALF = frozenset((
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "_convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention", "multi_head_attention_forward"))
CUDA_FP32 = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "rms_norm",
    "group_norm", "norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "cross_entropy",  # log_softmax + nll_loss
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d"))
# computed in fp32 without a copy of the input (autocast sets their dtype=)
CUDA_FP32_DTYPE = frozenset(("prod", "softmax", "log_softmax", "cumprod", "cumsum",
                             "linalg_vector_norm", "linalg_matrix_norm", "sum"))
# CPU's (autocast_mode.cpp: fewer in half precision, norms and softmax left as they come)
CPU_HALF = frozenset((
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm",
    "linear", "_convolution", "matmul", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "multi_head_attention_forward",
    "einsum", "tensordot"))  # not listed, but made of bmm/mm, which are cast
CPU_FP32 = frozenset((
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile",
    "nanquantile", "stft", "cdist", "trace", "max_pool3d", "adaptive_avg_pool3d",
    "mse_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss",
    "poisson_nll_loss", "smooth_l1_loss", "cross_entropy", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "ctc_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits"))
ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow",
           "__rpow__": "pow", "float_power": "pow"}
LISTS = {"cuda": (CUDA_HALF, CUDA_FP32, CUDA_FP32_DTYPE), "cpu": (CPU_HALF, CPU_FP32, ())}


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class HalfMeta(TorchFunctionMode):
    """The rehearsal's mixed precision (module docstring): ``how`` is ``"autocast"``
    or ``"params"``, ``dtype`` the half type, ``device_type`` whose autocast lists."""

    def __init__(self, how: str, dtype: torch.dtype, device_type: str = "cuda",
                 aside=contextlib.nullcontext):
        super().__init__()
        if how not in ("autocast", "params"):
            raise ValueError(f"how={how!r}: 'autocast' or 'params'")
        self.how, self.dtype = how, dtype
        self.aside = aside  # a context in which the half parameters are made uncounted
        self.half, self.fp32, self.fp32_dtype = LISTS["cuda" if device_type == "cuda"
                                                     else "cpu"]
        self.depth = 0
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._params: set[int] = set()
        self._inside_fp32 = 0
        self._pushed: list[bool] = []

    # -- where it applies
    def watch(self, model: nn.Module, blocks=()) -> None:
        """Cast inside ``model``'s forward and each of ``blocks``' (checkpointed ones)."""
        self._params = {id(p) for p in model.parameters()}
        for m in (model, *blocks):
            m.register_forward_pre_hook(self._enter, with_kwargs=True)
            m.register_forward_hook(self._leave, always_call=True)
        if self.how == "params":
            for norm in norms.with_statistics(model):
                norm.register_forward_pre_hook(self._fp32_enter)
                norm.register_forward_hook(self._fp32_leave, always_call=True)

    def _enter(self, module, args, kwargs):
        # a checkpointed block recomputed in backward: the mode is not on the stack there
        self._pushed.append(self not in _get_current_function_mode_stack())
        if self._pushed[-1]:
            self.__enter__()
        self.depth += 1
        if self.how == "params" and self.depth == 1:  # cast_forward_inputs
            return tree_map(self._to_half_input, (args, kwargs))
        return None

    def _leave(self, module, args, output) -> None:
        self.depth -= 1
        if self.depth == 0:
            self._cache.clear()
        if self._pushed.pop():
            self.__exit__(None, None, None)

    def _fp32_enter(self, module, args):
        self._inside_fp32 += 1
        return tree_map(lambda t: t.float() if _floating(t) else t, args)

    def _fp32_leave(self, module, args, output):
        self._inside_fp32 -= 1
        return tree_map(lambda t: t.to(self.dtype) if _floating(t) else t, output)

    def _to_half_input(self, t):
        return t.to(self.dtype) if _floating(t) and t.dtype == torch.float32 else t

    # -- the casts
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth and not self._inside_fp32:
            name = getattr(func, "__name__", "")
            name = ALIASES.get(name, name)
            if self.how == "params":
                args, kwargs = tree_map(self._param_half, (args, kwargs))
            elif name in self.half:
                args, kwargs = tree_map(self._autocast_half, (args, kwargs))
                return func(*args, **kwargs)
            elif name in self.fp32:
                args, kwargs = tree_map(lambda t: t.float() if _floating(t) else t,
                                        (args, kwargs))
                return func(*args, **kwargs)
            elif name in self.fp32_dtype and "dtype" not in kwargs and any(
                    _floating(t) and t.dtype != torch.float32 for t in args[:1]):
                return func(*args, **kwargs, dtype=torch.float32)
        return func(*args, **kwargs)

    def _autocast_half(self, t):
        if not _floating(t) or t.dtype == self.dtype:
            return t
        if t.requires_grad and t.is_leaf and t._base is None:  # a weight: once a forward
            key = id(t)
            if key not in self._cache:
                self._cache[key] = (t, t.to(self.dtype))
            return self._cache[key][1]
        return t.to(self.dtype)

    def _param_half(self, t):
        if not (isinstance(t, torch.Tensor) and id(t) in self._params and _floating(t)):
            return t
        key = id(t)
        if key not in self._cache:
            with self.aside():
                half = t.detach().to(self.dtype).requires_grad_(t.requires_grad)
            if t.requires_grad:
                half.register_post_accumulate_grad_hook(_to_master(t))
            self._cache[key] = (t, half)
        return self._cache[key][1]


def _to_master(param: torch.Tensor):
    """The half copy's gradient onto its fp32 parameter, as fp32 (FSDP's reduce_dtype)."""

    def hook(half: torch.Tensor) -> None:
        grad, half.grad = half.grad.to(param.dtype), None
        param.grad = grad if param.grad is None else param.grad + grad
    return hook


@contextlib.contextmanager
def half_meta(how: str | None, dtype: torch.dtype | None, device_type: str,
              aside=contextlib.nullcontext) -> Iterator[HalfMeta | None]:
    """``HalfMeta`` entered, or None (and nothing) for fp32."""
    if how is None or dtype is None:
        yield None
        return
    with HalfMeta(how, dtype, device_type, aside) as mode:
        yield mode
