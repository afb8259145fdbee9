"""Naming what touched CUDA (launch/starting/culprit.py), on the CPU with fakes: a fake torch entry
point watched as torch's are, a fake driver state flipped by a cell, and torch's own C++
path to ``torch.cuda._lazy_init`` (a CPU build raises in it, after the watcher saw it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from kernel import Kernel

from nbtrain.launch.starting import culprit, devices, guards, launchers

pytestmark = pytest.mark.kernel

WATCH_A_FAKE = """
import sys, types
from nbtrain.launch.starting import culprit
fake = types.SimpleNamespace(_lazy_init=lambda: "inited")
culprit.watch(fake, "_lazy_init", "a GPU was first used")
"""

LIBRARY = """
def build(fake):
    return fake._lazy_init()
"""


def test_a_torch_touch_names_the_cell_and_line_and_the_library_between(tmp_path):
    (tmp_path / "somelib.py").write_text(LIBRARY)
    kernel = Kernel(startup=f"import nbtrain\nimport sys; sys.path.insert(0, {str(tmp_path)!r})")
    try:
        assert kernel.run(WATCH_A_FAKE).error is None
        reply = kernel.run("import somelib\nx = 1\nsomelib.build(fake)")
        assert reply.error is None, reply.error
        number = reply.execution_count  # the cell's In[N]
        said = kernel.value("culprit.torch_culprit()")
        assert said == (f"a GPU was first used at somelib.py:3, called from Cell In[{number}], "
                        "line 3: `somelib.build(fake)`"), said
        # the watcher took itself out after the first call, and the call went through
        assert kernel.value("(hasattr(fake._lazy_init, '__wrapped__'), fake._lazy_init())") \
            == (False, "inited")
    finally:
        kernel.shutdown()


def test_a_cell_that_initialises_the_driver_behind_torch_is_named():
    kernel = Kernel(startup="import nbtrain")
    try:
        assert kernel.run("import sys, types\nfrom nbtrain.launch.starting import culprit\n"
                          "state = [False]\nculprit.DRIVER_STATE = lambda: state[0]\n"
                          "culprit.watch_cells()").error is None
        assert kernel.run("import colorsys").error is None  # nothing happens to the driver
        assert kernel.value("culprit.behind_torch() is None") is True
        # what CuPy's import and first array would do: a CUDA library, the driver initialised
        reply = kernel.run("sys.modules['cupy'] = types.ModuleType('cupy')\nstate[0] = True")
        assert reply.error is None, reply.error
        number = reply.execution_count
        said = kernel.value("culprit.driver_culprit()")
        assert said == f"during Cell In[{number}] (it imported cupy)", said
        kernel.run("del sys.modules['cupy']")  # later cells change nothing: it is recorded
        assert kernel.value("culprit.driver_culprit()") == said
        assert kernel.value("len(get_ipython().events.callbacks['post_run_cell'])") == \
            kernel.value("len([c for c in get_ipython().events.callbacks['post_run_cell'] "
                         "if 'culprit' not in getattr(c, '__module__', '')])")
    finally:
        kernel.shutdown()


@pytest.fixture
def gpu_machine(monkeypatch):
    """A CUDA build of torch with two GPUs counted through NVML."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(devices, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_the_fork_guard_names_the_touch_in_its_warning_and_refusal(gpu_machine, monkeypatch):
    touch = culprit.Touch("a GPU was first used", "at Cell In[7], line 2", "model.cuda()")
    monkeypatch.setattr(culprit, "_through_torch", touch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(RuntimeWarning) as caught:
        assert launchers.choose_start_method("auto") == "forkserver"
    assert "torch has initialised CUDA in this kernel (a GPU was first used at Cell In[7], " \
           "line 2: `model.cuda()`)" in str(caught[0].message)
    with pytest.raises(RuntimeError, match=r"at Cell In\[7\], line 2"):
        launchers.choose_start_method("fork")


def test_the_forked_canary_names_the_query_it_inherited(gpu_machine, monkeypatch):
    """The canary is a fork: it reads the kernel's record from its copy of the memory."""
    touch = culprit.Touch("torch.cuda.is_available() or device_count() asked the CUDA "
                          "runtime", "at Cell In[2], line 1", "torch.cuda.is_available()")
    monkeypatch.setattr(culprit, "_through_torch", touch)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)  # in the child
    reason = guards.fork_unsafe_reason("cuda")
    assert reason == ("CUDA was queried through torch in this kernel (torch.cuda.is_available() "
                      "or device_count() asked the CUDA runtime at Cell In[2], line 1: "
                      "`torch.cuda.is_available()`), and forked children cannot use CUDA "
                      "after that"), reason


def test_the_driver_behind_torch_is_named_or_said_unseen(monkeypatch):
    monkeypatch.setattr(culprit, "_behind_torch", None)
    monkeypatch.setattr(culprit, "_driver_before_import", True)
    assert culprit.driver_culprit() == "before nbtrain was imported"
    monkeypatch.setattr(culprit, "_driver_before_import", False)
    assert "outside a notebook cell" in culprit.driver_culprit()


def test_the_driver_state_is_read_without_loading_the_driver():
    """No libcuda here: the answer is False and libcuda stays unloaded (RTLD_NOLOAD)."""
    assert culprit.driver_initialised() is False
    assert not guards.libcuda_loaded()


A_CUDA_BUILD = """
import os, torch
torch.backends.cuda.is_built = lambda: True   # as a CUDA build of torch says
import nbtrain
from nbtrain.launch.starting import culprit
print("nvml:", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
print("capturing:", torch.cuda.is_current_stream_capturing())
# torch's C++ calls torch.cuda._lazy_init; a CPU build raises there, after the watcher
try:
    x = torch.zeros(2, device="cuda")
except (AssertionError, RuntimeError):
    pass
print("touch:", culprit.torch_culprit())
print("restored:", hasattr(torch.cuda._lazy_init, "__wrapped__"))
check = ("_accelerator_graph_capture_health_check"
         if hasattr(torch.optim.Optimizer, "_accelerator_graph_capture_health_check")
         else "_cuda_graph_capture_health_check")
print("optimizer check defused:", hasattr(getattr(torch.optim.Optimizer, check), "__wrapped__"))
"""


def test_on_a_cuda_build_torch_is_watched_and_stream_capture_needs_no_driver(tmp_path):
    """On a CUDA build (faked: this torch is the CPU build) nbtrain's import watches torch's
    entry points, sets the NVML-based availability check, and answers
    ``is_current_stream_capturing()`` without the driver (the CPU build's own would raise,
    as a CUDA build's would initialise the driver) until torch has initialised CUDA."""
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(A_CUDA_BUILD))
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "nvml: 1" in done.stdout
    assert "capturing: False" in done.stdout
    assert "touch: a GPU was first used at user.py:10: `x = torch.zeros(2, device=\"cuda\")`" \
        in done.stdout, done.stdout
    assert "restored: False" in done.stdout
    assert "optimizer check defused: True" in done.stdout


def test_a_users_own_nvml_setting_is_kept():
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "0"}
    done = subprocess.run([sys.executable, "-c", "import nbtrain, os; "
                           "print(os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'])"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip() == "0", done.stderr


def test_transformers_asking_about_stream_capture_leaves_the_driver_alone(monkeypatch):
    """transformers asks ``torch.cuda.is_current_stream_capturing()`` in every forward; the
    defused answer never reaches the driver before torch has initialised CUDA."""
    def driver(*_):
        raise AssertionError("reached the CUDA driver")

    defused = culprit._not_capturing_before_init(driver)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", defused)
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert import_utils.is_cuda_stream_capturing() is False
    assert transformers is not None


def test_an_optimizer_step_on_the_cpu_leaves_the_driver_alone(monkeypatch):
    """Every ``step()`` checks for a CUDA graph capture; torch 2.8+ asks
    ``torch.accelerator`` for the current stream, which initialises the driver from C++.
    Defused, the check is skipped while torch has not initialised CUDA, and runs after."""
    calls = []
    check = ("_accelerator_graph_capture_health_check"
             if hasattr(torch.optim.Optimizer, "_accelerator_graph_capture_health_check")
             else "_cuda_graph_capture_health_check")
    monkeypatch.setattr(torch.optim.Optimizer, check,
                        culprit._no_capture_check_before_init(lambda self: calls.append(self)))
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    opt.step()
    assert calls == [] and param.detach().lt(1).all()  # stepped, without the check
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    opt.step()
    assert calls == [opt]
