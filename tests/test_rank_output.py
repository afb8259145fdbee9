"""What ranks show besides lines: a progress bar redrawn in place (tqdm's carriage
returns) and, from a rank forked from a kernel, IPython displays (an HTML table updated
by its display id, a transformers Trainer's progress table); widgets are not passed on.
The kernel tests run in a real ipykernel driven by jupyter_client."""

from __future__ import annotations

import ast
import importlib.util
import io
import sys
import time

import pytest

import nbtrain
from nbtrain.display_record import DISPLAY_MARK, Display, decode_display, encode_display
from nbtrain.launch.following.pipes import PipeText, redrawn
from nbtrain.output import CellOutput


def shown(text: str) -> str:
    """What a terminal shows of stream text: each carriage return goes back to the line's
    start and overwrites it."""
    return "\n".join(redrawn(line) or "" if "\r" in line else line
                     for line in text.split("\n"))


# -- pieces ------------------------------------------------------------------------------
def test_a_redrawn_line_is_what_a_terminal_shows():
    assert redrawn("\r 10%|#\r 20%|##\r100%|###") == "100%|###"
    assert redrawn("abcdef\rXY") == "XYcdef"  # a shorter redraw leaves the rest
    assert redrawn("bar\r   \r") is None  # a bar that cleared itself
    assert redrawn("done\r") == "done"  # a Windows line end


def test_a_pipe_gives_lines_records_and_redraws_in_order():
    pipe = PipeText("err")
    record = encode_display(Display("display_data", {"data": {"text/plain": "T"}}))
    bar = "█".encode()
    items = pipe.feed(b"before\nhalf " + record + b"line\n\r 1%|" + bar[:1])
    items += pipe.feed(bar[1:] + b"|\r 2%|##")  # a character split between two reads
    assert items == [("err", "before"), ("display", record.decode()[len(DISPLAY_MARK):-1]),
                     ("err", "half line"), ("err-live", " 1%|"), ("err-live", " 2%|##")]
    for i in range(1000):  # a long run's redraws: what is kept stays one line long
        pipe.feed(f"\r{i:4d}%|".encode())
    assert len(pipe.partial) < 20
    assert pipe.feed(b"\r done\n") == [("err-live", ""), ("err", " done|")]
    assert pipe.feed(b"tail \r") == [("err-live", "tail")] and pipe.end() == "tail"
    assert pipe.feed(record[:10]) == [] and pipe.feed(record[10:] + b"x\n") == [
        ("display", record.decode()[len(DISPLAY_MARK):-1]), ("err", "x")]


def test_a_line_left_unended_shows_once_it_has_waited_and_as_it_grows():
    """``print("epoch 1 ...", end="")`` before a long step: a terminal shows it at once;
    the kernel shows it once it has stood unended a while, live, then as its line."""
    pipe = PipeText("out")
    assert pipe.feed(b"a line\nepoch 1 ...") == [("out", "a line")]
    began = pipe.since
    assert pipe.waiting(began + 0.1, after=0.5) is None  # a line still being written
    assert pipe.feed(b" .") == [] and pipe.since == began  # the same line, still unended
    assert pipe.waiting(began + 0.6, after=0.5) == "epoch 1 ... ."
    assert pipe.waiting(began + 5, after=0.5) is None  # shown once
    assert pipe.feed(b" .") == [("out-live", "epoch 1 ... . .")]  # grows, as shown
    assert pipe.feed(b" done\nnext") == [("out-live", ""), ("out", "epoch 1 ... . . done")]
    assert pipe.since is not None and pipe.since > began  # "next" began anew
    assert pipe.feed(b"\n") == [("out", "next")] and pipe.since is None


def test_a_display_record_round_trips_and_a_bad_one_is_refused():
    record = encode_display(Display("update_display_data",
                                    {"data": {"text/html": "<b>é\n</b>"},
                                     "transient": {"display_id": "x"}})).decode()
    assert record.startswith(DISPLAY_MARK) and record.endswith("\n") and record.count("\n") == 1
    back = decode_display(record[len(DISPLAY_MARK):-1])
    assert back.content["data"]["text/html"] == "<b>é\n</b>"
    for bad in ("{", '{"msg_type": "comm_open", "content": {}}', '{"content": {}}'):
        with pytest.raises(ValueError, match="display record"):
            decode_display(bad)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_in_a_terminal_every_ranks_live_bar_shares_one_line_below_the_lines():
    out = CellOutput()
    out.streams = {"out": Terminal(), "err": Terminal()}
    out.REDRAW_S = 0.0
    out.write(0, "err-live", " 10%|#")
    out.write(1, "err-live", " 50%|#####")
    out.write(0, "err", "a warning")  # a line goes above the live one
    out.write(1, "err-live", "")  # rank 1's bar ended (cleared) ...
    out.write(0, "err-live", " 90%|#########")
    assert shown(out.streams["err"].getvalue()).split("\n") == [
        "[rank 0] a warning", "[rank 0]  90%|#########"]
    out.write(0, "err", "100%|##########")  # ... and rank 0's ended with its line
    assert shown(out.streams["err"].getvalue()).split("\n") == [
        "[rank 0] a warning", "[rank 0] 100%|##########", ""]
    assert "\r[rank 0]  10%|#   [rank 1]  50%|#####" in out.streams["err"].getvalue()


def test_a_bar_whose_rank_ended_mid_bar_leaves_the_live_line():
    out = CellOutput()
    out.streams = {"out": Terminal(), "err": Terminal()}
    out.write(0, "err-live", " 10%|#")
    out.write(0, "err", " 10%|#")  # the rank died: its unended line comes as a line
    assert shown(out.streams["err"].getvalue()).split("\n") == ["[rank 0]  10%|#", ""]
    assert out._live == {} and out._shown == ""


def test_a_redraw_that_came_too_soon_shows_in_its_turn_though_nothing_follows():
    """A bar's last redraw before a long step (an evaluation) shows within REDRAW_S, not
    at the next output."""
    out = CellOutput()
    out.streams = {"out": Terminal(), "err": Terminal()}
    out.write(0, "err-live", " 1/10")  # shown at once
    out.write(0, "err-live", " 2/10")  # too soon after it
    assert shown(out.streams["err"].getvalue()) == "[rank 0]  1/10"
    deadline = time.monotonic() + 5
    while shown(out.streams["err"].getvalue()) != "[rank 0]  2/10":
        assert time.monotonic() < deadline, out.streams["err"].getvalue()
        time.sleep(0.02)
    assert out._due is None
    out.write(0, "err-live", " 3/10")  # waits its turn again ...
    waiting = out._due
    out.write(0, "err", "10/10")  # ... but the bar ends first: nothing is left waiting
    assert out._due is None and waiting.finished.is_set()


def test_in_a_file_only_the_bars_last_line_is_written():
    out = CellOutput()
    out.streams = {"out": io.StringIO(), "err": io.StringIO()}
    out.REDRAW_S = 0.0
    for i in range(50):
        out.write(0, "err-live", f"{i:3d}%|")
    out.write(0, "err", "100%|")
    assert out.streams["err"].getvalue() == "[rank 0] 100%|\n"


def test_outside_a_kernel_a_display_is_its_text():
    out = CellOutput()
    out.streams = {"out": io.StringIO(), "err": io.StringIO()}
    record = encode_display(Display("display_data", {"data": {"text/plain": "<Table>\nrow"}}))
    out.write(1, "display", record.decode()[len(DISPLAY_MARK):-1])
    out.write(1, "display", "not json")  # a torn record is dropped
    assert out.streams["out"].getvalue() == "[rank 1] <Table>\n[rank 1] row\n"


# -- real ranks --------------------------------------------------------------------------
def bars(ctx, n=40):
    import time

    from tqdm import tqdm

    for _ in tqdm(range(n), desc=f"rank{ctx.rank}", mininterval=0, file=sys.stderr):
        time.sleep(0.01)
    print("after the bar", flush=True)
    return ctx.rank


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_tqdm_bar_leaves_one_line_not_its_redraws(start_method, capsys, no_leftovers):
    pytest.importorskip("tqdm")
    run = nbtrain.launch(bars, devices=2, start_method=start_method, dashboard=False)
    assert run.results == [0, 1]
    err = capsys.readouterr().err  # a file: no live line, each bar's end once
    for rank in (0, 1):
        ends = [e.line for e in run.history.events("output", rank) if e.stream == "stderr"]
        assert len(ends) == 1 and ends[0].startswith(f"rank{rank}: 100%|") \
            and ends[0].endswith("it/s]"), ends  # one line in the history, not 40
        assert f"[rank {rank}] {ends[0]}" in err.split("\n")
    assert "\r" not in err and err.count("\n") < 10, err  # the 80 redraws are not lines


# -- in a kernel ---------------------------------------------------------------------------
SETUP = '''
import os, sys, time, tempfile, torch, nbtrain
from IPython.display import display, HTML

def table(ctx):
    print("before", flush=True)
    handle = display(HTML(f"<b>rank {ctx.rank} at 0</b>"), display_id=True)
    handle.update(HTML(f"<b>rank {ctx.rank} at 1</b>"))
    print("after", flush=True)
    return type(handle).__name__

def widgets(ctx):
    from tqdm.auto import tqdm   # a kernel's shell: tqdm's notebook bar, an ipywidget
    for _ in tqdm(range(20), desc=f"rank{ctx.rank}"):
        time.sleep(0.02)
    return ctx.rank

def bound(ctx):
    for _ in BAR(range(20), desc=f"rank{ctx.rank}"):  # the notebook bar, bound in the kernel
        time.sleep(0.02)
    return ctx.rank

def slow_bars(ctx):
    from tqdm import tqdm
    for i in tqdm(range(30), desc=f"rank{ctx.rank}", mininterval=0):
        time.sleep(0.05)
        if i == 10:
            print("a line between", flush=True)
    return ctx.rank

def chatty(ctx, lines=3000):
    for i in range(lines):
        print("line", i)
        if i == 1000:
            print("warned", file=sys.stderr)
    display(HTML("<b>a display</b>"))
    print("after")
    return ctx.rank

def unended(ctx, flag):
    print("epoch 1 ...", end="", flush=True)
    for _ in range(600):  # until the test has seen it, as a person would
        if os.path.exists(flag):
            break
        time.sleep(0.05)
    print(" done")
    return ctx.rank

def captured(ctx):
    import ipywidgets
    from IPython.display import clear_output
    out = ipywidgets.Output()     # rich's live display in a notebook does this
    display(out)
    for i in range(3):
        with out:
            clear_output(wait=True)
            display(HTML(f"<i>frame {i}</i>"))
    display(HTML(f"<b>after rank {ctx.rank}</b>"))
    return ctx.rank
'''


@pytest.fixture(scope="module")
def k(kernel):
    reply = kernel.run(SETUP)
    assert reply.error is None, reply.error
    return kernel


def run_cell(k, code: str, timeout: float = 240):
    reply = k.run(code, timeout=timeout)
    assert reply.error is None, (reply.error["ename"], reply.error["evalue"], reply.stderr[-3000:])
    return reply


@pytest.mark.kernel
def test_a_forked_ranks_display_and_its_update_show_in_the_launch_cell(k, kernel_clean):
    reply = run_cell(k, "nbtrain.launch(table, devices=2, start_method='fork', dashboard=False).results")
    assert reply.results == ["['DisplayHandle', 'DisplayHandle']"]
    html = sorted(d["text/html"] for d in reply.displays if "text/html" in d)
    assert html == ["<b>rank 0 at 0</b>", "<b>rank 1 at 0</b>"], reply.displays
    updates = [c for kind, c in reply.others if kind == "update_display_data"]
    assert sorted(u["data"]["text/html"] for u in updates) == \
        ["<b>rank 0 at 1</b>", "<b>rank 1 at 1</b>"]
    assert all(u["transient"]["display_id"] for u in updates)
    assert reply.stdout.count("before") == 2 and reply.stdout.count("after") == 2
    assert "nbtrain-display" not in reply.stdout  # the records are not lines


@pytest.mark.kernel
def test_a_chatty_ranks_lines_go_out_batched_and_in_order_with_its_displays(k, kernel_clean):
    """A kernel's stream sends what it holds from its IO thread; flushing it after each
    line waited for that thread every time and throttled the rank printing (50,000 lines:
    23 s instead of 0.6 s). Lines now go out in few messages, in order with the rank's
    displays (which travel on its stdout pipe). Its stderr is another pipe, read as it
    comes, as a terminal shows ``2>``."""
    reply = run_cell(k, "nbtrain.launch(chatty, devices=1, dashboard=False).results")
    assert reply.results == ["[0]"]
    assert reply.stdout.splitlines() == [f"[rank 0] line {i}" for i in range(3000)] \
        + ["[rank 0] after"]
    assert reply.stderr == "[rank 0] warned\n"
    seq = reply.sequence
    outs = [i for i, (kind, _) in enumerate(seq) if kind == "stdout"]
    assert len(outs) < 300, f"{len(outs)} stream messages for 3001 lines"  # not one a line
    [shown] = [i for i, (kind, data) in enumerate(seq) if kind == "display"
               and data.get("text/html") == "<b>a display</b>"]
    before_display = "".join(text for i, (kind, text) in enumerate(seq[:shown]) if i in outs)
    assert before_display.endswith("[rank 0] line 2999\n")  # the display after its lines
    assert "after" in seq[outs[-1]][1] and outs[-1] > shown


@pytest.mark.kernel
def test_a_line_a_rank_left_unended_shows_while_it_waits(k, kernel_clean, tmp_path):
    """The rank goes on only once the cell has shown its unended line (its line then
    ends, and shows as a line)."""
    flag = tmp_path / "seen"
    msg_id = k.submit(f"nbtrain.launch(unended, devices=1, dashboard=False, flag={str(flag)!r})")

    def live(reply) -> list[str]:
        return [c["data"].get("text/plain", "") for kind, c in
                [("display_data", {"data": d}) for d in reply.displays] + reply.others
                if kind in ("display_data", "update_display_data")]

    reply = k.collect(msg_id, timeout=60,
                      until=lambda r: "[rank 0] epoch 1 ..." in live(r))
    assert "epoch" not in reply.stdout  # shown live, not yet as a line
    flag.touch()
    reply = k.collect(msg_id, timeout=60)
    assert reply.error is None, reply.error
    assert reply.stdout == "[rank 0] epoch 1 ... done\n"
    assert live(reply)[-1] == ""  # the live line gave way to the line


@pytest.mark.kernel
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_spawned_ranks_displays_updates_and_figures_show_in_the_launch_cell(
        k, kernel_clean, start_method):
    """A rank that is no fork of the kernel had no shell: display() printed the text, its
    handle was None (update() failed), a matplotlib figure read "Figure(640x480)" (the
    fork server's ranks, what a kernel that touched CUDA launches, are such ranks)."""
    plots = importlib.util.find_spec("matplotlib") is not None
    reply = run_cell(k, f"""
        def shown(ctx):
            from IPython.display import HTML, display
            handle = display(HTML(f"<b>rank {{ctx.rank}} at 0</b>"), display_id=True)
            handle.update(HTML(f"<b>rank {{ctx.rank}} at 1</b>"))
            if {plots} and ctx.rank == 0:
                import matplotlib.pyplot as plt
                plt.plot([1, 2, 3])
                plt.show()
            return type(handle).__name__

        nbtrain.launch(shown, devices=2, start_method={start_method!r}, dashboard=False).results
    """)
    assert reply.results == ["['DisplayHandle', 'DisplayHandle']"]
    html = sorted(d["text/html"] for d in reply.displays if "text/html" in d)
    assert html == ["<b>rank 0 at 0</b>", "<b>rank 1 at 0</b>"], reply.displays
    updates = [c["data"]["text/html"] for kind, c in reply.others if kind == "update_display_data"]
    assert sorted(updates) == ["<b>rank 0 at 1</b>", "<b>rank 1 at 1</b>"]
    assert "Figure(" not in reply.stdout and "DisplayHandle" not in reply.stdout
    if plots:
        assert sum("image/png" in d for d in reply.displays) == 1, reply.displays


@pytest.mark.kernel
def test_a_forked_ranks_widgets_leave_the_cell_alone_and_an_output_widget_is_a_display(
        k, kernel_clean):
    """A widget's comms would live in the rank; an Output widget's capture and its
    clear_output would reach into the cell the dashboard shares: none of it is passed
    on (nbclient, which papermill and nbconvert use, failed on two ranks' captures).
    What an Output widget captures replaces a display standing in for it."""
    pytest.importorskip("tqdm")
    pytest.importorskip("ipywidgets")
    run_cell(k, "import tqdm.auto, tqdm.notebook\nBAR = tqdm.auto.tqdm\n"
                "assert issubclass(BAR, tqdm.notebook.tqdm)")  # the kernel's
    for fn in ("widgets", "bound", "captured"):
        reply = run_cell(k, f"nbtrain.launch({fn}, devices=2, start_method='fork', "
                            "dashboard=False).results")
        assert reply.results == ["[0, 1]"]
        kinds = {kind for kind, _ in reply.others}
        assert kinds <= {"update_display_data"}, reply.others[:3]  # no comm, no clear_output
        assert not any("application/vnd.jupyter.widget-view+json" in d for d in reply.displays)
        if fn != "captured":  # tqdm's notebook bar, the kernel's, draws text here
            ends = [line for line in reply.stderr.splitlines() if "100%|" in line]
            assert sorted(e.split(":")[0] for e in ends) == ["[rank 0] rank0", "[rank 1] rank1"]
    html = sorted(d["text/html"] for d in reply.displays if "text/html" in d)
    # each rank's Output widget is a display its captures replace: the first frame,
    # then its last as an update
    assert html == ["<b>after rank 0</b>", "<b>after rank 1</b>", "<i>frame 0</i>",
                    "<i>frame 0</i>"], reply.displays
    last: dict[str, str] = {}
    for _, content in reply.others:
        last[content["transient"]["display_id"]] = content["data"]["text/html"]
    assert list(last.values()) == ["<i>frame 2</i>", "<i>frame 2</i>"], reply.others


@pytest.mark.kernel
def test_a_rich_live_display_shows_as_one_display_per_rank_updated_in_place(k, kernel_clean):
    """rich draws its live display (a progress bar; Lightning's default bar when rich is
    installed) in an ipywidgets Output widget, whose capture a forked rank's cell cannot
    hold: it showed nothing. The widget is now a display that what it captures replaces,
    at most 5 times a second, the last state always shown."""
    pytest.importorskip("rich")
    reply = run_cell(k, """
        def rich_bar(ctx):
            import time
            from rich.progress import track
            for _ in track(range(40), description=f"rank {ctx.rank}"):
                time.sleep(0.03)
            return ctx.rank

        nbtrain.launch(rich_bar, devices=2, start_method='fork', dashboard=False).results
    """)
    assert reply.results == ["[0, 1]"]
    stand_ins = [d for d in reply.displays if "application/vnd.jupyter.widget-view+json" in d]
    assert not stand_ins  # no widget reaches the cell ...
    updates: dict[str, list[str]] = {}
    for kind, content in reply.others:
        if kind == "update_display_data":
            updates.setdefault(content["transient"]["display_id"], []).append(
                content["data"].get("text/plain", ""))
    assert len(updates) == 2, updates.keys()  # ... a display per rank's bar, updated
    for texts in updates.values():
        assert "100%" in texts[-1] and len(texts) < 15, texts  # the end, throttled
    assert sorted(next(t for t in texts if "rank" in t).split()[0] + " " +
                  next(t for t in texts if "rank" in t).split()[1]
                  for texts in updates.values()) == ["rank 0", "rank 1"]


@pytest.mark.kernel
def test_in_a_kernel_the_ranks_bars_are_one_display_updated_in_place(k, kernel_clean):
    """A notebook keeps each run of stream text as one output: a line redrawn with
    carriage returns would stay behind in it once a display or the other stream came
    between. The live line is a display updated by its id; the stream gets each end."""
    reply = run_cell(k, "nbtrain.launch(slow_bars, devices=2, start_method='fork', "
                        "dashboard=False).results")
    assert reply.results == ["[0, 1]"]
    live = [d for d in reply.displays if d.get("text/plain", "").startswith("[rank ")]
    assert len(live) == 1, reply.displays  # one display, made at the first redraw ...
    updates = [c["data"]["text/plain"] for kind, c in reply.others
               if kind == "update_display_data"]
    assert any("[rank 0] rank0:" in u and "[rank 1] rank1:" in u for u in updates), updates
    assert updates[-1] == ""  # ... empty once the bars ended
    assert len(updates) < 40, len(updates)  # at most 5 redraws a second, not one per redraw
    assert "\r" not in reply.stderr
    ends = [line for line in reply.stderr.splitlines() if "%|" in line]
    assert sorted(e.split(":")[0] for e in ends) == ["[rank 0] rank0", "[rank 1] rank1"], ends


@pytest.mark.kernel
def test_a_pool_cells_displays_and_bars_show_in_that_cell(k, kernel_clean):
    run_cell(k, "%load_ext nbtrain\npool = nbtrain.RankPool(devices=2)")
    try:
        reply = run_cell(k, """
            %%ranks
            import time
            from IPython.display import display, Markdown
            from tqdm import tqdm
            display(Markdown(f"**rank {rank}**"))
            for _ in tqdm(range(20), desc=f"rank{rank}", mininterval=0):
                time.sleep(0.03)
        """)
        assert sorted(d.get("text/markdown") for d in reply.displays if "text/markdown" in d) \
            == ["**rank 0**", "**rank 1**"], reply.displays
        updates = [c["data"]["text/plain"] for kind, c in reply.others
                   if kind == "update_display_data"]  # the bars, live in this cell
        assert any("rank0:" in u for u in updates) and updates[-1] == "", updates
        ends = [line for line in reply.stderr.splitlines() if "%|" in line]
        assert sorted(e.split(":")[0] for e in ends) == ["[rank 0] rank0", "[rank 1] rank1"]
    finally:
        run_cell(k, "pool.close()")


@pytest.mark.kernel
def test_a_transformers_trainer_shows_one_notebook_table_rank_0s(k, kernel_clean):
    """The kernel imported Trainer, so every rank would draw the notebook table (one per
    rank, the same steps); rank 0 draws it, the others nothing, as in a terminal."""
    pytest.importorskip("transformers")
    reply = run_cell(k, '''
        import transformers as tf
        from transformers import Trainer   # the kernel imports trainer: its notebook callback

        def hf_main():
            torch.manual_seed(0)
            model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                     vocab_size=32, n_positions=8))
            ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))
            args = tf.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3,
                per_device_train_batch_size=4, use_cpu=True, report_to=[], logging_steps=1,
                save_strategy="no")
            trainer = Trainer(model=model, args=args,
                                 train_dataset=[{"input_ids": r, "labels": r} for r in ids])
            trainer.train()
            return sorted(type(c).__name__ for c in trainer.callback_handler.callbacks)

        nbtrain.launch(hf_main, devices=2, start_method="fork", dashboard=False).results
    ''')
    first, second = ast.literal_eval(reply.results[0])
    assert "NotebookProgressCallback" in first and "ProgressCallback" in second, reply.results
    tables = [d["text/html"] for d in reply.displays if "<progress" in d.get("text/html", "")]
    assert len(tables) == 1, reply.displays
    bars = [line for line in reply.stderr.splitlines() if "%|" in line]
    assert bars == [], bars  # nor a text bar of rank 1's own
    last = [c["data"]["text/html"] for kind, c in reply.others if kind == "update_display_data"]
    assert any("value='3' max='3'" in t for t in last), last[-1:]


@pytest.mark.kernel
def test_a_ranks_breakpoint_is_a_debugger_in_the_launch_cells_input_box(k, kernel_clean):
    """In a kernel, a rank's breakpoint() was the kernel's (debugpy's: nothing happened)
    and its input() waited forever on the kernel's socket. Now the launching cell asks
    in its input box, labelled with the rank (test_questions.py: the same outside one)."""
    debugger = iter(["p secret * 10", "secret = 7", "c"])
    reply = k.run("""
        def debugged(ctx):
            secret = 40 + ctx.rank
            if ctx.rank == 1:
                breakpoint()
            return secret, input(f"rank {ctx.rank} done? ")

        nbtrain.launch(debugged, devices=2, start_method='fork', dashboard=False).results
    """, answers=lambda prompt: prompt[1:7] if "done?" in prompt else next(debugger),
        timeout=240)
    assert reply.error is None, (reply.error, reply.stderr[-3000:])
    asked = [p for p in reply.prompts if "done?" not in p]
    assert len(asked) == 3 and all(p.startswith("[rank 1] ") for p in asked), reply.prompts
    assert sorted(set(reply.prompts) - set(asked)) == ["[rank 0] rank 0 done? ",
                                                       "[rank 1] rank 1 done? "]
    assert "[rank 1] 410" in reply.stdout, reply.stdout[-2000:]  # what `p` printed
    assert reply.results == ["[(40, 'rank 0'), (7, 'rank 1')]"]  # the assignment took


@pytest.mark.kernel
def test_an_interrupt_while_the_cell_asks_for_a_ranks_input_stops_the_run(k, kernel_clean):
    reply = k.run("nbtrain.launch(lambda ctx: input('x? '), devices=2, start_method='fork', "
                  "dashboard=False)", answers=lambda prompt: k.interrupt_group(), timeout=120)
    assert reply.ename == "KeyboardInterrupt", reply.error
    assert "the run was stopped" in reply.error["evalue"]
    assert reply.prompts and reply.prompts[0].endswith("] x? ")
    assert k.value("nbtrain.last_run().status") == "stopped"


@pytest.mark.kernel
def test_where_the_frontend_takes_no_input_a_ranks_question_fails_it_at_once(k, kernel_clean):
    """nbclient (papermill, nbconvert, nbval) runs cells without input: the rank fails
    at once, saying why, instead of waiting for ever."""
    reply = k.run("nbtrain.launch(lambda ctx: input('x? '), devices=2, start_method='fork', "
                  "dashboard=False)", allow_stdin=False, timeout=120)
    assert reply.ename == "WorkerError", reply.error
    assert "asked for input and nothing could answer it" in reply.error["evalue"]
    assert "StdinNotImplementedError" in reply.error["evalue"] + reply.stderr
