"""Reading the stacks ranks write with faulthandler (``launch/following/stacks.py``): as they die in
native code, and when asked where they are (the real runs are in test_launch.py)."""

from __future__ import annotations

import os
import sysconfig

import nbtrain
from nbtrain.errors import where_text
from nbtrain.launch.following.stacks import Dump, native_message

RANK = os.path.join(os.path.dirname(nbtrain.__file__), "rank", "worker.py")
OURS = os.path.join(os.path.dirname(nbtrain.__file__), "telemetry", "timing.py")
STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "threading.py")
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
CELL = "/tmp/ipykernel_77/3141.py"


def dump(main: list[tuple[str, int, str]], fatal: bool = True) -> list[str]:
    """A dump as faulthandler writes it: a helper thread, then the main thread, each
    innermost frame first."""
    lines = ["Fatal Python error: Aborted", ""] if fatal else []
    lines += ["Thread 0x00007f303c8136c0 (most recent call first):",
              f'  File "{STDLIB}", line 331 in wait',
              f'  File "{STDLIB}", line 1002 in _bootstrap', "",
              "Current thread 0x00007f305f3fbb80 (most recent call first):"]
    lines += [f'  File "{f}", line {n} in {name}' for f, n, name in main]
    return lines + ["", "Extension modules: torch._C (total: 1)"]


STACK = [(OURS, 100, "wait"), (TORCH, 4394, "all_gather_single"), (CELL, 9, "train"),
         (RANK, 231, "execute"), (RANK, 68, "main"), (CELL, 18, "<module>")]


def test_the_dump_of_a_dying_rank_reads_as_a_traceback_from_its_function_on():
    parsed = Dump.parse(dump(STACK))
    assert parsed.fatal == "Aborted" and len(parsed.threads) == 2
    # the bootstrap and the kernel's frames that a fork copied are left out
    assert parsed.traceback() == (
        "Traceback (most recent call last):\n"
        f'  File "{CELL}", line 9, in train\n'
        f'  File "{TORCH}", line 4394, in all_gather_single\n'
        f'  File "{OURS}", line 100, in wait\n')
    assert parsed.where().lineno == 9 and parsed.where().name == "train"


def test_a_dump_of_one_thread_alone_reads_the_same():
    """faulthandler heads the stack with "Stack (most recent call first):" when it writes
    one thread (``all_threads=False``, and some fatal errors)."""
    lines = ["Fatal Python error: Segmentation fault", "", "Stack (most recent call first):",
             *[f'  File "{f}", line {n} in {name}' for f, n, name in STACK]]
    assert Dump.parse(lines).where().name == "train"


def test_where_a_rank_was_prefers_the_users_code_then_a_librarys():
    in_library = [(OURS, 100, "wait"), (TORCH, 3252, "all_reduce"), (RANK, 231, "execute")]
    assert Dump.parse(dump(in_library, fatal=False)).where().name == "all_reduce"
    # Colab's torch is in Debian's dist-packages
    colab = TORCH.replace("/venv/lib/python3.11/site-packages", "/usr/local/lib/python3.12/"
                          "dist-packages")
    in_colab = [(colab, 3252, "all_reduce"), (CELL, 9, "train"), (RANK, 231, "execute")]
    assert Dump.parse(dump(in_colab, fatal=False)).where().name == "train"
    in_colab_library = [(colab, 3252, "all_reduce"), (RANK, 231, "execute")]
    assert Dump.parse(dump(in_colab_library, fatal=False)).where().name == "all_reduce"
    # only nbtrain's and the standard library's code: its function had ended
    ending = [(STDLIB, 137, "updatecache"), (OURS, 73, "hosted"), (RANK, 231, "execute")]
    assert Dump.parse(dump(ending, fatal=False)).where() is None
    # nbtrain's start, before the function: not a torch line it happened to be in
    seeding = os.path.join(os.path.dirname(nbtrain.__file__), "seeding.py")
    starting = [(TORCH.replace("distributed/distributed_c10d", "cuda/__init__"), 467,
                 "_lazy_call"), (seeding, 40, "seed_all"), (RANK, 226, "execute")]
    assert Dump.parse(dump(starting, fatal=False)).where() is None
    # an import nbtrain's start made, through an import hook a library put in sys.meta_path
    # (pytest's): not that library's line either
    hook = TORCH.replace("torch/distributed/distributed_c10d", "_pytest/pathlib")
    importing = [(hook, 509, "fnmatch_ex"), ("<frozen importlib._bootstrap>", 1360,
                                             "_find_and_load"), (RANK, 226, "execute")]
    assert Dump.parse(dump(importing, fatal=False)).where() is None
    # a %%ranks cell is the user's code (its file name is not a path)
    in_cell = [(TORCH, 3252, "all_reduce"), ("<%%ranks In[4]>", 3, "<module>"),
               (RANK.replace("worker", "pool_worker"), 152, "run_cell")]
    assert Dump.parse(dump(in_cell, fatal=False)).where().filename == "<%%ranks In[4]>"


def test_a_dump_cut_short_has_no_function_thread_yet():
    lines = dump(STACK)
    cut = lines[:lines.index(f'  File "{CELL}", line 9 in train') + 1]
    assert not Dump.parse(cut).complete() and Dump.parse(cut).traceback() == ""
    assert Dump.parse(lines).complete()


def test_what_native_code_said_is_its_exception_or_its_last_line():
    said = ["some output", "terminate called after throwing an instance of 'gloo::X'",
            "  what():  [enforce fail at pair.cc:456] Is there a collective mismatch?"]
    assert native_message(said) == "[enforce fail at pair.cc:456] Is there a collective mismatch?"
    assert native_message(["first", "CUDA error: an illegal memory access", " "]) == \
        "CUDA error: an illegal memory access"
    assert native_message([]) == ""


def test_ranks_at_the_same_line_are_named_together():
    where = {0: "a.py, line 1, in f: x()", 1: "a.py, line 1, in f: x()", 2: "",
             3: "b.py, line 2, in g: y()"}
    assert where_text(where) == ("where the ranks were: ranks 0, 1 at a.py, line 1, in f: "
                                 "x(); rank 3 at b.py, line 2, in g: y()")
    assert where_text({0: "", 1: ""}) == ""


def test_what_a_rank_wrote_beside_its_stack_reaches_the_cell():
    """Once a rank was asked for its stack, its stderr is kept until the stack is read:
    the lines that are not the dump's (a warning as it was ended) then reach the cell,
    and its stderr flows again."""
    import types

    from nbtrain.launch.following.watch import Watch

    emitted = []
    watch = Watch([types.SimpleNamespace(rank=1)], lambda r, s, line: emitted.append(line),
                  join=False)
    try:
        w = watch.workers[1]
        w.stack = ["UserWarning: the loader was cut short", *dump(STACK, fatal=False)]
        watch.read_stacks()
        assert emitted == ["UserWarning: the loader was cut short"]
        assert w.stack is None and w.where.name == "train"
        # the dump's last lines (outer frames) arriving after it was read are dropped;
        # what the rank writes next reaches the cell
        r, wr = os.pipe()
        w.handle.err = types.SimpleNamespace(fileno=lambda: r)
        os.write(wr, f'  File "{STDLIB}", line 108 in run\n\nafter the stack\n'.encode())
        watch.read_output(w, "err")
        assert emitted[1:] == ["after the stack"], emitted
        os.close(r), os.close(wr)
    finally:
        watch.close(end_ranks=False)


def test_a_stack_cut_mid_line_as_the_rank_ended_stays_out_of_the_cell():
    """A rank ended while it wrote the stack it was asked for: the line it had not ended
    is its stack's, as the read part of a dump is; it reached the cell as a lone
    ``File ... in _run_once`` line under a failed launch."""
    import types

    from nbtrain.launch.following.watch import Watch

    emitted = []
    watch = Watch([types.SimpleNamespace(rank=1)], lambda r, s, line: emitted.append(line),
                  join=False)
    try:
        w = watch.workers[1]
        cut = f'  File "{STDLIB}", line 1922 in _run_once'
        for asked, tail in ((True, False), (False, True)):  # being read, or read already
            w.stack, w.tail = ([] if asked else None), tail
            r, wr = os.pipe()
            w.handle.err = types.SimpleNamespace(fileno=lambda r=r: r)
            lines = dump(STACK, fatal=False)[:-2] if asked else []
            os.write(wr, "".join(f"{line}\n" for line in lines).encode() + cut.encode())
            os.close(wr)
            while watch.read_output(w, "err"):  # to the pipe's end
                pass
            os.close(r)
            assert emitted == [], emitted
            if asked:
                assert w.stack[-1] == cut
                watch.read_stacks()
                assert emitted == [] and w.where.name == "train"
    finally:
        watch.close(end_ranks=False)


def test_a_stack_asked_for_while_a_bar_was_drawn_leaves_the_bars_text_alone():
    """faulthandler starts its dump where the rank's stderr stands: after a progress bar
    redrawn in place, on the bar's line. The bar's text is the rank's; the dump, from
    its first line, is its stack (the thread line showed in the cell after the bar)."""
    import types

    from nbtrain.launch.following.stacks import dump_within
    from nbtrain.launch.following.watch import Watch

    bar = "epoch 0:  26%|##   | 161/625 "
    assert dump_within(bar + "Thread 0x00007f00 (most recent call first):") == len(bar)
    assert dump_within("Thread 0x00007f00 (most recent call first):") == 0
    assert dump_within("a line about Thread 0x00") == 0
    emitted = []
    watch = Watch([types.SimpleNamespace(rank=1)], lambda r, s, line: emitted.append((s, line)),
                  join=False)
    try:
        w = watch.workers[1]
        w.stack = []
        r, wr = os.pipe()
        w.handle.err = types.SimpleNamespace(fileno=lambda: r)
        lines = dump(STACK, fatal=False)
        os.write(wr, ("\rbar  10%\rbar  26%" + "\n".join(lines) + "\n").encode())
        watch.read_output(w, "err")
        watch.read_stacks()
        os.close(r), os.close(wr)
        assert [e for e in emitted if e[0] == "err"] == [("err", "bar  26%")], emitted
        assert w.where.name == "train"
    finally:
        watch.close(end_ranks=False)


def test_gloos_line_as_a_group_starts_is_not_the_ranks_output():
    """torch 2.10 and 2.11 have gloo print "[Gloo] Rank 0 is connected to 0 peer ranks
    ..." as a group starts: on Kaggle every launch's cell began with it (the Kaggle leg
    found it in a test's exact stdout). The user's lines around it reach the cell."""
    import types

    from nbtrain.launch.following.watch import Watch

    emitted = []
    watch = Watch([types.SimpleNamespace(rank=0)], lambda r, s, line: emitted.append((s, line)),
                  join=False)
    try:
        w = watch.workers[0]
        r, wr = os.pipe()
        w.handle.out = types.SimpleNamespace(fileno=lambda: r)
        os.write(wr, b"[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of "
                     b"connected peer ranks is : 0\nthe user's line\n")
        watch.read_output(w, "out")
        os.close(r), os.close(wr)
        assert emitted == [("out", "the user's line")]
    finally:
        watch.close(end_ranks=False)
