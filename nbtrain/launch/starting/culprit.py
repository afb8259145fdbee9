"""What touched CUDA in this kernel, so the fork guard can say so.

The guard (``guards.py``) finds *that* a forked worker could not use CUDA; this module
remembers *where* that came from, because "Cannot re-initialize CUDA in forked
subprocess" with nothing to go on is what notebook users of every launcher meet. It is
installed at ``import nbtrain`` and costs nothing while nobody touches CUDA:

- **Through torch.** ``torch.cuda._lazy_init`` (every tensor or module put on a GPU and
  every ``torch.cuda`` call that needs the driver: torch's C++ calls it by name) and
  ``torch._C._cuda_getDeviceCount`` (``torch.cuda.is_available()`` and ``device_count()``
  when NVML cannot answer; it marks every later fork bad) are wrapped. The first call
  records the frame it came from — a notebook cell and line, or the library file that
  made it — and the wrappers take themselves out again.
- **Behind torch** (CuPy, JAX, Numba, a C++ extension, or torch's own C++ called without
  its lazy init): the driver's state is read in this process without changing it
  (``cuDeviceGetCount`` answers "not initialised" until someone calls ``cuInit``), at
  import ("before nbtrain was imported") and, in IPython, after every cell until it
  changes: that names the cell and the CUDA libraries it imported.
- **Two known culprits are defused**, both asking whether a CUDA graph is being captured:
  ``torch.cuda.is_current_stream_capturing()``, which transformers calls in every forward
  pass (``is_tracing``), and every optimizer's ``step()`` (its graph-capture health
  check; torch 2.8 and later ask ``torch.accelerator`` for the current stream). Each
  initialises the driver from C++ without telling torch (``torch.cuda.is_initialized()``
  stays False), so trying a Hugging Face model, or one training step of any model, on the
  CPU in a cell made every later launch start from the fork server (seen on an H100). No
  stream can be capturing before torch has initialised CUDA in this process, so until
  then the answer is "not capturing", without the driver.
- ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless set): ``torch.cuda.is_available()``, the
  first cell of many notebooks, then asks NVML, which leaves fork safe, as accelerate's
  ``notebook_launcher`` arranges for its own check.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import linecache
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ...errors import cell_label, filename_map

# Libraries that use the CUDA driver directly (not through torch): named when the driver
# was initialised behind torch. Top-level module names as they appear in sys.modules.
CUDA_LIBRARIES = ("cupy", "jax", "jaxlib", "numba.cuda", "pycuda", "tensorflow",
                  "cuda.bindings", "cuda.core", "tensorrt", "cudf", "rmm", "cuml",
                  "triton", "bitsandbytes", "xformers", "flash_attn", "apex", "vllm",
                  "nvidia.dali", "onnxruntime", "ctranslate2", "llama_cpp", "tinygrad")


@dataclasses.dataclass(frozen=True)
class Touch:
    """One way CUDA was reached: ``what`` happened, ``where`` ("at Cell In[3], line 2",
    "during Cell In[5]", "before nbtrain was imported"), and the ``code`` on that line
    when it is known."""

    what: str
    where: str
    code: str = ""

    def __str__(self) -> str:
        return f"{self.what} {self.where}" + (f": `{self.code}`" if self.code else "")


# The first touch through torch, the first sign of the driver initialised behind torch,
# and whether the driver was already initialised when nbtrain was imported.
_through_torch: Touch | None = None
_behind_torch: Touch | None = None
_driver_before_import = False


def through_torch() -> Touch | None:
    return _through_torch


def behind_torch() -> Touch | None:
    if _behind_torch is None and _driver_before_import:
        return Touch("the CUDA driver was initialised", "before nbtrain was imported")
    return _behind_torch


# -- the driver's state, read without changing it --------------------------------------------
_driver: Any = None


def driver_initialised() -> bool:
    """Has something in this process called ``cuInit``? False while libcuda is not even
    loaded (it is not loaded here for that: RTLD_NOLOAD)."""
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):  # not loaded (or no RTLD_NOLOAD: not Linux)
            return False
    count = ctypes.c_int()
    return _driver.cuDeviceGetCount(ctypes.byref(count)) == 0  # 3: not initialised


# Tests put a fake here.
DRIVER_STATE: Callable[[], bool] = driver_initialised


# -- where a call came from ------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # nbtrain/


def caller(frame) -> tuple[str, str]:
    """``("at <where>", code)`` for the first frame from ``frame`` outwards that is
    neither torch nor nbtrain, with the notebook cell it was reached from when that is
    another frame."""
    cells = filename_map()
    own = None
    cell = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _HERE)):
            if own is None:
                own = frame
            if cell_label(filename, cells) is not None:
                cell = frame  # keep walking: the outermost cell frame is the user's line
        frame = frame.f_back
    if own is None:
        return "inside torch, where nbtrain could not see who called", ""
    where, code = _place(own, cells)
    if cell is not None and cell is not own:
        cell_where, cell_code = _place(cell, cells)
        where += f", called from {cell_where}" + (f": `{cell_code}`" if cell_code else "")
        code = ""  # the library's own line says less than the cell's
    return f"at {where}", code


def _place(frame, cells: dict[str, int]) -> tuple[str, str]:
    filename, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(filename, line).strip()
    label = cell_label(filename, cells)
    if label is not None:
        return f"{label}, line {line}", code
    for root in sorted((p for p in sys.path if p), key=len, reverse=True):
        if filename.startswith(root.rstrip(os.sep) + os.sep):
            filename = filename[len(root.rstrip(os.sep)) + 1:]
            break
    return f"{filename}:{line}", code


# -- the wrappers ------------------------------------------------------------------------------
_installed: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to restore


def _record(what: str) -> None:
    global _through_torch
    if _through_torch is None:
        where, code = caller(sys._getframe(2))
        _through_torch = Touch(what, where, code)
        _restore()


def _restore() -> None:
    while _installed:
        owner, name, original = _installed.pop()
        if getattr(owner, name, None) is not original:
            setattr(owner, name, original)


def watch(owner: Any, name: str, what: str, owners: tuple = ()) -> None:
    """Record the first call of ``owner.name`` (and of the same function bound as
    ``name`` in ``owners``) as ``what``."""
    original = getattr(owner, name, None)
    if original is None:
        return

    def watched(*args, **kwargs):
        _record(what)
        return original(*args, **kwargs)

    watched.__wrapped__ = original
    for where in (owner, *owners):
        if getattr(where, name, None) is original:
            _installed.append((where, name, original))
            setattr(where, name, watched)


def _not_capturing_before_init(original):
    @functools.wraps(original)
    def is_current_stream_capturing() -> bool:
        if not torch.cuda.is_initialized():
            return False  # no stream of torch's exists yet, so none is capturing
        return original()

    return is_current_stream_capturing


def _no_capture_check_before_init(original):
    @functools.wraps(original)
    def graph_capture_health_check(self) -> None:
        if not torch.cuda.is_initialized():
            return  # no stream of torch's exists yet, so no capture to check
        return original(self)

    return graph_capture_health_check


def _defuse(owner: Any, name: str, make) -> None:
    original = getattr(owner, name, None)
    if original is not None and not hasattr(original, "__wrapped__"):
        setattr(owner, name, make(original))


def defuse() -> None:
    """Questions about CUDA graph capture answered without the driver until torch has
    initialised CUDA (see the module docstring)."""
    capturing = getattr(torch.cuda, "is_current_stream_capturing", None)
    _defuse(torch.cuda, "is_current_stream_capturing", _not_capturing_before_init)
    graphs = sys.modules.get("torch.cuda.graphs")
    if graphs is not None and getattr(graphs, "is_current_stream_capturing", None) is capturing:
        graphs.is_current_stream_capturing = torch.cuda.is_current_stream_capturing
    optimizer = torch.optim.Optimizer
    # torch 2.8 and later: _accelerator_...; _cuda_... is then a deprecated alias of it
    name = "_accelerator_graph_capture_health_check" if hasattr(
        optimizer, "_accelerator_graph_capture_health_check") \
        else "_cuda_graph_capture_health_check"
    _defuse(optimizer, name, _no_capture_check_before_init)


def install() -> None:
    """At ``import nbtrain``, once per process."""
    global _driver_before_import
    if getattr(install, "done", False):
        return
    install.done = True
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not torch.backends.cuda.is_built():
        return  # a CPU build of torch: nothing of torch's can touch CUDA
    _driver_before_import = DRIVER_STATE()
    if torch.cuda.is_initialized():
        global _through_torch
        _through_torch = Touch("CUDA was initialised", "before nbtrain was imported")
    else:
        cuda_modules = tuple(m for n, m in list(sys.modules.items())  # (other threads import)
                             if n.startswith("torch.cuda.") and m is not None)
        watch(torch.cuda, "_lazy_init", "a GPU was first used", cuda_modules)
        watch(torch._C, "_cuda_getDeviceCount",
              "torch.cuda.is_available() or device_count() asked the CUDA runtime")
    defuse()
    watch_cells()


# -- the driver, cell by cell ------------------------------------------------------------------
def watch_cells(shell=None) -> None:
    """In IPython: after each cell, until the driver is found initialised, check it; the
    cell that initialised it is recorded with the CUDA libraries it imported."""
    if shell is None:
        if "IPython" not in sys.modules:
            return
        from IPython import get_ipython

        shell = get_ipython()
    if shell is None or not hasattr(shell, "events") or behind_torch() is not None:
        return
    start = [len(sys.modules)]

    def before(*_):
        start[0] = len(sys.modules)

    def after(result=None, *_):
        global _behind_torch
        if not DRIVER_STATE():
            return
        if _through_torch is None:  # else torch's own call explains it
            number = getattr(result, "execution_count", None) or shell.execution_count
            new = list(sys.modules)[start[0]:]
            _behind_torch = Touch("the CUDA driver was initialised",
                                  f"during Cell In[{number}]" + _libraries(new))
        for event, callback in (("pre_run_cell", before), ("post_run_cell", after)):
            try:
                shell.events.unregister(event, callback)
            except ValueError:
                pass

    shell.events.register("pre_run_cell", before)
    shell.events.register("post_run_cell", after)


def _libraries(new_modules: list[str]) -> str:
    """Which CUDA libraries a cell imported (or, if none, which are loaded at all)."""
    def cuda(names):
        return [lib for lib in CUDA_LIBRARIES if lib in names]

    imported = cuda(set(new_modules))
    if imported:
        return f" (it imported {', '.join(imported)})"
    loaded = cuda(sys.modules)
    return f" (CUDA libraries loaded: {', '.join(loaded)})" if loaded else ""


def torch_culprit() -> str:
    """Where CUDA was first reached through torch, as the guard's message says it."""
    touch = through_torch()
    return str(touch) if touch is not None else \
        "before nbtrain was imported, or where nbtrain could not see"


def driver_culprit() -> str:
    """Where the driver was initialised behind torch, as the guard's message says it."""
    touch = behind_torch()
    if touch is not None:
        return touch.where
    return ("after nbtrain was imported, outside a notebook cell (in a notebook, nbtrain "
            "names the cell)")
