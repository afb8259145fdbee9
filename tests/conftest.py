"""Shared fixtures: a leftover-process check for every test that starts workers, and a
real Jupyter kernel driven through jupyter_client."""

from __future__ import annotations

import os
import time

import psutil
import pytest
from kernel import Kernel

from nbtrain.launch.starting.devices import cuda_device_count

# The fast lane (`python -m pytest -q -m "not slow" tests`, a few minutes) leaves these
# out: real kernels and browsers, the benchmarks' smoke runs, the model zoo, DeepSpeed,
# fresh venvs, the README's example and the many-starts stress test. CI runs everything.
SLOW_FILES = {"test_benchmarks.py", "test_models.py", "test_deepspeed.py",
              "test_fresh_env.py", "test_docs.py", "test_demo.py"}
SLOW_TESTS = {"test_ranks_that_return_at_once_never_fail_a_peer_still_joining",
              "test_an_interrupted_run_resumes_where_its_last_checkpoint_was"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.path.name in SLOW_FILES or getattr(item, "originalname", "") in SLOW_TESTS
                or item.get_closest_marker("kernel") or item.get_closest_marker("browser")):
            item.add_marker(pytest.mark.slow)
    # Counted through NVML: torch.cuda.is_available() would make every later fork in this
    # process unusable for CUDA, and the GPU tests would all spawn.
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Every process the tests start inherits this mark, so one that outlives its parent (and
# is no longer a descendant: reparented to init) is still found: strays().
MARK = "NBTRAIN_TESTS_SESSION"
os.environ[MARK] = str(os.getpid())


def strays() -> set[int]:
    """Processes with this session's mark that are not under this process any more."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
    found = set()
    for p in psutil.process_iter():
        if p.pid in mine:
            continue
        try:
            if p.environ().get(MARK) == os.environ[MARK] and p.status() != "zombie":
                found.add(p.pid)
        except psutil.Error:  # gone, or not ours to read
            pass
    return found


def fork_server(p: psutil.Process) -> bool:
    """nbtrain's fork server, kept for the kernel's life by design (its workers are not)."""
    try:
        return "multiprocess.forkserver import main" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def descendants(pid: int) -> list[psutil.Process]:
    """Every process under ``pid`` but nbtrain's fork server (its children count)."""
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if not fork_server(p)]
    except psutil.NoSuchProcess:
        return []


def wait_no_descendants(pid: int, timeout: float = 5.0, ignore=()) -> list[psutil.Process]:
    """Descendants of ``pid`` still there after ``timeout`` (zombies included)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in descendants(pid) if p.pid not in ignore]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture
def no_leftovers():
    """Fails the test if a process it started is still alive (or a zombie) afterwards."""
    before = {p.pid for p in descendants(os.getpid())}
    strays_before = strays()
    yield
    left = wait_no_descendants(os.getpid(), ignore=before)
    deadline = time.monotonic() + 5
    while (new := strays() - strays_before) and time.monotonic() < deadline:
        time.sleep(0.1)  # orphans: their watch of a dead parent ends them within a second
    for pid in new:
        try:
            left.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    described = []
    for p in left:  # clean up anyway, so one failure does not cascade
        try:
            described.append((p.pid, p.status(), _cmd(p)))
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not described, f"processes left behind (orphans included): {described}"


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def kernel_clean(kernel):
    """The module's kernel, checked for leftover workers after the test."""
    yield kernel
    left = wait_no_descendants(kernel.pid)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"the kernel kept children: {[(p.pid, p.status()) for p in left]}"


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:
        return "?"


@pytest.fixture
def given_times(monkeypatch):
    """``make(telemetry) -> (recorder, sent, clock)``: a rank's ``Recorder`` on a fake wire
    (``sent``: the events it hands to the sender thread) reading the time from ``clock``
    (``clock[0]``, seconds, set by the test): its steps' durations are given, not
    measured, so a loaded machine cannot change them."""
    from types import SimpleNamespace

    import torch

    from nbtrain.telemetry import recorder as recording

    clock = [0.0]
    monkeypatch.setattr(recording, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    made = []

    def make(telemetry):
        sent: list = []

        class Wire:
            send = sent.append

            def flush(self, timeout=5.0):
                return True

        made.append(recording.Recorder(0, torch.device("cpu"), Wire(), telemetry))
        return made[-1], sent, clock

    yield make
