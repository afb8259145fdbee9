"""What runs inside each worker process, the same after fork and after spawn.

The parent hands the worker a ``WorkerSpec`` (plain data), the user's function (as an
object after fork, as dill bytes after spawn) and four pipe ends: control (result or
error, back to the kernel; messages in ``wire.py``), stdout, stderr, and commands
(kernel -> worker: first the rendezvous address, then, for a ``RankPool`` worker
(``spec.pool``), the commands it waits for in ``pool_worker.main`` instead of one
function).

The rendezvous store lives in rank 0, never in the kernel. A kernel that hosts one runs
its server thread, and that thread formats each connecting peer's address with glibc's
``getnameinfo``: a fork at that instant copied the resolver's lock, held, into the next
rank, which then waited for it forever on its own way to the store (about 1 start in 150
with 4 ranks in a Jupyter kernel). Rank 0 makes the store on a free port and says which
on its control pipe; the kernel passes the port on to the other ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import signal
import sys
import time
import traceback
from typing import Any

from ..spec import WorkerSpec
from ..wire import (
    AT_STORE,
    FAILURE,
    JOINED,
    Activity,
    StorePort,
    decode_failure,
    decode_store,
    encode_activity,
    encode_failure,
    encode_result,
    encode_store,
)
from . import asking, displays


def _bootstrap_stacks() -> None:
    """SIGUSR1 writes every thread's Python stack to stderr (the cell): how the kernel
    learns where a rank that never joined its process group is waiting."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)


class CallWithoutCtx:
    """A function written without ``ctx`` (for torchrun or ``notebook_launcher``), called
    as it is: ``fn(*args, **kwargs)`` (see ``launch/calls.py``)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, ctx, *args, **kwargs):
        return self.fn(*args, **kwargs)


def main(spec: WorkerSpec, payload: Any, control, out_w, err_w, commands) -> None:
    """Entry point of a worker process. Never returns: the process exits here."""
    run_as_worker(spec, out_w, err_w, lambda: _run(spec, payload, control, commands),
                  commands)


def run_as_worker(spec: WorkerSpec, out_w, err_w, body, commands) -> None:
    """Become a worker (own process group, output to the pipes, its ``input`` asking the
    kernel through ``commands``), then run ``body``, which reports and exits the process
    itself; if the reporting fails, say so and exit."""
    _become_worker(spec, out_w, err_w)
    asking.install(commands, spec.rank)
    try:
        body()
    except BaseException:  # the reporting itself failed; say so on stderr
        traceback.print_exc()
    leave(1)


def leave(code: int) -> None:
    """Flush and leave at once, without tearing anything down.

    Destructors are skipped on purpose: a gloo process group's destructor joins its
    worker thread while holding the GIL, and that thread may need the GIL to free a
    finished collective (seen hanging a worker forever after a DDP run). The process is
    ending; the kernel has the result, and the OS reclaims sockets and memory.
    """
    displays.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _become_worker(spec: WorkerSpec, out_w, err_w) -> None:
    # Own process group: an interrupt sent to the kernel's group does not reach us, and
    # the kernel can end us together with anything we start (DataLoader workers).
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel decides what an interrupt means
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # spawn started it blocked
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if spec.environ_of_kernel is not None:
        os.environ.clear()
        os.environ.update(spec.environ_of_kernel)
    if spec.argv is not None:  # not the kernel's own (launch/calls.rank_argv)
        sys.argv[:] = spec.argv
    if spec.die_with_parent and sys.platform == "linux":
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() != spec.parent_pid:  # the kernel died before prctl took effect
            os._exit(1)
    os.dup2(out_w.fileno(), 1)
    os.dup2(err_w.fileno(), 2)
    out_w.close()
    err_w.close()
    before = {id(sys.stdout): "out", id(sys.stderr): "err"}
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, encoding="utf-8",
                                       errors="replace", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, encoding="utf-8",
                                       errors="replace", closefd=False)
    _retarget_log_handlers(before)
    if not displays.forward() and spec.shell:  # forked from a kernel: its shell's
        displays.own_shell()  # displays go to the cell; else one of the rank's own does
    _bootstrap_stacks()


def _retarget_log_handlers(before: dict[int, str]) -> None:
    """Logging handlers made in the kernel (Lightning's, transformers') hold the
    kernel's streams: after a fork they wrote into the cell without the rank's label.
    Point them at this worker's."""
    import logging

    new = {"out": sys.stdout, "err": sys.stderr}
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if not isinstance(handler, logging.StreamHandler) or \
                    isinstance(handler, logging._StderrHandler):  # that one follows sys.stderr
                continue
            which = before.get(id(getattr(handler, "stream", None)))
            if which is not None:
                try:
                    handler.setStream(new[which])
                except AttributeError:  # a handler whose stream is not settable
                    pass


def _run(spec: WorkerSpec, payload: Any, control, commands) -> None:
    os.environ.update(spec.environ())
    message = execute(spec, payload, setup=lambda: init_distributed(spec, control, commands),
                      report=control.send_bytes)
    control.send_bytes(message)
    # No destroy_process_group(): see leave(). Every object stays alive until the process
    # is gone, including the model (and its DDP reducer) that the context holds.
    leave(1 if message[:1] == FAILURE else 0)


def init_distributed(spec: WorkerSpec, control, commands) -> None:
    """Threads and device for this rank, then the process group: rank 0 hosts the store
    (see the module docstring), the others wait for the kernel to say where it is. Says
    ``JOINED`` on ``control`` once the group is up on every rank."""
    import torch
    import torch.distributed as dist

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    if spec.accelerator == "cuda":
        torch.cuda.set_device(spec.device_index)
    timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
    if spec.rank == 0:
        store = dist.TCPStore(spec.store_host, 0, spec.world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        port = store.port
        control.send_bytes(encode_store(StorePort(port)))
    else:
        try:
            port = decode_store(commands.recv_bytes()).port
        except EOFError:  # the kernel ended the start (rank 0 failed, an interrupt)
            leave(1)
        store = dist.TCPStore(spec.store_host, port, spec.world_size, is_master=False,
                              timeout=timeout)
    control.send_bytes(AT_STORE)
    os.environ["MASTER_PORT"] = str(port)  # for libraries that read it
    init = dict(backend=spec.backend, store=store, rank=spec.rank,
                world_size=spec.world_size, timeout=timeout)
    if spec.accelerator == "cuda":
        init["device_id"] = torch.device("cuda", spec.device_index)
    dist.init_process_group(**init)
    # A rank whose function returns at once must not leave while a peer is still
    # connecting its group (gloo: "Connection closed by peer" in that peer): every rank
    # passes this barrier only once every rank's group is up.
    dist.barrier(**({"device_ids": [spec.device_index]} if spec.accelerator == "cuda" else {}))
    control.send_bytes(JOINED)


def execute(spec: WorkerSpec, payload: Any, setup=None, telemetry=None, report=None) -> bytes:
    """Run the user's function once with a fresh ``Context``; return the control message
    (result or failure). Telemetry is flushed before it returns, so the kernel has every
    event before it reads the result. ``setup`` runs after telemetry connects (the
    process group's start, in a one-shot worker). ``telemetry``: where events go instead
    of a client to ``spec.telemetry_address`` (a torchrun rank's own; closed here too).
    ``report`` gets the function's activity message (``wire.ACTIVITY``) before the
    result is returned, when the function returned."""
    from ..context import Context
    from ..seeding import rank_seed, seed_all
    from ..telemetry.client import TelemetryClient
    from ..telemetry.events import Lifecycle

    ctx = None
    try:
        fn, args, kwargs, strategy = _load(payload)
        # (with telemetry off an address still comes when restarts may follow: the
        # client then carries the checkpoints' reports alone, ctx.save's)
        if telemetry is None and spec.telemetry_address is not None:
            telemetry = TelemetryClient(spec.telemetry_address, spec.telemetry_token, spec.rank)
        if setup is not None:
            setup()
        ctx = Context(spec, strategy, telemetry, function=_name(fn))
        events = telemetry if spec.telemetry.enabled else None  # the lifecycle's
        if events:
            events.send(Lifecycle(rank=spec.rank, step=0, t=time.monotonic(),
                                     state="started"))
        seed_all(rank_seed(spec.seed, spec.rank))  # the same rule after fork and spawn
        strategy.start_rank(ctx.device)
        from ..integrations.hosting import hosted

        observe = isinstance(fn, CallWithoutCtx)
        with _inherited_frozen(), hosted(fn, ctx, observe_steps=observe) as activity:
            try:
                result = fn(ctx, *args, **kwargs)
            except SystemExit as exc:  # a script's main() ending: success as under torchrun
                if exc.code not in (0, None):
                    raise
                result = None
        ctx._close()
        if report is not None:
            report(encode_activity(Activity(**activity)))
        message = encode_result(result, spec.rank)
        if events:
            events.send(Lifecycle(rank=spec.rank, step=ctx.step, t=time.monotonic(),
                                  state="finished"))
    except BaseException as exc:
        hint = ""
        if ctx is not None:
            from .oom import diagnose, out_of_memory

            if out_of_memory(exc):  # measured before anything is let go
                hint = diagnose(ctx)
            try:
                ctx._close()
            except Exception:
                pass
        if isinstance(exc, SystemExit):
            hint = exit_hint(exc)
        message = encode_failure(exc, spec.rank, (__file__,), hint)
        if telemetry and spec.telemetry.enabled:
            detail = decode_failure(message).traceback + (f"\n{hint}" if hint else "")
            telemetry.send(Lifecycle(rank=spec.rank, step=ctx.step if ctx else 0,
                                     t=time.monotonic(), state="failed",
                                     detail=detail[-50_000:]))
    if telemetry:
        telemetry.close()  # every event is in the kernel before the result is
    return message


@contextlib.contextmanager
def _inherited_frozen():
    """While the function runs, the garbage collector leaves alone what was there before
    it (a forked rank's copy of the kernel: every module, every cell's objects; the
    function, its arguments, the strategy). A full collection in a rank forked from a
    kernel otherwise walked all of them, writing to each object's header, so copying the
    kernel's pages one by one: 150-250 ms in the middle of a step, once every few dozen
    steps (``benchmarks/scaling.py``'s cases; more in a kernel with more objects). What
    the function makes is collected as usual; afterwards (a pool's worker lives on) the
    rest is collectable again. (So cyclic garbage among what was there before, a model a
    pool's cell made and the function drops, say, goes when the run ends, not at the
    function's own ``gc.collect()``; what reference counting frees goes at once.)"""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def exit_hint(exc: SystemExit) -> str:
    """What to do about a rank's ``sys.exit(code)`` (argparse calls it too)."""
    argparse = any(frame.f_code.co_filename.endswith("argparse.py")
                   for frame, _ in traceback.walk_tb(exc.__traceback__))
    why = ("argparse did not accept the command line (its message is above); give it "
           "its arguments: parser.parse_args([\"--lr\", \"0.1\"]), or set sys.argv in a "
           "cell before launching" if argparse else
           "in a notebook a function ends by returning (sys.exit(0) counts as that) or by "
           "raising an exception that says what went wrong")
    return f"the function called sys.exit({exc.code!r}): {why}."


def _name(fn: Any) -> str:
    """The user's function's name (ctx.checkpoint_every's default directory)."""
    inner = getattr(fn, "fn", fn)  # CallWithoutCtx keeps the function it calls
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _load(payload: Any):
    if isinstance(payload, bytes):  # spawn: the function travels by value through dill
        import dill

        return dill.loads(payload)
    return payload
