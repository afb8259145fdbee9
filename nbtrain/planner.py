"""``nbtrain.plan()``: will the model fit, and under which strategy, before the launch.

The function ``launch()`` would run is rehearsed in the kernel on the meta device, as
rank 0 of N, up to its second optimizer step (``rehearsal.py``): no GPU, no memory, no
data. From it, per rank (the fullest rank's):

- **params, grads, optimizer**: counted exactly from the parameters' sizes and the
  optimizer's state, shared storage once, by each strategy's own sharding
  (``Strategy.held``: FSDP's chunks of dim 0, ZeroRedundancyOptimizer's partition);
- **activations**: what the forward saves for backward, as ``Telemetry(profile_memory=
  True)`` measures it in a run;
- **peak**: the most bytes live at once in the step, temporaries included (the
  optimizer's step, for a model of small activations), with the model state at the
  strategy's share, plus what the strategy gathers beyond it (``Strategy.gathered``:
  FSDP's units). This is what a GPU's allocator sees; a CPU rank measures no such peak.

With ``mixed_precision=`` the step is rehearsed as each strategy casts: the forward under
autocast (ddp, zero1, DeepSpeed) or with FSDP's half-precision parameters
(``halfmeta.py``), by the autocast lists of the device fitted to (CUDA's with ``gpu=``).

FSDP is not traced under a process group (torch's ``FSDPMemTracker`` needs one; its fake
group lives in torch's test suite, and a default group made in the kernel would be the
kernel's): its gathers are counted from its units' sizes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from .rehearsal import Trace, rehearse
from .strategies.base import Strategy, normalize_precision, precision_dtype
from .strategies.registry import get
from .units import format_bytes

MiB = 1 << 20
# What each card's memory reads in NVML (nvidia-smi's total), in MiB.
GPUS = {"T4": 15360, "L4": 23034, "A10G": 23028, "P100": 16384, "V100-16GB": 16384,
        "V100-32GB": 32768, "A100-40GB": 40960, "A100-80GB": 81920, "H100": 81559,
        "H200": 143771}
# Cards without bf16 (before Ampere): mixed precision there is fp16
NO_BF16 = ("T4", "P100", "V100")
CONTEXT = 500 * MiB  # CUDA's context and torch's kernels, before the first tensor
MARGIN = 0.05  # of the rest: the caching allocator's rounding and fragmentation
# In the order one is picked: fewest bytes sent, no sharding unless needed, then the
# same with activation checkpointing (recomputing the forward costs a third more
# compute), offload last.
STRATEGIES = ("ddp", "zero1", "fsdp_grad_op", "fsdp", "fsdp_offload")
# DeepSpeed's stages, planned too when it is installed; picked after torch's own
DEEPSPEED = ("deepspeed_stage_1", "deepspeed", "deepspeed_stage_3",
             "deepspeed_stage_2_offload", "deepspeed_stage_3_offload")


def default_strategies() -> tuple[str, ...]:
    """``STRATEGIES``, and ``DEEPSPEED`` where DeepSpeed is installed."""
    return STRATEGIES + tuple(name for name in DEEPSPEED if get(name).installed())


@dataclass(frozen=True)
class Row:
    """One strategy's per-rank bytes (the fullest rank's) in a ``Plan``."""

    strategy: str
    checkpointing: bool
    params: float
    grads: float
    optimizer: float
    activations: float
    peak: float
    sent: float  # bytes one rank sends per step
    fits: bool | None  # None: no device to fit
    headroom: float | None  # usable memory minus peak
    offload: bool = False  # the model state lives in host memory (slowest, picked last)

    @property
    def name(self) -> str:
        return self.strategy + (" + checkpointing" if self.checkpointing else "")


@dataclass(frozen=True)
class Plan:
    """``nbtrain.plan()``'s answer: ``rows`` per strategy, ``pick`` the one to use."""

    rows: tuple[Row, ...]
    world_size: int
    device: str  # the device fitted to, in words ("" when none)
    usable: float | None  # its bytes for tensors
    bandwidth: float | None  # bytes/s a rank sends at, when given
    precision: str | None = None  # the mixed precision planned ("bf16", "fp16")
    refused: dict[str, str] = field(default_factory=dict)  # not planned: name -> why

    @property
    def pick(self) -> Row | None:
        """The first row, in ``STRATEGIES``' order (without, then with checkpointing,
        DeepSpeed's after torch's own, offload last), that fits; None when none does or
        there is no device."""
        fitting = [r for r in self.rows if r.fits]
        order = {name: i for i, name in enumerate(STRATEGIES + DEEPSPEED)}
        return min(fitting, key=lambda r: (r.offload, r.checkpointing,
                                           order.get(r.strategy, len(order))), default=None)

    def row(self, strategy: str, checkpointing: bool = False) -> Row:
        for r in self.rows:
            if r.strategy == strategy and r.checkpointing == checkpointing:
                return r
        raise KeyError(f"no row for {strategy!r}; the plan has {[r.name for r in self.rows]}")

    def beside(self, run) -> str:
        """What ``run`` (a finished launch of the planned function) measured per rank,
        the fullest rank's, beside this plan's row for its strategy."""
        strategy = run.strategy
        row = self.row(strategy.name, bool(strategy.activation_checkpointing))
        last = [events[-1].values for rank in sorted(run.rank_status)
                if (events := list(run.history.events("memory", rank)))]
        if not last:
            return f"{row.name}: the run sent no memory events (telemetry off?)."
        lines = [f"{row.name}, per rank: planned / measured"]
        for key in ("params", "grads", "optimizer", "activations"):
            got = max(v.get(key, 0) for v in last)
            if key == "activations" and not got:
                lines.append(f"  {key:12s} {format_bytes(row.activations)} / not measured "
                             "(launch with telemetry=nbtrain.Telemetry(profile_memory=True))")
                continue
            ratio = f" ({getattr(row, key) / got:.3f})" if got else ""
            lines.append(f"  {key:12s} {format_bytes(getattr(row, key))} / "
                         f"{format_bytes(got)}{ratio}")
        peaks = [e.values["cuda_peak"] for rank in sorted(run.rank_status)  # per step
                 for e in run.history.events("memory", rank) if "cuda_peak" in e.values]
        if peaks:
            lines.append(f"  {'peak':12s} {format_bytes(row.peak)} / {format_bytes(max(peaks))} "
                         f"({row.peak / max(peaks):.3f})")
        return "\n".join(lines)

    def sentence(self) -> str:
        if self.usable is None:
            return (f"On {self.world_size} ranks, per rank: the least peak is "
                    f"{format_bytes(min(r.peak for r in self.rows))} "
                    f"({min(self.rows, key=lambda r: r.peak).name}). Give gpu='T4' (or "
                    "bytes) to know what fits.")
        pick = self.pick
        if pick is None:
            least = min(self.rows, key=lambda r: r.peak)
            return (f"Nothing fits {self.device} ({format_bytes(self.usable)} usable): the "
                    f"least peak, {least.name}, needs {format_bytes(least.peak)} a rank. "
                    "Use more devices, a smaller batch or mixed precision.")
        others = [r.name for r in self.rows if r.fits and r is not pick]
        return (f"Use {pick.name}: its peak of {format_bytes(pick.peak)} a rank fits "
                f"{self.device} ({format_bytes(self.usable)} usable) with "
                f"{format_bytes(pick.headroom)} to spare"
                + (f"; also fit: {', '.join(others)}." if others else "; nothing else fits."))

    def _of(self) -> str:
        return (f"; {self.precision} mixed precision: fp32 weights, gradients and optimizer "
                f"state, {self.precision} compute" if self.precision else "")

    def _cells(self, r: Row) -> list[str]:
        cells = [r.name, *(format_bytes(v) for v in (r.params, r.grads, r.optimizer,
                                                      r.activations, r.peak)),
                 format_bytes(r.sent)]
        if self.bandwidth:
            cells.append(f"{r.sent / self.bandwidth * 1e3:.1f} ms")
        if self.usable is not None:
            cells.append(("fits, " if r.fits else "too big by ")
                         + format_bytes(abs(r.headroom)))
        return cells

    def _header(self) -> list[str]:
        head = ["strategy", "params", "grads", "optimizer", "activations", "peak",
                "sent/step"]
        return head + (["comm ≥"] if self.bandwidth else []) + (
            [f"on {self.device}"] if self.usable is not None else [])

    def __str__(self) -> str:
        table = [self._header(), *(self._cells(r) for r in self.rows)]
        widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                 for line in table]
        return self.sentence() + "\n\n" + "\n".join(lines) + \
            f"\n(bytes per rank, the fullest rank's; peak: the most live at once in a step{self._of()})" \
            + "".join(f"\nnot planned: {', '.join(n for n in self.refused if self.refused[n] == why)}"
                      f" ({why})" for why in dict.fromkeys(self.refused.values()))

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        import html
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._header())
        body = "".join(
            "<tr style='{}'>".format("" if r.fits is not False else "color:#b00")
            + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>"
            for r in self.rows)
        return (f"<p>{html.escape(self.sentence())}</p><table><tr>{head}</tr>{body}</table>"
                "<p style='font-size:smaller'>bytes per rank (the fullest rank's); peak: "
                f"the most memory live at once in a training step{html.escape(self._of())}</p>")


def _row(name: str, strategy: Strategy, trace: Trace, world_size: int, checkpointing: bool,
         usable: float | None) -> Row:
    whole = {"params": sum(s.param_bytes for s in trace.sizes),
             "grads": sum(s.grad_bytes for s in trace.sizes),
             "optimizer": sum(s.state_bytes + s.state_fixed for s in trace.sizes)}
    held = strategy.held(trace.sizes, world_size)
    at_peak = trace.peak
    # the step's peak with the model state at this strategy's share (the optimizer's
    # temporaries in its step scale with the state it steps)
    peak = at_peak.get("total", 0.0)
    for kind, key in (("params", "params"), ("grad", "grads"), ("opt", "optimizer")):
        share = held[key] / whole[key] if whole[key] else 1.0
        peak -= (whole[key] if kind == "params" else at_peak[kind]) * (1 - share)
    peak += strategy.gathered(trace.model, world_size)
    fits = None if usable is None else peak <= usable
    return Row(name, checkpointing, held["params"], held["grads"], held["optimizer"],
               trace.activations, peak, strategy.sent(trace.model, world_size), fits,
               None if usable is None else usable - peak, bool(getattr(strategy, "offload", False)))


def usable_bytes(gpu) -> tuple[str, float | None]:
    """(the device in words, the bytes its tensors can use) for ``gpu=``: a name in
    ``GPUS``, bytes, or None for the visible GPU (NVML; ("", None) without one)."""
    if gpu is None:
        from .launch.starting.devices import gpu_memory

        found = gpu_memory(0)
        if found is None:
            return "", None
        name, total = found
    elif isinstance(gpu, str):
        key = {k.lower(): k for k in GPUS}.get(gpu.strip().lower())
        if key is None:
            raise ValueError(f"gpu={gpu!r} is not one nbtrain knows; give one of "
                             f"{', '.join(GPUS)}, or its memory in bytes (gpu=16 * 2**30).")
        name, total = key, GPUS[key] * MiB
    elif isinstance(gpu, (int, float)) and not isinstance(gpu, bool) and gpu > CONTEXT:
        name, total = f"a {format_bytes(gpu)} device", float(gpu)
    else:
        raise ValueError(f"gpu={gpu!r}: give a GPU's name ({', '.join(GPUS)}) or its "
                         f"memory in bytes, more than CUDA's context ({format_bytes(CONTEXT)}).")
    return name, (total - CONTEXT) * (1 - MARGIN)


def plan(fn: Callable, *args, devices: int | str | list[int] = 2,
         gpu: str | float | None = None, strategies: tuple[str, ...] | None = None,
         checkpointing: bool = True, bandwidth: float | None = None,
         accelerator: str = "auto", **kwargs) -> Plan:
    """Per rank, before any launch: the bytes of parameters, gradients, optimizer state,
    activations and a training step's peak under each strategy, which fit ``gpu`` (a
    name such as ``"T4"``, bytes, or by default the visible GPU) and the one to use::

        nbtrain.plan(train, devices=2, gpu="T4")

    ``fn``, ``*args``, ``devices`` and ``**kwargs`` as ``launch()`` takes them (a strategy
    option such as ``activation_checkpointing=`` applies to every strategy planned; the
    run's own options, ``timeout=``, ``dashboard=``, ..., are taken and change nothing);
    ``fn`` is rehearsed on the meta device up to its second optimizer step (module
    docstring). ``strategies``: the names to plan (by default ``STRATEGIES``, and
    DeepSpeed's stages where it is installed).
    ``checkpointing``: also plan each with activation checkpointing of the model's
    blocks. ``bandwidth``: the bytes/s a rank sends at (``nbtrain.bandwidth``'s bus
    bandwidth, or a link's ceiling) gives the least time a step's communication takes."""
    from .launch.calls import options_of
    from .launch.options import NAMES
    from .launch.starting.devices import parse_devices

    world_size = parse_devices(devices, accelerator).world_size
    if world_size < 2:
        raise ValueError(f"devices={devices!r}: a plan compares ways to share a model "
                         "among ranks; give 2 or more.")
    if bandwidth is not None and not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
        raise ValueError(f"bandwidth={bandwidth!r} must be bytes per second, > 0.")
    device, usable = usable_bytes(gpu)
    seed = kwargs.pop("seed", None) or 0
    kwargs = {k: v for k, v in kwargs.items() if k not in NAMES}
    chosen = {name: get(name) for name in (strategies or default_strategies())}
    named = _parameters(fn)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in named and any(
        k in options_of(s) for s in chosen.values())}
    if "precision" in kwargs and "precision" not in named:  # Lightning's spelling
        options["mixed_precision"] = kwargs.pop("precision")
    precision = normalize_precision(options.pop("mixed_precision", None))
    if precision == "bf16" and any(card in device for card in NO_BF16):
        raise ValueError(f"mixed_precision='bf16' on a {device}: it has no bf16 (GPUs from "
                         "Ampere on do), so torch would emulate it, slowly. Plan (and train) with "
                         "mixed_precision='fp16' there.")
    made, refused = {}, {}
    for name, s in chosen.items():
        try:
            made[name] = get(name, **{k: v for k, v in options.items() if k in options_of(s)},
                             **({"mixed_precision": precision} if precision else {}))
        except ValueError as err:  # a strategy that refuses the precision: named, it says why
            if strategies or not precision:
                raise
            refused[name] = str(err).split(": ")[0]
    chosen = made
    # the lists of a GPU's autocast when fitting one, else the ranks' own
    device_type = "cuda" if usable is not None or accelerator == "cuda" else "cpu"
    how = {name: s.half_by if precision else None for name, s in chosen.items()}
    given = options.get("activation_checkpointing")
    wanted = [bool(given)] + ([True] if checkpointing and not given else [])
    traces: dict[tuple[bool, str | None], Trace] = {}
    for ckpt in wanted:
        for way in sorted(set(how.values()), key=str):
            half = (way, precision_dtype(precision), device_type) if way else None
            try:
                traces[ckpt, way] = rehearse(fn, args, kwargs, world_size,
                                             given if ckpt == bool(given) else "auto", seed,
                                             half)
            except ValueError as err:
                if not ckpt or given or "block" not in str(err):
                    raise  # a model without blocks to checkpoint: no rows
    rows = tuple(_row(name, strategy, traces[ckpt, how[name]], world_size, ckpt, usable)
                 for ckpt in wanted for name, strategy in chosen.items()
                 if (ckpt, how[name]) in traces)
    return Plan(rows, world_size, device, usable, bandwidth, precision, refused)


def _parameters(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


__all__ = ["DEEPSPEED", "GPUS", "STRATEGIES", "Plan", "Row", "plan"]
