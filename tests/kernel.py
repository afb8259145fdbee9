"""A real ipykernel, driven the way Jupyter drives it (jupyter_client), for tests."""

from __future__ import annotations

import os
import signal
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from queue import Empty

from jupyter_client import KernelManager


@dataclass
class Reply:
    stdout: str = ""
    stderr: str = ""
    error: dict | None = None  # {"ename", "evalue", "traceback"}
    results: list = field(default_factory=list)  # text/plain of execute_result messages
    displays: list = field(default_factory=list)  # data of display_data messages
    # (msg_type, content) of every other message for the cell: update_display_data,
    # comm_open and comm_msg (widgets), clear_output
    others: list = field(default_factory=list)
    seconds: float = 0.0
    execution_count: int | None = None  # the cell's In[N], as the frontend shows it
    prompts: list = field(default_factory=list)  # what input requests asked, in order
    # ("stdout" | "stderr", text) of each stream message and ("display", data) of each
    # display_data, in the order they arrived
    sequence: list = field(default_factory=list)

    @property
    def ename(self) -> str | None:
        return self.error["ename"] if self.error else None


def native_stacks(pids: list[int]) -> str:
    """C-level stacks too (a lock held in native code shows only there), from py-spy
    when it is installed (the dev extras have it) and allowed to attach."""
    import shutil
    import subprocess

    if shutil.which("py-spy") is None:
        return ""
    out = []
    for pid in pids:
        try:
            done = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)],
                                  capture_output=True, text=True, timeout=30)
            out.append(f"\n--- native {pid}\n{(done.stdout or done.stderr)[-8000:]}")
        except (OSError, subprocess.SubprocessError) as err:
            out.append(f"\n--- native {pid}: {err}")
    return "".join(out)


class Kernel:
    def __init__(self, startup: str = "import nbtrain, torch"):
        self._replies: dict[str, Reply] = {}
        # display_data that arrived for a cell other than the one being read, by cell
        # (a listener shows later runs in the cell that opened it)
        self.late_displays: dict[str, list[dict]] = {}
        env = dict(os.environ)
        env.pop("PYTEST_CURRENT_TEST", None)
        # jupyter_client picks free ports and the kernel binds them a moment later: on a
        # busy machine another process can take one between (seen in CI: "ZMQError:
        # Address already in use", then "Kernel died before replying"). A new kernel on
        # new ports is what Jupyter's own restart does; after three, the error stands.
        for attempt in range(3):
            self.km = KernelManager(kernel_name="python3")
            self.km.start_kernel(cwd=os.path.dirname(__file__), env=env)
            self.kc = self.km.client()
            self.kc.start_channels()
            try:
                self.kc.wait_for_ready(timeout=120)
                break
            except RuntimeError:
                died = not self.km.is_alive()  # a kernel that is slow is not retried
                self.kc.stop_channels()
                self.km.shutdown_kernel(now=True)
                if not died or attempt == 2:
                    raise
        # On a timeout, SIGUSR1 makes the kernel (and its forked workers, which inherit
        # the handler) write every thread's Python stack here: a hang seen once in CI
        # can then be read, not guessed.
        self._stacks = tempfile.NamedTemporaryFile("w+", prefix="nbtrain-stacks-",
                                                   suffix=".txt", delete=False)
        reply = self.run("import faulthandler as _fh, signal as _sig\n"
                         f"_fh.register(_sig.SIGUSR1, file=open({self._stacks.name!r}, 'a'), "
                         "all_threads=True)")
        assert reply.error is None, reply.error
        if startup:
            reply = self.run(startup)
            assert reply.error is None, reply.error

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def submit(self, code: str, allow_stdin: bool = True) -> str:
        return self.kc.execute(textwrap.dedent(code), allow_stdin=allow_stdin)

    def collect(self, msg_id: str, timeout: float = 180, until=None,
                answers=None) -> Reply:
        """Read the cell's messages until it is idle (or, with ``until``, until its stdout
        contains that text, or that function of the reply is true; call again to go on). ``answers``: what a person types in
        the input boxes the cell asks for, in turn, or a function of each prompt (the
        prompts go to ``prompts``)."""
        reply = self._replies.setdefault(msg_id, Reply())
        start = time.monotonic()
        deadline = start + timeout
        while True:
            if until is not None and (until(reply) if callable(until) else until in reply.stdout):
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no idle from the kernel within {timeout}s; got {reply}"
                                   f"\n\nPython stacks at the timeout:\n{self.stacks()}")
            if answers is not None:
                self._answer(reply, answers)
            try:
                msg = self.kc.get_iopub_msg(timeout=left if answers is None else min(left, 0.05))
            except Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                if msg["msg_type"] == "display_data":
                    self.late_displays.setdefault(msg["parent_header"].get("msg_id"),
                                                  []).append(msg["content"]["data"])
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind in ("stream", "display_data"):
                reply.sequence.append((content.get("name", "display"),
                                       content.get("text", content.get("data"))))
            if kind == "stream":
                if content["name"] == "stdout":
                    reply.stdout += content["text"]
                else:
                    reply.stderr += content["text"]
            elif kind == "error":
                reply.error = content
            elif kind == "display_data":
                reply.displays.append(content["data"])
            elif kind == "execute_result":
                reply.results.append(content["data"].get("text/plain", ""))
            elif kind == "execute_input":
                reply.execution_count = content.get("execution_count")
            elif kind in ("update_display_data", "comm_open", "comm_msg", "comm_close",
                          "clear_output"):
                reply.others.append((kind, content))
            elif kind == "status" and content["execution_state"] == "idle":
                reply.seconds = time.monotonic() - start
                del self._replies[msg_id]
                if until is not None:
                    raise AssertionError(f"the cell ended before printing {until!r}: {reply}")
                return reply

    def _answer(self, reply: Reply, answers) -> None:
        try:
            msg = self.kc.get_stdin_msg(timeout=0)
        except Empty:
            return
        if msg["msg_type"] == "input_request":
            prompt = msg["content"]["prompt"]
            reply.prompts.append(prompt)
            text = answers(prompt) if callable(answers) else answers.pop(0) if answers else ""
            if text is not None:  # None: no answer (the test interrupts instead)
                self.kc.input(text)

    def run(self, code: str, timeout: float = 180, answers=None,
            allow_stdin: bool = True) -> Reply:
        for _ in range(5):
            msg_id = self.submit(code, allow_stdin)
            reply = self.collect(msg_id, timeout, answers=answers)
            if not self._aborted(msg_id):
                return reply
            # ipykernel 6 (Colab's, Kaggle's) aborts a request that arrives in the moment
            # after a failed cell, before it stops aborting; a person is never that quick
            time.sleep(0.2)
        return reply

    def _aborted(self, msg_id: str) -> bool:
        """Whether the shell's reply to ``msg_id`` says the kernel aborted it."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                return False
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"].get("status") == "aborted"
        return False

    def value(self, expr: str):
        reply = self.run(expr)
        assert reply.error is None, reply.error
        import ast

        return ast.literal_eval(reply.results[-1])

    def stacks(self) -> str:
        """Every thread's Python stack in the kernel and in its forked workers, now."""
        import psutil

        kernel = psutil.Process(self.pid)
        forked = []  # copies of the kernel (same command line); others have no handler
        for p in kernel.children(recursive=True):
            try:
                if p.cmdline() == kernel.cmdline():
                    forked.append(p.pid)
            except psutil.Error:
                pass
        for pid in [self.pid, *forked]:  # one at a time, so their lines do not mix
            with open(self._stacks.name, "a") as f:
                f.write(f"\n--- {'kernel' if pid == self.pid else 'forked worker'} {pid}\n")
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            time.sleep(0.5)
        with open(self._stacks.name) as f:
            python = f.read()[-30_000:]
        return python + native_stacks([self.pid, *forked])

    def interrupt_group(self) -> None:
        """What Jupyter's interrupt does: SIGINT to the kernel's whole process group."""
        self.km.interrupt_kernel()

    def interrupt_pid(self) -> None:
        os.kill(self.pid, signal.SIGINT)

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)
            os.unlink(self._stacks.name)
