"""The command loop of a ``RankPool`` worker: started once, it keeps its process group and
a namespace, and runs what the kernel sends until told to exit.

Commands come on a pipe only the kernel writes (``wire``'s command dataclasses, kernel ->
worker); every command gets exactly one reply on the control pipe, in the one-shot
worker's format (a result or a failure) or one of its own:

- ``Exec``: a ``%%ranks`` cell's code; the value of its last expression comes back as text
  (a ``CellValue``), as a REPL would show it.
- ``LaunchRun``: a training function (dill bytes) run with a fresh ``Context`` and a
  per-run telemetry connection, exactly as ``worker.execute`` runs it in a one-shot
  worker; then what it made is freed (``free``), so the next run's memory starts clean.
- ``Pull`` / ``Push``: a name of the namespace, out (tensors on CPU) or in (dill bytes).
- ``MemoryQuery``: what this rank holds now (a memory message).
- ``DropGroup`` (no reply): shut down the connections to the other ranks and destroy
  the process group, which frees a peer stuck in a collective this rank is not in;
  ``Regroup``: start a group again, as the pool's start does.
- ``Exit``.

An interrupt is a SIGINT from the kernel to this process only; it raises
KeyboardInterrupt in the user's code while a command runs and is ignored otherwise.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import gc
import linecache
import os
import signal
import sys
from typing import Any

from ..spec import WorkerSpec
from ..wire import (
    READY,
    CellValue,
    DropGroup,
    Exec,
    Exit,
    LaunchRun,
    MemoryQuery,
    Pull,
    Push,
    Regroup,
    decode_command,
    encode_failure,
    encode_memory,
    encode_result,
    encode_value,
)
from . import displays
from .worker import execute, init_distributed, leave, run_as_worker

MAX_REPR = 20_000  # characters of a last expression's repr sent back


class _State:
    busy = False  # a command's user code is running: SIGINT raises KeyboardInterrupt


def main(spec: WorkerSpec, payload: Any, control, out_w, err_w, commands) -> None:
    """Entry point of a pool worker process (``payload`` is unused: functions come as
    commands). Never returns: the process exits here."""
    run_as_worker(spec, out_w, err_w, lambda: serve(spec, commands, control), commands)


def serve(spec: WorkerSpec, commands, control) -> None:
    os.environ.update(spec.environ())
    join(spec, control, commands)
    import torch
    import torch.distributed as dist

    device = (torch.device("cuda", spec.device_index) if spec.accelerator == "cuda"
              else torch.device("cpu"))
    namespace: dict[str, Any] = {
        "__name__": "__main__", "__builtins__": builtins, "rank": spec.rank,
        "world_size": spec.world_size, "device": device, "dist": dist, "torch": torch}

    def on_sigint(signum, frame):
        if _State.busy:
            _State.busy = False  # one interrupt, one KeyboardInterrupt
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    control.send_bytes(READY)
    while True:
        _State.busy = False
        try:
            data = commands.recv_bytes()
        except (EOFError, OSError):  # the kernel closed the pool, or is gone
            leave(0)
        command = None
        try:
            command = decode_command(data)
            if isinstance(command, Exit):
                leave(0)
            if isinstance(command, DropGroup):  # no reply: an error shows at Regroup
                try:
                    cut(command.fds)
                    drop_group()
                except Exception as err:
                    print(f"nbtrain: rank {spec.rank} could not end its process group: "
                          f"{err!r}", file=sys.stderr, flush=True)
                continue
            if isinstance(command, Regroup):
                drop_group()
                join(spec, control, commands)
                reply = encode_value(CellValue())
            else:
                reply = _handle(spec, command, namespace, control.send_bytes)
        except BaseException as exc:  # an interrupt that landed between two lines of
            reply = encode_failure(exc, spec.rank, (__file__,))  # ours, or no command
        _State.busy = False
        displays.flush()
        for stream in (sys.stdout, sys.stderr):  # output before the reply that ends it
            try:
                stream.flush()
            except Exception:
                pass
        control.send_bytes(reply)
        if isinstance(command, LaunchRun):
            free(spec)


def join(spec: WorkerSpec, control, commands) -> None:
    """Start the process group (at the pool's start, or again after ``DropGroup``); a
    rank that cannot says why and leaves: without a group it is of no use, and the
    store's address sent for the start would reach its command loop."""
    try:
        init_distributed(spec, control, commands)
    except BaseException as exc:
        control.send_bytes(encode_failure(exc, spec.rank, (__file__,)))
        leave(1)


def _handle(spec: WorkerSpec, command, namespace: dict, report) -> bytes:
    try:
        match command:
            case Exec(code=code, filename=filename):
                return encode_value(CellValue(run_cell(code, filename, namespace)))
            case LaunchRun(payload=payload, settings=settings):
                run_spec = dataclasses.replace(spec, **settings.fields())
                if spec.accelerator == "cuda":  # this run's peak, not a cell's before it
                    import torch

                    torch.cuda.reset_peak_memory_stats()
                _State.busy = True
                return execute(run_spec, payload, report=report)
            case Pull(name=name):
                if name not in namespace:
                    raise NameError(f"name {name!r} is not defined on rank {spec.rank}")
                return encode_result(namespace[name], spec.rank)
            case Push(values=values):
                import dill

                namespace.update(dill.loads(values))
                return encode_value(CellValue())
            case MemoryQuery():
                return encode_memory(memory(spec))
        raise ValueError(f"a pool command this rank cannot run: {command!r}")
    except BaseException as exc:
        return encode_failure(exc, spec.rank, (__file__,))


def run_cell(code: str, filename: str, namespace: dict) -> str | None:
    """Run ``code`` as a REPL does: every statement, then the value of a trailing
    expression (its repr, or None when there is none or it is None)."""
    tree = ast.parse(code, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    # Tracebacks show the cell's lines.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    _State.busy = True
    exec(compile(tree, filename, "exec"), namespace)
    value = eval(compile(last, filename, "eval"), namespace) if last is not None else None
    _State.busy = False
    if value is None:
        return None
    namespace["_"] = value
    text = repr(value)
    return text if len(text) <= MAX_REPR else text[:MAX_REPR] + " ..."


def cut(fds: tuple[int, ...]) -> None:
    """Shut down these TCP connections (both ways): the process at the other end sees
    them closed, whatever here still holds them open."""
    import socket

    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed meanwhile, or not a connected socket any more
            pass


def drop_group() -> None:
    """Destroy the default process group (and every group made from it), if any."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def free(spec: WorkerSpec) -> None:
    """After a run: collect what it made (models, optimizers, their state) and, on CUDA,
    give the cached blocks back, so the next run's memory figures start from zero."""
    from ..strategies import release

    release()  # what a strategy kept beyond the run (DeepSpeed's engines and groups)
    gc.collect()
    if spec.accelerator == "cuda":
        import torch

        torch.cuda.synchronize()
        # cuBLAS keeps a workspace per handle and stream from the allocator (32 MiB each on
        # Hopper; 64 MiB were left after a run on an H100): torch's own call gives them back
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory(spec: WorkerSpec) -> dict[str, int]:
    """Bytes held by live tensors (each storage once), the process's RSS, and on CUDA the
    allocator's figures."""
    import torch

    gc.collect()
    seen: set[tuple[str, int]] = set()
    held = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): that reads __class__, which wakes lazy module
        # attributes (and their deprecation warnings).
        if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
        except Exception:  # wrapper subclasses (DTensor) hold their local tensor too
            continue
        key = (str(storage.device), storage.data_ptr())
        if key not in seen and storage.data_ptr():
            seen.add(key)
            held += storage.nbytes()
    out = {"tensor_bytes": held, "rss_bytes": _rss()}
    if spec.accelerator == "cuda":
        out["cuda_allocated"] = torch.cuda.memory_allocated()
        out["cuda_reserved"] = torch.cuda.memory_reserved()
    return out


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


__all__ = ["serve"]
